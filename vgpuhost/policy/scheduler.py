"""The vGPU scheduler's pure decisions: the ``RmPVMRL`` codec, validation, capability checks, conf text.

Owns: the bit layout of the ``RmPVMRL`` registry dword (:func:`encode` /
:func:`decode` / :func:`explain`), what a scheduler state may hold
(:func:`validate`), whether a device's capabilities allow it
(:func:`check_caps`), when a read-back state satisfies a wanted one
(:func:`matches`), and the text of vgpuhost's modprobe.d file
(:func:`parse_conf` / :func:`render_conf` / :func:`set_value`).  Must not:
read or write files, call NVML, or print (:mod:`vgpuhost.ops.scheduler`
does the I/O).

Sources (the project's docs reference, sections 4, 6, 7):

* ``RmPVMRL`` layout, open-gpu-kernel-modules ``src/nvidia/interface/nvrm_registry.h``:
  bit 0 enable equal/fixed share; bit 1 ARR disable; bit 3 weighted
  scheduler disable (0 = weighted, the default; 1 = the regular time-sliced
  scheduler; defined from release R590 on, tags 590.44.01 .. 595.45.04, and
  absent from R580 and older); bits 7:4 policy (0 equal, 1 fixed); with ARR: bits 21:12 frequency (Hz, 63..960) and
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
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..model.boards import MIG_NO_SCHEDULER, mig_scheduler_on
from ..model.concepts import SchedulerPolicy
from ..model.errors import InputError, RefusedError
from ..model.nvml import SchedulerCaps, SchedulerState, scheduler_text
from ..model.values import PciAddress

POLICIES = SchedulerPolicy.values()

# --- bit layout (nvrm_registry.h, docs/reference/hardware.md#vgpu-scheduling) ----------------------------
ENABLE_BIT = 1 << 0          # equal/fixed share on; clear = best effort
ARR_DISABLE_BIT = 1 << 1     # set = no adaptive round robin (time slice given instead)
WEIGHTED_DISABLE_BIT = 1 << 3  # set = regular time-sliced scheduler instead of the weighted one (R590+)
WEIGHTED_RELEASES = "R590 and R595"   # the open-gpu-kernel-modules releases whose nvrm_registry.h defines bit 3
POLICY_SHIFT, POLICY_MASK = 4, 0xF          # bits 7:4
FREQ_SHIFT, FREQ_MASK = 12, 0x3FF           # bits 21:12 (with ARR)
TIMESLICE_SHIFT, TIMESLICE_MASK = 16, 0xFF  # bits 23:16 (without ARR)
AVG_SHIFT, AVG_MASK = 24, 0xFF              # bits 31:24 (with ARR)
POLICY_CODES = {SchedulerPolicy.EQUAL_SHARE: 0, SchedulerPolicy.FIXED_SHARE: 1}

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
    if state.policy == SchedulerPolicy.BEST_EFFORT:
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
    if state.policy == SchedulerPolicy.BEST_EFFORT:
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
        "weighted_disable": (value & WEIGHTED_DISABLE_BIT) >> 3,
        "policy": (value >> POLICY_SHIFT) & POLICY_MASK,
        "frequency": (value >> FREQ_SHIFT) & FREQ_MASK,
        "timeslice": (value >> TIMESLICE_SHIFT) & TIMESLICE_MASK,
        "avg": (value >> AVG_SHIFT) & AVG_MASK,
    }


def problems(value: int) -> List[str]:
    """Why ``value`` is not a value :func:`encode` would produce (empty: it is)."""
    f = _fields(value)
    out: List[str] = []
    if not f["enable"]:
        if value:
            out.append(f"bit 0 is clear (best effort) but other bits are set (0x{value:08x}); the driver ignores them")
        return out
    if value & 0b100:
        out.append("reserved bit 2 is set")
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
    found = problems(value)
    if found:
        raise InputError(f"RmPVMRL=0x{value:08x} is not a valid scheduler value: {'; '.join(found)}",
                         hint="'vgpuhost scheduler decode VALUE' explains each field")
    f = _fields(value)
    if not f["enable"]:
        return SchedulerState(SchedulerPolicy.BEST_EFFORT)
    policy = SchedulerPolicy.EQUAL_SHARE if f["policy"] == 0 else SchedulerPolicy.FIXED_SHARE
    if f["arr_disable"]:
        return SchedulerState(policy, arr=False, timeslice_ms=f["timeslice"] or None)
    return SchedulerState(policy, arr=True, frequency_hz=f["frequency"] or None, avg_factor=f["avg"] or None)


def describe(state: SchedulerState) -> str:
    """One line: ``equal share, ARR on, frequency 960 Hz, averaging factor 60`` (the NVML door's
    spelling, :func:`vgpuhost.model.nvml.scheduler_text`, which audit rows use too)."""
    return scheduler_text(state)


def weighted_disabled(value: int) -> bool:
    """Bit 3 of an enabled (bit 0 set) ``RmPVMRL`` dword: the weighted scheduler is off, the regular
    time-sliced one runs (``NV_REG_STR_RM_PVMRL_WEIGHTED``, defined by the R590 and R595 drivers'
    ``nvrm_registry.h``, docs/reference/hardware.md#vgpu-scheduling)."""
    return bool(value & ENABLE_BIT and value & WEIGHTED_DISABLE_BIT)


def describe_value(value: int) -> str:
    """One line for a valid ``RmPVMRL`` dword: :func:`describe` of :func:`decode`, plus the weighted-scheduler
    bit when it is set (``equal share, ARR on; weighted scheduler off (bit 3, R590 and R595)``).
    InputError as :func:`decode`."""
    text = describe(decode(value))
    if weighted_disabled(value):
        text += f"; weighted scheduler off (bit 3, {WEIGHTED_RELEASES})"
    return text


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
    found = problems(value)
    lines: List[str] = []
    if found:
        head = "not a valid scheduler value"
    else:
        head = describe_value(value)
    lines.append(f"RmPVMRL=0x{value:08x}: {head}")
    lines.append(f"  bit 0      = {f['enable']:<6} " + ("equal/fixed share enabled" if f["enable"]
                                                       else "best effort (default scheduler)"))
    if f["enable"]:
        lines.append(f"  bit 1      = {f['arr_disable']:<6} adaptive round robin (ARR) "
                     + ("disabled" if f["arr_disable"] else "enabled"))
        lines.append(f"  bit 3      = {f['weighted_disable']:<6} "
                     + ("weighted scheduler off: the regular time-sliced scheduler runs" if f["weighted_disable"]
                        else "weighted scheduler (the default)")
                     + f" (defined by {WEIGHTED_RELEASES}; older drivers do not define it)")
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
    lines += [f"  problem: {p}" for p in found]
    return "\n".join(lines)


def explain_doc(value: int) -> Dict[str, object]:
    """The ``--json`` form of :func:`explain`."""
    _check_dword(value)
    found = problems(value)
    state = None if found else asdict(decode(value))
    f = _fields(value)
    # the frequency (21:12) and time-slice (23:16) fields overlap: bit 1 says which one the value holds
    fields: Dict[str, object] = {"enable": f["enable"], "arr_disable": None, "weighted_disable": None,
                                 "policy": None,
                                 "frequency_hz": None, "avg_factor": None, "timeslice_ms": None}
    if f["enable"]:
        fields.update(arr_disable=f["arr_disable"], weighted_disable=f["weighted_disable"], policy=f["policy"])
        if f["arr_disable"]:
            fields["timeslice_ms"] = f["timeslice"]
        else:
            fields.update(frequency_hz=f["frequency"], avg_factor=f["avg"])
    return {"schema": "vgpuhost.scheduler-decode/v1", "value": f"0x{value:08x}", "valid": not found,
            "state": state, "text": None if found else describe_value(value),
            "fields": fields,
            "problems": found}



# =============================================================================
# vgpuhost's modprobe.d file (text only; reading and writing it is ops/scheduler's)

_OPT_RE = re.compile(r'^\s*options\s+nvidia\s+(NVreg_RegistryDwords(?:PerDevice)?)="([^"]*)"\s*$')


@dataclass
class SchedulerConf:
    """What vgpuhost's modprobe.d file holds: keys for all GPUs, and per GPU (ordered)."""

    all_gpus: List[Tuple[str, str]] = field(default_factory=list)
    per_device: Dict[str, List[Tuple[str, str]]] = field(default_factory=dict)

    def value_for(self, bdf: Optional[str]) -> Optional[int]:
        """The ``RmPVMRL`` this file sets for GPU ``bdf`` (None: for all GPUs); None when it sets none."""
        return _value_in(self.per_device.get(bdf, []) if bdf else self.all_gpus)


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


def check_caps(bdf: PciAddress, state: SchedulerState, caps: SchedulerCaps) -> None:
    """Refuse ``state`` when the device's scheduler capabilities do not allow it."""
    if state.policy not in caps.policies:
        raise RefusedError(f"GPU {bdf} does not support the {state.policy} scheduler",
                           hint="it supports: " + (", ".join(caps.policies) or "none"))
    if state.policy == SchedulerPolicy.BEST_EFFORT:
        return
    if state.arr and not caps.arr_supported:
        raise RefusedError(f"GPU {bdf} does not support adaptive round robin (ARR)",
                           hint="give --timeslice-ms N instead")
    _check_range("timeslice", state.timeslice_ms, (caps.min_timeslice_ms, caps.max_timeslice_ms), "ms")
    _check_range("frequency", state.frequency_hz, (caps.min_frequency_hz, caps.max_frequency_hz), "Hz")
    _check_range("averaging factor", state.avg_factor, (caps.min_avg_factor, caps.max_avg_factor))


def mig_scheduler_refusal(bdf: object, product: Optional[str], architecture: Optional[str]) -> RefusedError:
    """The refusal of a vGPU scheduler on GPU ``bdf`` in MIG mode (``product``/``architecture``: its board,
    None when the board is unknown).

    Before Blackwell (A100, H100, H200) there is no vGPU scheduler in MIG mode at all (the driver:
    "Software Scheduler is not supported in MIG mode"); from Blackwell GB20x on it exists per GPU instance
    (``nvmlGpuInstanceSetVgpuSchedulerState``), which vgpuhost does not drive yet
    (docs/reference/hardware.md#vgpu-scheduling).
    """
    board = f" ({product}, {architecture})" if product and architecture else ""
    if architecture and mig_scheduler_on(architecture):
        return RefusedError(f"GPU {bdf}{board} is in MIG mode: its vGPU scheduler is per GPU instance there, "
                            "which vgpuhost does not set yet",
                            hint="disable MIG mode ('vgpuhost mig disable') to use the device-level scheduler")
    why = (f"{MIG_NO_SCHEDULER} before Blackwell" if architecture else
           f"{MIG_NO_SCHEDULER} on GPUs before Blackwell, and vgpuhost does not know this board")
    return RefusedError(f"GPU {bdf}{board} is in MIG mode: no vGPU scheduler there ({why})",
                        hint="MIG-backed vGPUs are hardware partitions and need none; disable MIG mode "
                             "('vgpuhost mig disable') to schedule time-sliced vGPUs")


def matches(want: SchedulerState, got: SchedulerState) -> bool:
    """``got`` satisfies ``want``: same policy and ARR; parameters equal where ``want`` names them."""
    if want.policy != got.policy:
        return False
    if want.policy == SchedulerPolicy.BEST_EFFORT:
        return True
    if want.arr != got.arr:
        return False
    for name in ("timeslice_ms", "frequency_hz", "avg_factor"):
        w = getattr(want, name)
        if w is not None and getattr(got, name) != w:
            return False
    return True


def state_doc(state: Optional[SchedulerState]) -> Optional[Dict[str, object]]:
    if state is None:
        return None
    d = asdict(state)
    d["text"] = describe(state)
    return d


def set_value(conf: SchedulerConf, value: int, gpus: Sequence[PciAddress]) -> SchedulerConf:
    """``conf`` with ``RmPVMRL`` set to ``value`` for all GPUs (``gpus`` empty) or for each of ``gpus``.

    All GPUs: sets it in ``NVreg_RegistryDwords`` and drops per-GPU
    ``RmPVMRL`` entries so every GPU gets the value.  Per GPU: adds or
    replaces that GPU's entry.  Other keys are kept.  A new value; ``conf``
    is not changed.
    """
    hexval = f"0x{value:02x}" if value <= 0xFF else f"0x{value:08x}"
    out = SchedulerConf(list(conf.all_gpus), {k: list(v) for k, v in conf.per_device.items()})
    if not gpus:
        out.all_gpus = _set_key(out.all_gpus, REG_KEY, hexval)
        for bdf in list(out.per_device):
            out.per_device[bdf] = [(k, v) for k, v in out.per_device[bdf] if k != REG_KEY]
    else:
        for g in gpus:
            out.per_device[str(g)] = _set_key(out.per_device.get(str(g), []), REG_KEY, hexval)
    return out


# =============================================================================
# what modprobe hands the nvidia module: the effective NVreg_RegistryDwords[PerDevice]

GLOBAL_OPTION = "NVreg_RegistryDwords"
PER_DEVICE_OPTION = "NVreg_RegistryDwordsPerDevice"


def _logical_lines(text: str) -> List[str]:
    """modprobe.d(5) lines: a trailing backslash joins the next line; ``#`` lines and blank lines go."""
    out: List[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.endswith("\\"):
            pending += raw[:-1]
            continue
        line, pending = pending + raw, ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    if pending.strip() and not pending.lstrip().startswith("#"):
        out.append(pending)
    return out


def _params(text: str) -> List[Tuple[str, str]]:
    """``name=value`` words of a module options string, split as the kernel's ``next_arg()``
    (``lib/cmdline``/``kernel/params.c``) does: spaces split words except inside double quotes, and
    quotes around the value or the whole word are dropped."""
    out: List[Tuple[str, str]] = []
    for word in re.findall(r'(?:[^\s"]|"[^"]*"?)+', text):
        name, eq, value = word.replace('"', "").partition("=")
        if name:
            out.append((name, value if eq else ""))
    return out


@dataclass(frozen=True)
class ModuleOption:
    """One ``NVreg_RegistryDwords[PerDevice]`` setting for the nvidia module: the ``option``, its
    ``value`` (the registry string) and the ``source`` (a modprobe.d path, or the kernel command line)."""

    option: str
    value: str
    source: str


def registry_options(files: Sequence[Tuple[str, str]], cmdline: Optional[str] = None,
                     cmdline_source: str = "the kernel command line") -> List[ModuleOption]:
    """Every ``NVreg_RegistryDwords`` and ``NVreg_RegistryDwordsPerDevice`` given to the nvidia module,
    in the order the module sees them.

    ``files``: ``[(path, text)]`` in modprobe's reading order
    (:func:`vgpuhost.io.configfiles.modprobe_conf_files`); ``cmdline``: the kernel command line, whose
    ``nvidia.<option>=`` words (their source named ``cmdline_source``) kmod appends after the files' options (``kmod_config_parse_kcmdline``,
    run after the files in ``kmod_config_new``).  kmod joins the options of every matching
    ``options nvidia ...`` line (``-`` and ``_`` alike in the module name) into one string, and the
    kernel sets each parameter once per occurrence, so the last one of each option is the one that
    counts (:func:`effective_options`).
    """
    out: List[ModuleOption] = []
    for path, text in files:
        for line in _logical_lines(text):
            words = line.split(None, 2)
            if len(words) < 3 or words[0] != "options" or words[1].replace("-", "_") != "nvidia":
                continue
            out += [ModuleOption(n, v, path) for n, v in _params(words[2]) if n in (GLOBAL_OPTION, PER_DEVICE_OPTION)]
    for name, value in _params(cmdline or ""):
        module, dot, option = name.partition(".")
        if dot and module.replace("-", "_") == "nvidia" and option in (GLOBAL_OPTION, PER_DEVICE_OPTION):
            out.append(ModuleOption(option, value, cmdline_source))
    return out


def effective_options(options: Sequence[ModuleOption]) -> Dict[str, ModuleOption]:
    """The last of each option (``{option: ModuleOption}``): what the nvidia module gets."""
    return {o.option: o for o in options}


def _value_in(pairs: Sequence[Tuple[str, str]]) -> Optional[int]:
    for k, v in pairs:
        if k == REG_KEY:
            try:
                return int(v, 0)
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class EffectiveValue:
    """The ``RmPVMRL`` one GPU gets at the next module load: ``value`` (None: none, best effort),
    ``scope`` (``"this GPU"`` / ``"all GPUs"`` / None) and the ``source`` file of the option that holds it
    (None when no option names it)."""

    value: Optional[int]
    scope: Optional[str]
    source: Optional[str]


def effective_value(options: Mapping[str, ModuleOption], bdf: str) -> EffectiveValue:
    """The ``RmPVMRL`` GPU ``bdf`` gets from the effective options (:func:`effective_options`): its
    entry in the last ``NVreg_RegistryDwordsPerDevice`` when it has one, else the last
    ``NVreg_RegistryDwords``'s (format of ``nv-reg.h``)."""
    per = options.get(PER_DEVICE_OPTION)
    if per is not None:
        conf = parse_conf(f'options nvidia {PER_DEVICE_OPTION}="{per.value}"')
        value = _value_in(conf.per_device.get(bdf.lower(), []))
        if value is not None:
            return EffectiveValue(value, "this GPU", per.source)
    glob = options.get(GLOBAL_OPTION)
    if glob is not None:
        value = _value_in(_pairs(glob.value))
        if value is not None:
            return EffectiveValue(value, "all GPUs", glob.source)
    return EffectiveValue(None, None, None)


def overriding_sources(options: Sequence[ModuleOption], own: str) -> List[str]:
    """The sources whose option comes after the last one of file ``own`` (vgpuhost's), so it wins."""
    last = effective_options(options)
    mine = {o.option for o in options if o.source == own}
    return sorted({last[o].source for o in mine if last[o].source != own})


def with_own_file(files: Sequence[Tuple[str, str]], mine: str, text: str) -> List[Tuple[str, str]]:
    """``files`` (``[(path, text)]`` in modprobe's reading order) with vgpuhost's file ``mine`` holding
    ``text``, as modprobe would read them once it is written: ordered by file name (kmod's order)."""
    name = mine.rsplit("/", 1)[-1]
    out = [(p, t) for p, t in files if p.rsplit("/", 1)[-1] != name] + [(mine, text)]
    out.sort(key=lambda pt: pt[0].rsplit("/", 1)[-1])
    return out


def override_line(own: Optional[int], options: Sequence[ModuleOption], bdf: str, mine: str) -> Optional[str]:
    """When vgpuhost's file ``mine`` sets ``own`` for GPU ``bdf`` but the nvidia module gets another
    ``RmPVMRL`` at its next load (a later option wins, docs/reference/hardware.md#vgpu-scheduling): one
    line naming the file that overrides it, with the parsed values only (never a file's text); else None."""
    eff = effective_value(effective_options(options), bdf)
    if own is None or own == eff.value:
        return None
    others = [eff.source] if eff.source and eff.source != mine else overriding_sources(options, mine)
    gets = "no RmPVMRL (best effort)" if eff.value is None else f"RmPVMRL=0x{eff.value:08x} ({eff.scope})"
    by = ", ".join(o for o in others if o) or "a later option"
    return (f"{bdf}: {by} overrides {mine}: the nvidia module gets {gets} at its next load, "
            f"not vgpuhost's RmPVMRL=0x{own:08x}")


_REGISTRY_RE = re.compile(r"NVreg_RegistryDwords(PerDevice)?\s*=")


def sets_registry_dwords(text: str) -> bool:
    """Does a modprobe.d file's text set ``NVreg_RegistryDwords[PerDevice]`` (which vgpuhost's file sets too)?"""
    return bool(_REGISTRY_RE.search(text))


__all__ = ["POLICIES", "DEFAULTS_NOTE", "CONF_NAME", "REG_KEY", "validate", "encode", "decode", "describe",
           "describe_value", "weighted_disabled", "WEIGHTED_RELEASES",
           "parse_value", "explain", "explain_doc", "problems", "SchedulerConf", "parse_conf", "render_conf",
           "set_value", "sets_registry_dwords", "ModuleOption", "registry_options", "effective_options",
           "EffectiveValue", "effective_value", "MIG_NO_SCHEDULER", "mig_scheduler_refusal", "overriding_sources", "GLOBAL_OPTION", "PER_DEVICE_OPTION", "check_caps", "matches", "state_doc", "WEIGHTED_DISABLE_BIT"]
