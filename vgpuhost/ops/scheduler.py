"""The vGPU scheduler: the ``RmPVMRL`` encoder/decoder, its modprobe.d file, and runtime NVML changes.

Owns: the bit layout of the ``RmPVMRL`` registry dword (pure
:func:`encode` / :func:`decode` / :func:`explain`), the persistent form
(``<root>/etc/modprobe.d/vgpuhost-scheduler.conf``, written only through
:meth:`vgpuhost.sysfs.Sysfs.write_config` so it is audited), the runtime form
through the NVML backend (:func:`set_runtime`, :func:`show`) and mixed-size
mode (:func:`mixed_size`).  Must not: talk to pynvml directly (that is
:mod:`vgpuhost.nvml`) or print.

Sources (REFERENCE.md §4, §6, §7):

* ``RmPVMRL`` layout, open-gpu-kernel-modules ``src/nvidia/interface/nvrm_registry.h``:
  bit 0 enable equal/fixed share; bit 1 ARR disable; bits 7:4 policy
  (0 equal, 1 fixed); with ARR: bits 21:12 frequency (Hz, 63..960) and
  bits 31:24 averaging factor (1..60); without ARR: bits 23:16 time slice
  (ms, 1..30).  The frequency and time-slice fields overlap (21:16); bit 1
  says which one the value holds.  A field left 0 means "driver default",
  which is how the documented ``0x01`` (equal share) and ``0x11`` (fixed
  share) read.  Driver defaults: <= 8 vGPUs on the GPU -> 2 ms / 480 Hz,
  > 8 -> 1 ms / 960 Hz.
* How the driver reads it (``kern_sched_mgr.c``, ``_kschedmgrGetSchedulerPolicy``):
  bit 0 clear -> best effort (every other bit ignored); a policy other than
  0/1 -> the key is ignored; MIG mode -> no software scheduler at all.
* ``NVreg_RegistryDwordsPerDevice`` format, open-gpu-kernel-modules
  ``kernel-open/nvidia/nv-reg.h``:
  ``"pci=DDDD:BB:DD.F;<key=value>;<key=value>;..;pci=DDDD:BB:DD.F;<key=value>;.."``
  -- several GPUs go in one string, each group of keys after its ``pci=``;
  keys after a ``pci=`` naming no present GPU are skipped.
* Runtime: NVML only while no vGPU runs on the GPU; device-level calls
  return NOT_SUPPORTED in MIG mode; fixed share is not available in
  mixed-size mode; mixed-size mode needs no running vGPUs.
"""

from __future__ import annotations

import errno
import os
import re
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..model.errors import DeviceError, HostEnvironmentError, InputError, RefusedError
from ..io.hostroot import HostRoot
from ..io.nvml import NvmlError, SchedulerCaps, SchedulerState
from ..io.sysfs import read_config_text
from ..io.process import actor as actor_name
from ..model.values import PciAddress

POLICIES = ("best-effort", "equal-share", "fixed-share")
POLICY_TEXT = {"best-effort": "best effort", "equal-share": "equal share", "fixed-share": "fixed share"}

# --- bit layout (nvrm_registry.h, REFERENCE.md §6) ----------------------------
ENABLE_BIT = 1 << 0          # equal/fixed share on; clear = best effort
ARR_DISABLE_BIT = 1 << 1     # set = no adaptive round robin (time slice given instead)
POLICY_SHIFT, POLICY_MASK = 4, 0xF          # bits 7:4
FREQ_SHIFT, FREQ_MASK = 12, 0x3FF           # bits 21:12 (with ARR)
TIMESLICE_SHIFT, TIMESLICE_MASK = 16, 0xFF  # bits 23:16 (without ARR)
AVG_SHIFT, AVG_MASK = 24, 0xFF              # bits 31:24 (with ARR)
POLICY_CODES = {"equal-share": 0, "fixed-share": 1}

TIMESLICE_RANGE = (1, 30)      # ms
FREQUENCY_RANGE = (63, 960)    # Hz
AVG_FACTOR_RANGE = (1, 60)

DEFAULTS_NOTE = "driver default: <= 8 vGPUs on the GPU -> 2 ms / 480 Hz, > 8 -> 1 ms / 960 Hz"

CONF_NAME = "vgpuhost-scheduler.conf"
REG_KEY = "RmPVMRL"


# =============================================================================
# encoder / decoder (pure)

def _check_range(what: str, value: Optional[int], rng: Tuple[int, int], unit: str = "") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{what} {value!r} is not a whole number", hint=f"give {rng[0]}..{rng[1]}")
    if not rng[0] <= value <= rng[1]:
        u = f" {unit}" if unit else ""
        raise InputError(f"{what} {value}{u} out of range {rng[0]}..{rng[1]}")


def validate(state: SchedulerState) -> SchedulerState:
    """Refuse a state no ``RmPVMRL`` value (nor NVML) can hold; return it unchanged.

    Best effort takes no parameters and no ARR; with ARR only frequency and
    averaging factor, without ARR only the time slice.  ``None`` = driver default.
    """
    if state.policy not in POLICIES:
        raise InputError(f"unknown scheduler policy {state.policy!r}", hint="one of: " + ", ".join(POLICIES))
    if state.policy == "best-effort":
        extra = [n for n, v in (("timeslice", state.timeslice_ms), ("frequency", state.frequency_hz),
                                ("averaging factor", state.avg_factor)) if v is not None]
        if extra or state.arr:
            what = ", ".join(extra + (["ARR"] if state.arr else []))
            raise InputError(f"best effort takes no {what}",
                             hint="time slice, frequency and averaging factor apply to equal-share and fixed-share")
        return state
    if state.arr:
        if state.timeslice_ms is not None:
            raise InputError("a time slice applies only without adaptive round robin (ARR)",
                             hint="give --timeslice-ms alone, or --frequency-hz and --avg-factor")
    elif state.frequency_hz is not None or state.avg_factor is not None:
        raise InputError("frequency and averaging factor apply only with adaptive round robin (ARR)",
                         hint="give --frequency-hz and --avg-factor, or --timeslice-ms alone")
    _check_range("timeslice", state.timeslice_ms, TIMESLICE_RANGE, "ms")
    _check_range("frequency", state.frequency_hz, FREQUENCY_RANGE, "Hz")
    _check_range("averaging factor", state.avg_factor, AVG_FACTOR_RANGE)
    return state


def encode(state: SchedulerState) -> int:
    """The ``RmPVMRL`` dword for ``state`` (validated; best effort -> 0)."""
    validate(state)
    if state.policy == "best-effort":
        return 0
    value = ENABLE_BIT | (POLICY_CODES[state.policy] << POLICY_SHIFT)
    if state.arr:
        value |= (state.frequency_hz or 0) << FREQ_SHIFT
        value |= (state.avg_factor or 0) << AVG_SHIFT
    else:
        value |= ARR_DISABLE_BIT
        value |= (state.timeslice_ms or 0) << TIMESLICE_SHIFT
    return value


def _fields(value: int) -> Dict[str, int]:
    return {
        "enable": value & ENABLE_BIT,
        "arr_disable": (value & ARR_DISABLE_BIT) >> 1,
        "policy": (value >> POLICY_SHIFT) & POLICY_MASK,
        "frequency": (value >> FREQ_SHIFT) & FREQ_MASK,
        "timeslice": (value >> TIMESLICE_SHIFT) & TIMESLICE_MASK,
        "avg": (value >> AVG_SHIFT) & AVG_MASK,
    }


def _problems(value: int) -> List[str]:
    """Why ``value`` is not a value :func:`encode` would produce (empty: it is)."""
    f = _fields(value)
    out: List[str] = []
    if not f["enable"]:
        if value:
            out.append(f"bit 0 is clear (best effort) but other bits are set (0x{value:08x}); the driver ignores them")
        return out
    if value & 0b1100:
        out.append("reserved bits 3:2 are set")
    if value & 0xF00:
        out.append("reserved bits 11:8 are set")
    if f["policy"] not in POLICY_CODES.values():
        out.append(f"policy {f['policy']} in bits 7:4 is neither 0 (equal share) nor 1 (fixed share); "
                   "the driver ignores the key")
    if f["arr_disable"]:
        if value & (0xF << 12):
            out.append("bits 15:12 are set but only the time slice (bits 23:16) applies without ARR")
        if f["avg"]:
            out.append("an averaging factor (bits 31:24) is set but applies only with ARR")
        ts = f["timeslice"]
        if ts and not TIMESLICE_RANGE[0] <= ts <= TIMESLICE_RANGE[1]:
            out.append(f"timeslice {ts} ms out of range {TIMESLICE_RANGE[0]}..{TIMESLICE_RANGE[1]}")
    else:
        if value & (0x3 << 22):
            out.append("reserved bits 23:22 are set (with ARR, bits 21:12 hold the frequency)")
        fr, avg = f["frequency"], f["avg"]
        if fr and not FREQUENCY_RANGE[0] <= fr <= FREQUENCY_RANGE[1]:
            out.append(f"frequency {fr} Hz out of range {FREQUENCY_RANGE[0]}..{FREQUENCY_RANGE[1]}")
        if avg and not AVG_FACTOR_RANGE[0] <= avg <= AVG_FACTOR_RANGE[1]:
            out.append(f"averaging factor {avg} out of range {AVG_FACTOR_RANGE[0]}..{AVG_FACTOR_RANGE[1]}")
    return out


def _check_dword(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise InputError(f"RmPVMRL value {value!r} is not a 32-bit unsigned number", hint="give 0x0..0xffffffff")


def decode(value: int) -> SchedulerState:
    """The state an ``RmPVMRL`` dword holds; InputError when it is not one :func:`encode` gives.

    Fields left 0 decode to ``None`` (driver default).
    """
    _check_dword(value)
    problems = _problems(value)
    if problems:
        raise InputError(f"RmPVMRL=0x{value:08x} is not a valid scheduler value: {'; '.join(problems)}",
                         hint="'vgpuhost scheduler decode VALUE' explains each field")
    f = _fields(value)
    if not f["enable"]:
        return SchedulerState("best-effort")
    policy = "equal-share" if f["policy"] == 0 else "fixed-share"
    if f["arr_disable"]:
        return SchedulerState(policy, arr=False, timeslice_ms=f["timeslice"] or None)
    return SchedulerState(policy, arr=True, frequency_hz=f["frequency"] or None, avg_factor=f["avg"] or None)


def describe(state: SchedulerState) -> str:
    """One line: ``equal share, ARR on, frequency 960 Hz, averaging factor 60``."""
    if state.policy == "best-effort":
        return "best effort"
    parts = [POLICY_TEXT.get(state.policy, state.policy)]
    if state.arr:
        parts.append("ARR on")
        parts.append(f"frequency {state.frequency_hz} Hz" if state.frequency_hz else "default frequency")
        parts.append(f"averaging factor {state.avg_factor}" if state.avg_factor else "default averaging factor")
    else:
        parts.append("ARR off")
        parts.append(f"time slice {state.timeslice_ms} ms" if state.timeslice_ms else "default time slice")
    return ", ".join(parts)


def parse_value(text: str) -> int:
    """``0x3c3c0001`` or ``1010565121`` -> int (32-bit unsigned); InputError otherwise."""
    t = str(text).strip()
    try:
        if not re.fullmatch(r"0[xX][0-9a-fA-F]{1,8}|[0-9]{1,10}", t):   # ASCII only, no '_' or signs
            raise ValueError(t)
        value = int(t, 16) if t.lower().startswith("0x") else int(t, 10)
    except ValueError:
        raise InputError(f"invalid RmPVMRL value {str(text)[:40]!r}",
                         hint="give a hex value such as 0x3c3c0001 or a decimal number") from None
    _check_dword(value)
    return value


def explain(value: int) -> str:
    """Human text for an ``RmPVMRL`` dword: the meaning, then field by field."""
    _check_dword(value)
    f = _fields(value)
    problems = _problems(value)
    lines: List[str] = []
    if problems:
        head = "not a valid scheduler value"
    else:
        head = describe(decode(value))
    lines.append(f"RmPVMRL=0x{value:08x}: {head}")
    lines.append(f"  bit 0      = {f['enable']:<6} " + ("equal/fixed share enabled" if f["enable"]
                                                       else "best effort (default scheduler)"))
    if f["enable"]:
        lines.append(f"  bit 1      = {f['arr_disable']:<6} adaptive round robin (ARR) "
                     + ("disabled" if f["arr_disable"] else "enabled"))
        pol = {0: "equal share", 1: "fixed share"}.get(f["policy"], "invalid")
        lines.append(f"  bits 7:4   = {f['policy']:<6} policy: {pol}")
        if f["arr_disable"]:
            ts = f["timeslice"]
            lines.append(f"  bits 23:16 = {ts:<6} time slice "
                         + (f"{ts} ms" if ts else "default") + f" (range {TIMESLICE_RANGE[0]}..{TIMESLICE_RANGE[1]} ms)")
        else:
            fr, avg = f["frequency"], f["avg"]
            lines.append(f"  bits 21:12 = {'0x%x' % fr:<6} frequency " + (f"{fr} Hz" if fr else "default")
                         + f" (range {FREQUENCY_RANGE[0]}..{FREQUENCY_RANGE[1]} Hz)")
            lines.append(f"  bits 31:24 = {'0x%x' % avg:<6} averaging factor " + (f"{avg}" if avg else "default")
                         + f" (range {AVG_FACTOR_RANGE[0]}..{AVG_FACTOR_RANGE[1]})")
        if (not f["arr_disable"] and not (f["frequency"] and f["avg"])) or (f["arr_disable"] and not f["timeslice"]):
            lines.append(f"  {DEFAULTS_NOTE}")
    lines += [f"  problem: {p}" for p in problems]
    return "\n".join(lines)


def explain_doc(value: int) -> Dict[str, object]:
    """The ``--json`` form of :func:`explain`."""
    _check_dword(value)
    problems = _problems(value)
    state = None if problems else asdict(decode(value))
    f = _fields(value)
    # the frequency (21:12) and time-slice (23:16) fields overlap: bit 1 says which one the value holds
    fields: Dict[str, object] = {"enable": f["enable"], "arr_disable": None, "policy": None,
                                 "frequency_hz": None, "avg_factor": None, "timeslice_ms": None}
    if f["enable"]:
        fields.update(arr_disable=f["arr_disable"], policy=f["policy"])
        if f["arr_disable"]:
            fields["timeslice_ms"] = f["timeslice"]
        else:
            fields.update(frequency_hz=f["frequency"], avg_factor=f["avg"])
    return {"schema": "vgpuhost.scheduler-decode/v1", "value": f"0x{value:08x}", "valid": not problems,
            "state": state, "text": None if problems else describe(decode(value)),
            "fields": fields,
            "problems": problems}


# =============================================================================
# persistent form: <root>/etc/modprobe.d/vgpuhost-scheduler.conf

def conf_path(host: HostRoot) -> Path:
    return host.modprobe_d / CONF_NAME


_OPT_RE = re.compile(r'^\s*options\s+nvidia\s+(NVreg_RegistryDwords(?:PerDevice)?)="([^"]*)"\s*$')


@dataclass
class SchedulerConf:
    """What vgpuhost's modprobe.d file holds: keys for all GPUs, and per GPU (ordered)."""

    all_gpus: List[Tuple[str, str]] = field(default_factory=list)
    per_device: Dict[str, List[Tuple[str, str]]] = field(default_factory=dict)

    def value_for(self, bdf: Optional[str]) -> Optional[int]:
        keys = self.per_device.get(bdf, []) if bdf else self.all_gpus
        for k, v in keys:
            if k == REG_KEY:
                try:
                    return int(v, 0)
                except ValueError:
                    return None
        return None


def _pairs(text: str) -> List[Tuple[str, str]]:
    out = []
    for item in text.split(";"):
        item = item.strip()
        if item:
            k, _, v = item.partition("=")
            out.append((k.strip(), v.strip()))
    return out


def parse_conf(text: str) -> SchedulerConf:
    """Parse the ``options nvidia NVreg_RegistryDwords[PerDevice]="..."`` lines vgpuhost writes."""
    conf = SchedulerConf()
    for line in text.splitlines():
        m = _OPT_RE.match(line)
        if not m:
            continue
        if m[1] == "NVreg_RegistryDwords":
            conf.all_gpus = _pairs(m[2])
            continue
        current: Optional[str] = None
        for k, v in _pairs(m[2]):
            if k == "pci":
                current = v.lower()
                conf.per_device.setdefault(current, [])
            elif current is not None:
                conf.per_device[current].append((k, v))
    return conf


def _set_key(pairs: List[Tuple[str, str]], key: str, value: str) -> List[Tuple[str, str]]:
    out = [(k, v) for k, v in pairs if k != key]
    return out + [(key, value)]


def render_conf(conf: SchedulerConf) -> str:
    """The file's exact text.

    One ``NVreg_RegistryDwords`` line for all GPUs and one
    ``NVreg_RegistryDwordsPerDevice`` line holding every GPU's entries as
    ``pci=<BDF>;Key=Value;pci=<BDF>;Key=Value`` (format of nv-reg.h; a module
    option given twice keeps only the last, so several GPUs must share one line).
    """
    lines = ["# Written by vgpuhost ('vgpuhost scheduler set --persist'); edits may be replaced.",
             "# RmPVMRL: vGPU scheduler policy ('vgpuhost scheduler decode VALUE' explains a value).",
             "# Takes effect when the nvidia module is reloaded or the host reboots."]
    if conf.all_gpus:
        lines.append('options nvidia NVreg_RegistryDwords="' + ";".join(f"{k}={v}" for k, v in conf.all_gpus) + '"')
    per = [(bdf, pairs) for bdf, pairs in sorted(conf.per_device.items()) if pairs]
    if per:
        items: List[str] = []
        for bdf, pairs in per:
            items.append(f"pci={bdf}")
            items += [f"{k}={v}" for k, v in pairs]
        lines.append('options nvidia NVreg_RegistryDwordsPerDevice="' + ";".join(items) + '"')
    return "\n".join(lines) + "\n"


def read_conf(host: HostRoot) -> SchedulerConf:
    return parse_conf(read_config_text(conf_path(host)) or "")


def _other_registry_files(host: HostRoot) -> List[str]:
    """Other modprobe.d files setting the same module options (the last one read wins)."""
    out = []
    try:
        names = sorted(os.listdir(host.modprobe_d))
    except OSError:
        return out
    for name in names:
        if name == CONF_NAME or not name.endswith(".conf"):
            continue
        text = read_config_text(host.modprobe_d / name) or ""
        if re.search(r"NVreg_RegistryDwords(PerDevice)?\s*=", text):
            out.append(host.relative(host.modprobe_d / name))
    return out


@dataclass
class PersistOutcome:
    path: str
    value: int
    gpus: List[str]            # empty: all GPUs
    changed: bool
    dry_run: bool
    text: str
    notes: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, object]:
        return {"schema": "vgpuhost.scheduler-persist/v1", "path": self.path, "value": f"0x{self.value:08x}",
                "meaning": describe(decode(self.value)), "gpus": self.gpus or "all", "changed": self.changed,
                "dry_run": self.dry_run, "text": self.text, "notes": self.notes}


def persist(host: HostRoot, store, state: SchedulerState, gpu: Union[None, PciAddress, Sequence[PciAddress]] = None,
            *, dry_run: bool = False, actor: Optional[str] = None) -> PersistOutcome:
    """Write ``RmPVMRL`` for all GPUs (``gpu=None``) or per GPU to vgpuhost's modprobe.d file.

    All GPUs: sets ``NVreg_RegistryDwords`` and drops per-GPU ``RmPVMRL``
    entries so every GPU gets the value.  Per GPU: adds/replaces that GPU's
    entry in ``NVreg_RegistryDwordsPerDevice``.  Other keys in the file are
    kept.  No write when the text would not change (idempotent).
    """
    from ..io.locks import file_lock
    from ..plan.steps import Executor

    value = encode(state)
    hexval = f"0x{value:02x}" if value <= 0xFF else f"0x{value:08x}"
    gpus: List[PciAddress] = [] if gpu is None else ([gpu] if isinstance(gpu, PciAddress) else list(gpu))
    path = conf_path(host)
    with ExitStack() as stack:
        if not dry_run:
            stack.enter_context(file_lock(store.state_dir, "scheduler-conf"))
        old = read_config_text(path)
        conf = parse_conf(old or "")
        if not gpus:
            conf.all_gpus = _set_key(conf.all_gpus, REG_KEY, hexval)
            for bdf in list(conf.per_device):
                conf.per_device[bdf] = [(k, v) for k, v in conf.per_device[bdf] if k != REG_KEY]
        else:
            for g in gpus:
                conf.per_device[str(g)] = _set_key(conf.per_device.get(str(g), []), REG_KEY, hexval)
        text = render_conf(conf)
        changed = text != old
        if changed and not dry_run:
            ex = Executor(host, store, actor=actor or actor_name(),
                          operation="scheduler set --persist " + (",".join(map(str, gpus)) or "--all"))
            ex.fs.write_config(path, text)
    notes = []
    if changed:
        notes.append("takes effect after the nvidia module is reloaded (no VM may use the GPU) or the host reboots")
    else:
        notes.append(f"{host.relative(path)} already holds this value")
    if state.policy != "best-effort":
        notes.append("the driver ignores it on a GPU in MIG mode (no software scheduler there)")
    if state.policy == "fixed-share":
        notes.append("fixed share is not available while a GPU is in mixed-size mode")
    others = _other_registry_files(host)
    if others:
        notes.append("other modprobe.d files also set NVreg_RegistryDwords*: " + ", ".join(others)
                     + " (a module option given twice keeps the last one read): merge them")
    return PersistOutcome(path=host.relative(path), value=value, gpus=[str(g) for g in gpus], changed=changed,
                          dry_run=dry_run, text=text, notes=notes)


# =============================================================================
# runtime form: NVML

def open_backend(host: HostRoot):
    """The NVML backend for ``host``; HostEnvironmentError (exit 2) when there is none."""
    from ..io.backends import backend_for
    try:
        return backend_for(host)
    except HostEnvironmentError:
        raise
    except ImportError as e:
        raise HostEnvironmentError(f"NVML is not available ({e})",
                                   hint="the vGPU scheduler needs the NVIDIA vGPU manager driver and "
                                        "nvidia-ml-py (pip install nvidia-ml-py)") from None
    except NvmlError as e:
        raise HostEnvironmentError(f"NVML is not available ({e.nvml_name})",
                                   hint="is the NVIDIA vGPU manager driver loaded?") from None


def host_gpus(host: HostRoot) -> List[PciAddress]:
    """The NVIDIA GPUs sysfs shows (physical functions)."""
    from ..observe.inventory import discover
    from ..io.sysfs import Sysfs
    host.require_host()
    return [g.address for g in discover(Sysfs(host), with_types=False).gpus]


def resolve_gpus(host: HostRoot, gpus: Sequence[PciAddress], all_gpus: bool) -> List[PciAddress]:
    known = host_gpus(host)
    if all_gpus:
        if not known:
            raise InputError("no NVIDIA GPU found on this host", hint="'vgpuhost gpus' lists them")
        return known
    for g in gpus:
        if g not in known:
            raise InputError(f"no NVIDIA GPU at {g}",
                             hint=f"GPUs on this host: {', '.join(map(str, known)) or 'none'} ('vgpuhost gpus')")
    return sorted(set(gpus), key=str)


def _mig_on(backend, bdf: PciAddress) -> bool:
    try:
        mode = backend.mig_mode(bdf)
    except NvmlError as e:
        if e.not_supported:
            return False
        raise
    return bool(mode and mode[0])


def _refuse_mig(bdf: PciAddress, what: str) -> RefusedError:
    return RefusedError(f"GPU {bdf} is in MIG mode: {what} is not available at device level there "
                        "(NVML returns NOT_SUPPORTED)",
                        hint="per-GPU-instance scheduling is not supported by vgpuhost yet; "
                             "disable MIG ('vgpuhost mig disable') to use the device-level scheduler")


def _supported(bdf: PciAddress, what: str, fn):
    """``fn()``; NOT_SUPPORTED becomes a one-line refusal naming the GPU (plain data-centre driver...)."""
    try:
        return fn()
    except NvmlError as e:
        if e.not_supported:
            raise RefusedError(f"GPU {bdf}: {what} is not available ({e.call}: {e.nvml_name})",
                               hint="this needs the NVIDIA vGPU manager driver (not the plain data-centre "
                                    "driver) on a GPU that supports vGPU") from None
        raise


def check_caps(bdf: PciAddress, state: SchedulerState, caps: SchedulerCaps) -> None:
    """Refuse ``state`` when the device's scheduler capabilities do not allow it."""
    if state.policy not in caps.policies:
        raise RefusedError(f"GPU {bdf} does not support the {state.policy} scheduler",
                           hint="it supports: " + (", ".join(caps.policies) or "none"))
    if state.policy == "best-effort":
        return
    if state.arr and not caps.arr_supported:
        raise RefusedError(f"GPU {bdf} does not support adaptive round robin (ARR)",
                           hint="give --timeslice-ms N instead")
    _check_range("timeslice", state.timeslice_ms, (caps.min_timeslice_ms, caps.max_timeslice_ms), "ms")
    _check_range("frequency", state.frequency_hz, (caps.min_frequency_hz, caps.max_frequency_hz), "Hz")
    _check_range("averaging factor", state.avg_factor, (caps.min_avg_factor, caps.max_avg_factor))


def matches(want: SchedulerState, got: SchedulerState) -> bool:
    """``got`` satisfies ``want``: same policy and ARR; parameters equal where ``want`` names them."""
    if want.policy != got.policy:
        return False
    if want.policy == "best-effort":
        return True
    if want.arr != got.arr:
        return False
    for name in ("timeslice_ms", "frequency_hz", "avg_factor"):
        w = getattr(want, name)
        if w is not None and getattr(got, name) != w:
            return False
    return True


def _state_doc(state: Optional[SchedulerState]) -> Optional[Dict[str, object]]:
    if state is None:
        return None
    d = asdict(state)
    d["text"] = describe(state)
    return d


@dataclass
class RuntimeOutcome:
    action: str
    dry_run: bool
    gpus: List[Dict[str, object]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(g["changed"] for g in self.gpus)

    def as_dict(self) -> Dict[str, object]:
        return {"schema": f"vgpuhost.{self.action}/v1", "dry_run": self.dry_run, "changed": self.changed,
                "gpus": self.gpus, "notes": self.notes}


def _gpu_locks(store, gpus: Sequence[PciAddress], dry_run: bool) -> ExitStack:
    from ..io.locks import file_lock
    stack = ExitStack()
    if not dry_run:
        for g in sorted(gpus, key=str):     # one order everywhere: no deadlock between two --all runs
            stack.enter_context(file_lock(store.state_dir, f"gpu-{g}"))
    return stack


def _audit(store, actor: str, operation: str, bdf: PciAddress, what: str, value: str, err: int) -> None:
    if store is not None:
        store.audit(actor=actor, operation=operation, path=f"nvml:{bdf}/{what}", value=value, err=err)


def set_runtime(host: HostRoot, store, target: Union[str, PciAddress, Sequence[PciAddress]], state: SchedulerState,
                *, backend=None, dry_run: bool = False, actor: Optional[str] = None) -> RuntimeOutcome:
    """Set the vGPU scheduler through NVML on one GPU, several, or ``"all"``.

    Every GPU is checked before any is changed: not in MIG mode, no vGPU
    running, the policy and parameters within its capabilities, no fixed
    share in mixed-size mode.  Then set, read back and compare (DeviceError
    on mismatch).  A GPU already in the requested state is left alone.
    When ARR is asked for without parameters and the device cannot do ARR,
    the driver's default time slice is used instead.
    """
    validate(state)
    if target == "all":
        gpus = resolve_gpus(host, [], True)
    elif isinstance(target, PciAddress):
        gpus = resolve_gpus(host, [target], False)
    else:
        gpus = resolve_gpus(host, list(target), False)
    backend = backend if backend is not None else open_backend(host)
    actor = actor or actor_name()
    out = RuntimeOutcome("scheduler-set", dry_run)
    with _gpu_locks(store, gpus, dry_run):
        plan: List[Tuple[PciAddress, SchedulerState, SchedulerState]] = []
        for bdf in gpus:
            if _mig_on(backend, bdf):
                raise _refuse_mig(bdf, "the vGPU scheduler")
            want = state
            caps = _supported(bdf, "the vGPU scheduler", lambda: backend.scheduler_caps(bdf))
            if (want.arr and not caps.arr_supported and want.frequency_hz is None and want.avg_factor is None
                    and want.policy != "best-effort"):
                want = replace(want, arr=False)
                out.notes.append(f"{bdf}: no adaptive round robin on this device; using the default time slice")
            check_caps(bdf, want, caps)
            if want.policy == "fixed-share" and backend.heterogeneous_mode(bdf):
                raise RefusedError(f"GPU {bdf} is in mixed-size mode: fixed share is not available there",
                                   hint=f"turn it off first ('vgpuhost vgpu mode --gpu {bdf} --mixed-size off', "
                                        "with no vGPU on the GPU) or use equal-share")
            before = backend.scheduler_state(bdf)
            if not matches(want, before):
                running = backend.active_vgpus(bdf)
                if running:
                    raise RefusedError(f"GPU {bdf} has {running} vGPU(s) running: the scheduler can only change "
                                       "while none runs",
                                       hint="stop the VMs using it, or use --persist (applies at the next "
                                            "module reload/reboot)")
            plan.append((bdf, want, before))
        for bdf, want, before in plan:
            entry: Dict[str, object] = {"gpu": str(bdf), "before": _state_doc(before), "requested": _state_doc(want),
                                        "changed": False, "after": _state_doc(before)}
            if not matches(want, before) and not dry_run:
                op = f"scheduler set {bdf}"
                try:
                    backend.set_scheduler_state(bdf, want)
                except NvmlError:
                    _audit(store, actor, op, bdf, "vgpu-scheduler", describe(want), errno.EIO)
                    raise
                _audit(store, actor, op, bdf, "vgpu-scheduler", describe(want), 0)
                after = backend.scheduler_state(bdf)
                entry.update(changed=True, after=_state_doc(after))
                if not matches(want, after):
                    raise DeviceError(f"GPU {bdf}: the scheduler reads back '{describe(after)}' after setting "
                                      f"'{describe(want)}'",
                                      hint="the driver did not take the change; check the vGPU manager version "
                                           "(runtime scheduler changes need driver >= 535)")
            elif not matches(want, before):
                entry["changed"] = True       # would change
            out.gpus.append(entry)
    if out.changed:
        out.notes.append("runtime setting: lost when the nvidia module reloads; use --persist to keep it")
    return out


def mixed_size(host: HostRoot, store, bdf: PciAddress, on: bool, *, backend=None, dry_run: bool = False,
               actor: Optional[str] = None) -> RuntimeOutcome:
    """Turn a GPU's mixed-size (heterogeneous) vGPU mode on or off.

    Refused while vGPUs exist on the GPU, and turning it on while the GPU's
    scheduler is fixed share.  Reads back and compares.
    """
    gpus = resolve_gpus(host, [bdf], False)
    backend = backend if backend is not None else open_backend(host)
    actor = actor or actor_name()
    out = RuntimeOutcome("vgpu-mode", dry_run)
    with _gpu_locks(store, gpus, dry_run):
        before = bool(_supported(bdf, "mixed-size vGPU mode", lambda: backend.heterogeneous_mode(bdf)))
        entry: Dict[str, object] = {"gpu": str(bdf), "mixed_size_before": before, "mixed_size": before,
                                    "changed": False}
        if before != on:
            running = backend.active_vgpus(bdf)
            if running:
                raise RefusedError(f"GPU {bdf} has {running} vGPU(s): mixed-size mode can only change while "
                                   "the GPU has none", hint="remove its vGPUs first ('vgpuhost vgpu list')")
            if on:
                try:
                    sched = backend.scheduler_state(bdf)
                except NvmlError as e:
                    if not e.not_supported:
                        raise
                    sched = None
                if sched is not None and sched.policy == "fixed-share":
                    raise RefusedError(f"GPU {bdf} uses the fixed-share scheduler, which mixed-size mode does "
                                       "not allow",
                                       hint=f"switch to equal-share or best-effort first ('vgpuhost scheduler set "
                                            f"--gpu {bdf} --policy equal-share')")
            entry["changed"] = True
            if not dry_run:
                op = f"vgpu mode {bdf} --mixed-size {'on' if on else 'off'}"
                try:
                    backend.set_heterogeneous_mode(bdf, on)
                except NvmlError:
                    _audit(store, actor, op, bdf, "vgpu-heterogeneous-mode", "on" if on else "off", errno.EIO)
                    raise
                _audit(store, actor, op, bdf, "vgpu-heterogeneous-mode", "on" if on else "off", 0)
                after = bool(backend.heterogeneous_mode(bdf))
                entry["mixed_size"] = after
                if after != on:
                    raise DeviceError(f"GPU {bdf}: mixed-size mode reads back {'on' if after else 'off'} after "
                                      f"turning it {'on' if on else 'off'}")
            else:
                entry["mixed_size"] = on
        out.gpus.append(entry)
    if on and out.changed:
        out.notes.append("mixed-size mode is lost on reboot, module reload, GPU reset and 'sriov-manage -e'")
    return out


def show(host: HostRoot, gpu: Optional[PciAddress] = None, *, backend=None) -> Dict[str, object]:
    """Each GPU's scheduler (runtime state, capabilities, running vGPUs, modes) and the persistent value."""
    gpus = resolve_gpus(host, [gpu], False) if gpu is not None else host_gpus(host)
    backend = backend if backend is not None else open_backend(host)
    conf = read_conf(host)
    entries = []
    for bdf in gpus:
        e: Dict[str, object] = {"gpu": str(bdf)}

        def call(name, fn):
            try:
                return fn()
            except NvmlError as err:
                e.setdefault("errors", {})[name] = err.nvml_name    # type: ignore[index]
                return None

        mig = call("mig_mode", lambda: backend.mig_mode(bdf))
        e["mig"] = None if mig is None else {"current": bool(mig[0]), "pending": bool(mig[1])}
        state = call("state", lambda: backend.scheduler_state(bdf))
        e["state"] = _state_doc(state)
        caps = call("caps", lambda: backend.scheduler_caps(bdf))
        e["caps"] = asdict(caps) if caps is not None else None
        e["active_vgpus"] = call("active_vgpus", lambda: backend.active_vgpus(bdf))
        hm = call("mixed_size", lambda: backend.heterogeneous_mode(bdf))
        e["mixed_size"] = None if hm is None else bool(hm)
        per, glob = conf.value_for(str(bdf)), conf.value_for(None)
        pv = per if per is not None else glob
        e["persistent"] = None if pv is None else {
            "value": f"0x{pv:08x}", "scope": "this GPU" if per is not None else "all GPUs",
            "text": describe(decode(pv)) if not _problems(pv) else "invalid"}
        entries.append(e)
    return {"schema": "vgpuhost.scheduler-show/v1", "conf": host.relative(conf_path(host)), "gpus": entries}


def show_text(doc: Dict[str, object]) -> str:
    lines: List[str] = []
    for e in doc["gpus"]:    # type: ignore[union-attr]
        lines.append(f"GPU {e['gpu']}")
        st = e.get("state")
        errs = e.get("errors") or {}
        if st:
            lines.append(f"  scheduler:  {st['text']}")
        else:
            lines.append(f"  scheduler:  unavailable ({errs.get('state', 'unknown')})")
        if e.get("mig") and e["mig"]["current"]:
            lines.append("  MIG mode on: device-level scheduling is not available (per GPU instance only)")
        caps = e.get("caps")
        if caps:
            lines.append(f"  supports:   {', '.join(caps['policies']) or 'none'}; ARR "
                         f"{'yes' if caps['arr_supported'] else 'no'}; time slice {caps['min_timeslice_ms']}.."
                         f"{caps['max_timeslice_ms']} ms; frequency {caps['min_frequency_hz']}.."
                         f"{caps['max_frequency_hz']} Hz; averaging factor {caps['min_avg_factor']}.."
                         f"{caps['max_avg_factor']}")
        av, ms = e.get("active_vgpus"), e.get("mixed_size")
        lines.append(f"  vGPUs running: {'?' if av is None else av}; mixed-size mode: "
                     f"{'?' if ms is None else ('on' if ms else 'off')}")
        p = e.get("persistent")
        lines.append(f"  persistent: {p['text']} (RmPVMRL={p['value']}, {p['scope']}) in {doc['conf']}" if p
                     else "  persistent: none set by vgpuhost (driver default: best effort)")
    return "\n".join(lines) if lines else "no NVIDIA GPU found"


__all__ = ["encode", "decode", "explain", "explain_doc", "describe", "validate", "parse_value", "persist",
           "set_runtime", "mixed_size", "show", "show_text", "render_conf", "parse_conf", "conf_path",
           "check_caps", "matches", "open_backend", "POLICIES", "DEFAULTS_NOTE"]
