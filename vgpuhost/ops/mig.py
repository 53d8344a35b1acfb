"""MIG: mode, GPU-instance layouts, and their planner.

Owns: parsing a wanted layout (``3g.71gb=1,2g.35gb=1,1g.18gb=1``), resolving
its profile names against what the device reports (``1g.5gb`` on an A100-40GB
is profile id 19, on an H200 that id is ``1g.18gb``: names are resolved per
device, from the device, never from a table), checking that it fits and
choosing placements (a pure backtracking search, larger profiles first), and
the operations ``show``, ``enable``/``disable``, ``apply`` and ``assert``
over an :class:`~vgpuhost.nvml.NvmlBackend`.  Plans are data (steps printed
by ``--dry-run``); each NVML change writes an audit row
(``path=nvml:<call>``) and the result is read back and verified.  Must not:
call pynvml or spell kernel paths.

Facts (REFERENCE.md §3, §5): placements are ``(start, size)`` over the
device's memory slices (8); compute slices are bounded by the largest
profile's (7 on A100/H100/H200, 4 on A30).  Enabling MIG mode needs no
processes and no vGPUs on the GPU and can stay *pending* until a GPU reset.
On the vendor-specific VFIO path the order is MIG mode -> SR-IOV -> GPU
instances -> mixed-size mode -> vGPUs (``sriov-manage -e`` destroys GPU
instances), so a MIG mode change is refused while VFs are enabled there.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..model.errors import DeviceError, HostEnvironmentError, InputError, RefusedError
from ..io.backends import open_backend
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.nvml import GiProfile, GpuInstance, NvmlBackend, NvmlError
from ..io.process import actor as actor_name
from ..model.values import PciAddress
from ..plan.executor import Executor
from ..plan.steps import CreateGi, DestroyGi, SetMigMode, Step

SCHEMA_SHOW = "vgpuhost.mig-show/v1"
SCHEMA_OUTCOME = "vgpuhost.mig/v1"
SCHEMA_ASSERT = "vgpuhost.mig-assert/v1"
ORDER = "MIG mode -> SR-IOV -> GPU instances -> mixed-size mode -> vGPUs"
MAX_COUNT = 64



# ---------------------------------------------------------------------------
# layouts (pure)

_ENTRY_RE = re.compile(r"^\s*(?P<name>[0-9]+g\.[0-9]+gb(?:\+me)?)\s*(?:=\s*(?P<n>[0-9]{1,3})\s*)?$", re.I)


def parse_layout(text: str) -> Dict[str, int]:
    """``"3g.71gb=1,2g.35gb=1,1g.18gb"`` -> ``{"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 1}``.

    ``none`` is the empty layout (no GPU instances); an empty or blank text
    is refused (an unset shell variable must not destroy every instance).
    A bare profile means count 1; entries with count 0 are dropped.  Raises
    InputError for malformed text or a profile named twice.
    """
    text = (text or "").strip()
    if not text:
        raise InputError("empty MIG layout", hint="give PROFILE=COUNT pairs (3g.71gb=1,1g.18gb=2), "
                                                   "or 'none' to remove every GPU instance")
    if text.lower() == "none":
        return {}
    out: Dict[str, int] = {}
    seen = set()
    for part in text.split(","):
        m = _ENTRY_RE.match(part)
        if not m:
            raise InputError(f"invalid MIG layout entry {part.strip()[:60]!r}",
                             hint="give PROFILE=COUNT pairs separated by commas, e.g. 3g.71gb=1,1g.18gb=2")
        name = m["name"].lower()
        if name in seen:
            raise InputError(f"MIG layout names {name} twice")
        seen.add(name)
        n = int(m["n"]) if m["n"] is not None else 1
        if n > MAX_COUNT:
            raise InputError(f"MIG layout asks for {n} {name}; at most {MAX_COUNT}")
        if n:
            out[name] = n
    return out


def layout_text(counts: Mapping[str, int]) -> str:
    """``{"7g.141gb": 1, "1g.18gb": 7}`` -> ``7x1g.18gb + 1x7g.141gb`` (smaller first); ``none``."""
    parts = [f"{n}x{name}" for name, n in sorted(counts.items(), key=lambda kv: _name_key(kv[0])) if n]
    return " + ".join(parts) if parts else "none"


def _name_key(name: str) -> tuple:
    m = re.match(r"^(\d+)g\.(\d+)gb", name)
    return (int(m[1]), int(m[2]), name) if m else (999, 999, name)


def resolve_layout(profiles: Sequence[GiProfile], layout: Mapping[str, int], *,
                   where: str = "this GPU") -> Dict[int, int]:
    """Profile id -> count for ``layout`` (names as the device reports them, case-insensitive).

    Raises InputError naming near matches and the device's profiles when a
    name is not one of the device's.
    """
    by_name = {p.name.lower(): p for p in profiles}
    out: Dict[int, int] = {}
    for name, n in layout.items():
        p = by_name.get(name.lower())
        if p is None:
            names = [q.name for q in profiles]
            near = difflib.get_close_matches(name.lower(), names, n=4, cutoff=0.6)
            hint = (f"near matches: {', '.join(near)}; " if near else "") + \
                f"{where} offers: {', '.join(names) or 'no GPU-instance profiles'}"
            raise InputError(f"unknown GPU-instance profile {name!r} on {where}", hint=hint)
        out[p.profile_id] = out.get(p.profile_id, 0) + n
    return out


def memory_slices(profiles: Sequence[GiProfile]) -> int:
    return max((s + z for p in profiles for s, z in p.placements), default=0)


def compute_slices(profiles: Sequence[GiProfile]) -> int:
    return max((p.slices for p in profiles), default=0)


def _names(profiles: Sequence[GiProfile], wanted: Mapping[int, int]) -> Dict[str, int]:
    by_id = {p.profile_id: p for p in profiles}
    return {by_id[i].name if i in by_id else f"profile {i}": n for i, n in wanted.items() if n}


def why_not(profiles: Sequence[GiProfile], wanted: Mapping[int, int]) -> Optional[str]:
    """None when ``wanted`` (profile id -> count) fits an empty GPU, else the reason, e.g.
    ``7x1g.18gb + 1x7g.141gb needs 15 of 8 memory slices``."""
    by_id = {p.profile_id: p for p in profiles}
    text = layout_text(_names(profiles, wanted))
    for pid, n in sorted(wanted.items()):
        p = by_id[pid]
        if n > p.max_count:
            return f"{text}: {n}x{p.name} exceeds the device's maximum of {p.max_count} {p.name}"
    mem = sum(by_id[pid].placements[0][1] * n for pid, n in wanted.items() if by_id[pid].placements)
    if mem > memory_slices(profiles):
        return f"{text} needs {mem} of {memory_slices(profiles)} memory slices"
    comp = sum(by_id[pid].slices * n for pid, n in wanted.items())
    if comp > compute_slices(profiles):
        return f"{text} needs {comp} of {compute_slices(profiles)} compute slices"
    if place(profiles, wanted) is None:
        return (f"{text} has no placement: " + ", ".join(
            f"{p.name} starts at {'/'.join(str(s) for s, _ in p.placements)}"
            for p in profiles if wanted.get(p.profile_id)))
    return None


def _order(p: GiProfile) -> tuple:
    size = p.placements[0][1] if p.placements else 0
    return (-size, -p.slices, len(p.placements), p.profile_id)


def place(profiles: Sequence[GiProfile], wanted: Mapping[int, int],
          occupied: Sequence[GpuInstance] = ()) -> Optional[List[Tuple[GiProfile, int]]]:
    """Placements ``[(profile, start)]`` for ``wanted`` beside ``occupied``, or None.

    Larger profiles first; a backtracking search over the device's placements
    so that each choice leaves room for the rest; respects max counts
    (counting ``occupied``) and the compute slices.
    """
    by_id = {p.profile_id: p for p in profiles}
    occ = 0
    used = 0
    have: Dict[int, int] = {}
    for g in occupied:
        occ |= ((1 << g.size) - 1) << g.start
        used += by_id[g.profile_id].slices if g.profile_id in by_id else 0
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    for pid, n in wanted.items():
        if pid not in by_id or have.get(pid, 0) + n > by_id[pid].max_count:
            return None
    items = [by_id[pid] for pid in sorted(wanted, key=lambda i: _order(by_id[i])) for _ in range(wanted[pid])]
    # try first the placements that overlap the fewest of the device's placements: a lone 3g
    # goes to slices 4-7 and 1g from the top, leaving room for what comes later
    every = [pl for p in profiles for pl in p.placements]

    def blocks(start: int, size: int) -> int:
        return sum(1 for s, z in every if start < s + z and s < start + size)

    tries = {p.profile_id: sorted(p.placements, key=lambda pl: (blocks(*pl), pl[0])) for p in profiles}
    left = compute_slices(profiles) - used
    out: List[Tuple[GiProfile, int]] = []

    def search(i: int, occ: int, left: int, prev: int) -> bool:
        if i == len(items):
            return True
        p = items[i]
        if p.slices > left:
            return False
        same = i > 0 and items[i - 1].profile_id == p.profile_id
        for k, (start, size) in enumerate(tries[p.profile_id]):
            if same and k <= prev:
                continue                      # identical GPU instances: one order only
            mask = ((1 << size) - 1) << start
            if occ & mask:
                continue
            out.append((p, start))
            if search(i + 1, occ | mask, left - p.slices, k):
                return True
            out.pop()
        return False

    return out if search(0, occ, left, -1) else None


@dataclass
class LayoutPlan:
    """What apply will do: GPU instances to destroy, to keep and to create."""

    keep: List[GpuInstance]
    destroy: List[DestroyGi]
    create: List[CreateGi]

    @property
    def steps(self) -> List[Step]:
        return [*self.destroy, *self.create]


def _profile_name(by_id: Mapping[int, GiProfile], pid: int) -> str:
    return by_id[pid].name if pid in by_id else f"profile {pid}"


def plan_layout(profiles: Sequence[GiProfile], current: Sequence[GpuInstance],
                wanted: Mapping[int, int], gpu: Optional[PciAddress] = None) -> LayoutPlan:
    """Destroy the GPU instances not wanted, create the missing ones on ``gpu`` (pure).

    Keeps wanted instances where the rest still fits beside them; otherwise
    rebuilds the whole layout.  Raises RefusedError when ``wanted`` cannot fit.
    """
    by_id = {p.profile_id: p for p in profiles}
    wanted = {k: v for k, v in wanted.items() if v}
    reason = why_not(profiles, wanted)
    if reason:
        raise RefusedError(f"MIG layout does not fit: {reason}", hint="nothing was changed")
    have: Dict[int, int] = {}
    for g in current:
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    if have == wanted:
        return LayoutPlan(list(current), [], [])
    keep: List[GpuInstance] = []
    kept: Dict[int, int] = {}
    for g in sorted(current, key=lambda g: (g.start, g.gi_id)):
        if kept.get(g.profile_id, 0) < wanted.get(g.profile_id, 0):
            keep.append(g)
            kept[g.profile_id] = kept.get(g.profile_id, 0) + 1
    missing = {pid: n - kept.get(pid, 0) for pid, n in wanted.items() if n - kept.get(pid, 0) > 0}
    found = place(profiles, missing, keep)
    if found is None:
        keep, found = [], place(profiles, wanted)
        assert found is not None      # why_not said it fits an empty GPU
    kept_ids = {g.gi_id for g in keep}
    destroy = [DestroyGi(gpu, g.gi_id, _profile_name(by_id, g.profile_id), g.start, g.size, g.profile_id)
               for g in sorted(current, key=lambda g: g.gi_id) if g.gi_id not in kept_ids]
    create = [CreateGi(gpu, p.profile_id, p.name, start, dict(p.placements)[start]) for p, start in found]
    return LayoutPlan(keep, destroy, create)


# ---------------------------------------------------------------------------
# outcomes

@dataclass
class MigOutcome:
    action: str
    gpu: str
    changed: bool
    dry_run: bool
    name: str = ""
    mig_mode: Optional[Dict[str, bool]] = None
    layout_before: Dict[str, int] = field(default_factory=dict)
    layout_after: Dict[str, int] = field(default_factory=dict)
    steps: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    writes: int = 0

    def as_dict(self) -> dict:
        return {"schema": SCHEMA_OUTCOME, **self.__dict__}


@dataclass
class MigAssert:
    gpu: str
    in_sync: bool
    wanted: Dict[str, int]
    actual: Dict[str, int]
    mig_mode: Optional[Dict[str, bool]]
    diff: List[Dict[str, object]]

    def as_dict(self) -> dict:
        return {"schema": SCHEMA_ASSERT, **self.__dict__}


# ---------------------------------------------------------------------------
# device access

class _Device:
    """One GPU as NVML and sysfs see it (read at construction)."""

    def __init__(self, host: HostRoot, backend: NvmlBackend, bdf: PciAddress, inv=None):
        from ..observe.inventory import discover
        from ..io.sysfs import Sysfs
        self.host, self.backend, self.bdf = host, backend, bdf
        inv = inv if inv is not None else discover(Sysfs(host), with_types=False)
        g = inv.gpu(bdf)
        if g is None:
            known = ", ".join(str(x.address) for x in inv.gpus) or "none"
            raise InputError(f"no NVIDIA GPU at {bdf}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
        self.gpu = g
        try:
            self.name = backend.device_name(bdf)
            self.mode = backend.mig_mode(bdf)
        except NvmlError as e:
            if e.nvml_name == "NVMLError_NotFound":
                drv = g.pci.driver
                raise RefusedError(f"NVML does not see {bdf}: it is bound to {drv or 'no driver'}",
                                   hint="NVML sees only GPUs on the nvidia driver; "
                                        f"'vgpuhost passthrough release {bdf}' gives it back") from None
            raise

    def require_mig(self) -> None:
        if self.mode is None:
            raise RefusedError(f"{self.bdf} ({self.name}) is not MIG-capable")

    def profiles(self) -> List[GiProfile]:
        return list(self.backend.gi_profiles(self.bdf))

    def instances(self) -> List[GpuInstance]:
        return list(self.backend.gpu_instances(self.bdf))

    def vgpus(self) -> int:
        try:
            return int(self.backend.active_vgpus(self.bdf))
        except NvmlError as e:
            if e.not_supported:
                return 0
            raise


def _counts(profiles: Sequence[GiProfile], gis: Sequence[GpuInstance]) -> Dict[str, int]:
    by_id = {p.profile_id: p for p in profiles}
    out: Dict[str, int] = {}
    for g in gis:
        n = _profile_name(by_id, g.profile_id)
        out[n] = out.get(n, 0) + 1
    return out


def _mode_dict(mode: Optional[Tuple[bool, bool]]) -> Optional[Dict[str, bool]]:
    return None if mode is None else {"current": bool(mode[0]), "pending": bool(mode[1])}


def _run(dev: _Device, store, steps: Sequence[Step], *, actor: str, operation: str) -> int:
    """Run NVML steps through the Executor (audit row each, verify, undo on failure); the writes made.

    An NVML failure becomes a DeviceError naming the step and whether the
    earlier steps were undone.
    """
    ex = Executor(dev.host, store, actor=actor, operation=operation, backend=dev.backend)
    try:
        ex.run(steps)
    except NvmlError as e:
        what = ex.failed.describe(dev.host) if ex.failed is not None else e.call
        raise DeviceError(f"{what} on {dev.bdf} failed: {e.nvml_name}"
                          + (f" ({e.hint})" if e.hint else "")
                          + ("; the earlier steps were undone" if ex.undo_ok else
                             "; undoing the earlier steps failed too: check 'vgpuhost mig show'"),
                          hint="see 'vgpuhost audit'") from e
    return ex.writes


# ---------------------------------------------------------------------------
# operations

def show(host: HostRoot, gpu: Optional[PciAddress] = None, *, backend: Optional[NvmlBackend] = None) -> dict:
    """MIG state of every NVIDIA GPU (or ``gpu``): the ``vgpuhost.mig-show/v1`` document.

    Per GPU: ``gpu``, ``name``, ``mig_capable``, ``mig_mode`` ({current,
    pending} or None), ``pending_change``, ``profiles`` (id, name, slices,
    memory_mib, max_count, placements [{start, size}]), ``gpu_instances``
    ({gi_id, profile_id, profile, start, size}), ``layout`` ({name: count}),
    ``error`` (NVML could not answer for this GPU) or None.
    """
    from ..observe.inventory import discover
    from ..io.sysfs import Sysfs
    backend = backend or open_backend(host)
    host.require_host()
    inv = discover(Sysfs(host), with_types=False)
    if gpu is not None and inv.gpu(gpu) is None:
        known = ", ".join(str(x.address) for x in inv.gpus) or "none"
        raise InputError(f"no NVIDIA GPU at {gpu}", hint=f"GPUs on this host: {known} ('vgpuhost gpus')")
    entries = []
    for g in inv.gpus:
        if gpu is not None and g.address != gpu:
            continue
        e: Dict[str, object] = {"gpu": str(g.address), "name": None, "mig_capable": False, "mig_mode": None,
                                "pending_change": False, "profiles": [], "gpu_instances": [], "layout": {},
                                "error": None}
        try:
            e["name"] = backend.device_name(g.address)
            mode = backend.mig_mode(g.address)
            e["mig_mode"] = _mode_dict(mode)
            if mode is not None:
                e["mig_capable"] = True
                e["pending_change"] = mode[0] != mode[1]
                profiles = backend.gi_profiles(g.address)
                gis = backend.gpu_instances(g.address)
                by_id = {p.profile_id: p for p in profiles}
                e["profiles"] = [{"profile_id": p.profile_id, "name": p.name, "slices": p.slices,
                                  "memory_mib": p.memory_mib, "max_count": p.max_count,
                                  "placements": [{"start": s, "size": z} for s, z in p.placements]}
                                 for p in profiles]
                e["gpu_instances"] = [{"gi_id": x.gi_id, "profile_id": x.profile_id,
                                       "profile": _profile_name(by_id, x.profile_id),
                                       "start": x.start, "size": x.size} for x in gis]
                e["layout"] = _counts(profiles, gis)
        except NvmlError as err:
            e["error"] = err.one_line()
        entries.append(e)
    return {"schema": SCHEMA_SHOW, "gpus": entries}


def show_text(doc: dict) -> str:
    lines: List[str] = []
    for e in doc["gpus"]:
        head = f"{e['gpu']} {e['name'] or ''}".rstrip()
        if e["error"]:
            lines.append(f"{head}: NVML: {e['error']}")
            continue
        if not e["mig_capable"]:
            lines.append(f"{head}: not MIG-capable")
            continue
        m = e["mig_mode"]
        state = "on" if m["current"] else "off"
        if e["pending_change"]:
            state += f" (pending: {'on' if m['pending'] else 'off'} after a GPU reset)"
        lines.append(f"{head}: MIG {state}")
        lines.append(f"  layout: {layout_text(e['layout'])}")
        for x in e["gpu_instances"]:
            lines.append(f"  GPU instance {x['gi_id']}: {x['profile']} (profile id {x['profile_id']}) "
                         f"at memory slice {x['start']}, size {x['size']}")
        lines.append("  profiles: " + ", ".join(
            f"{p['name']} (id {p['profile_id']}, max {p['max_count']})" for p in e["profiles"]))
    return "\n".join(lines) if lines else "no NVIDIA GPU found"


def _check_mode_change(dev: _Device, want: bool) -> None:
    """Refuse (RefusedError) while vGPUs, processes or VFs block a MIG mode change."""
    bdf = dev.bdf
    n = dev.vgpus()
    if n:
        raise RefusedError(f"cannot {'enable' if want else 'disable'} MIG mode on {bdf}: {n} vGPU(s) exist",
                           hint=f"remove them first ('vgpuhost vgpu list'); order: {ORDER}")
    procs = int(dev.backend.compute_processes(bdf))
    if procs:
        raise RefusedError(f"cannot change MIG mode on {bdf}: {procs} process(es) use the GPU",
                           hint="stop them (nvidia-smi lists them) and retry")
    if dev.gpu.vgpu_backend == "vendor-vfio" and dev.gpu.vfs:
        raise RefusedError(
            f"cannot change MIG mode on {bdf}: {len(dev.gpu.vfs)} SR-IOV VFs are enabled; the order is {ORDER}",
            hint=f"disable them (/usr/lib/nvidia/sriov-manage -d {bdf}), change MIG mode, then enable them "
                 f"again (sriov-manage -e {bdf})")


def set_mode(host: HostRoot, store, bdf: PciAddress, enabled: bool, *, dry_run: bool = False,
             backend: Optional[NvmlBackend] = None, actor: Optional[str] = None) -> MigOutcome:
    """Enable or disable MIG mode on ``bdf`` (idempotent).

    Disabling destroys the GPU instances first (listed in the plan).  Refuses
    (RefusedError) while vGPUs, processes or, on the vendor-VFIO path, VFs
    block it; a change left pending until a GPU reset is reported in
    ``mig_mode`` and the notes.  DeviceError when NVML fails (undone).
    """
    backend = backend or open_backend(host)
    action = "enable" if enabled else "disable"

    def plan(dev: _Device) -> Tuple[MigOutcome, List[Step]]:
        dev.require_mig()
        cur, pending = dev.mode
        out = MigOutcome(action, str(bdf), changed=False, dry_run=dry_run, name=dev.name,
                         mig_mode=_mode_dict(dev.mode))
        profiles = dev.profiles()
        gis = dev.instances() if cur else []
        out.layout_before = _counts(profiles, gis)
        if pending == enabled:
            out.layout_after = dict(out.layout_before)
            if cur != enabled:
                out.notes.append(f"MIG mode {'on' if enabled else 'off'} is pending: reset the GPU "
                                 f"(nvidia-smi -r -i {bdf}) or reboot for it to take effect")
            return out, []
        _check_mode_change(dev, enabled)
        steps: List[Step] = []
        if not enabled:
            steps += [DestroyGi(bdf, g.gi_id, _profile_name({p.profile_id: p for p in profiles}, g.profile_id),
                                g.start, g.size, g.profile_id) for g in gis]
        steps.append(SetMigMode(bdf, enabled))
        out.steps = [s.describe() for s in steps]
        out.changed = True
        if "nvidia-persistenced"[:15] in _processes(host):     # comm holds 15 characters
            out.notes.append("nvidia-persistenced runs: it can block the GPU reset, leaving the change pending")
        return out, steps

    dev = _Device(host, backend, bdf)
    if dry_run:
        return plan(dev)[0]
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        dev = _Device(host, backend, bdf)
        out, steps = plan(dev)
        if not steps:
            return out
        out.writes = _run(dev, store, steps, actor=actor or actor_name(), operation=f"mig {action} {bdf}")
        mode = backend.mig_mode(bdf)
        out.mig_mode = _mode_dict(mode)
        if mode is None or mode[1] != enabled:
            raise DeviceError(f"MIG mode on {bdf} reads back {out.mig_mode} after {action}",
                              hint="check nvidia-smi -q and dmesg")
        out.layout_after = _counts(dev.profiles(), backend.gpu_instances(bdf) if mode[0] else [])
        if mode[0] != enabled:
            out.notes.append(f"MIG mode {'on' if enabled else 'off'} is pending: reset the GPU "
                             f"(nvidia-smi -r -i {bdf}) or reboot for it to take effect")
        return out


def enable(host: HostRoot, store, bdf: PciAddress, **kw) -> MigOutcome:
    return set_mode(host, store, bdf, True, **kw)


def disable(host: HostRoot, store, bdf: PciAddress, **kw) -> MigOutcome:
    return set_mode(host, store, bdf, False, **kw)


def _processes(host: HostRoot) -> List[str]:
    out = []
    try:
        for pid in os.listdir(host.path("proc")):
            if pid.isdigit():
                try:
                    out.append(host.path("proc", pid, "comm").read_text().strip())
                except OSError:
                    pass
    except OSError:
        pass
    return out


def apply(host: HostRoot, store, bdf: PciAddress, layout: "str | Mapping[str, int]", *,
          dry_run: bool = False, backend: Optional[NvmlBackend] = None,
          actor: Optional[str] = None) -> MigOutcome:
    """Make ``bdf``'s GPU instances match ``layout`` (a no-op when they already do).

    Names resolve against the device's profiles (InputError with near
    matches otherwise).  A layout that cannot fit is refused (RefusedError)
    before anything is touched, naming why; so is MIG mode off or pending,
    and destroying GPU instances while vGPUs exist.  Each NVML change is
    audited; the result is read back and verified (DeviceError otherwise,
    after undoing what was done).
    """
    backend = backend or open_backend(host)
    wanted_names = parse_layout(layout) if isinstance(layout, str) else dict(layout)

    def plan(dev: _Device) -> Tuple[MigOutcome, LayoutPlan, Dict[int, int], List[GiProfile]]:
        dev.require_mig()
        profiles = dev.profiles()
        wanted = resolve_layout(profiles, wanted_names, where=f"{bdf} ({dev.name})")
        reason = why_not(profiles, wanted)
        if reason:
            raise RefusedError(f"MIG layout does not fit {bdf} ({dev.name}): {reason}",
                               hint="nothing was changed")
        cur, pending = dev.mode
        if not cur:
            what = ("is pending until a GPU reset (nvidia-smi -r -i {0}) or reboot".format(bdf) if pending
                    else f"is off: run 'vgpuhost mig enable --gpu {bdf}' first")
            raise RefusedError(f"MIG mode on {bdf} {what}", hint=f"order: {ORDER}")
        gis = dev.instances()
        lp = plan_layout(profiles, gis, wanted, bdf)
        out = MigOutcome("apply", str(bdf), changed=bool(lp.steps), dry_run=dry_run, name=dev.name,
                         mig_mode=_mode_dict(dev.mode), layout_before=_counts(profiles, gis),
                         layout_after=_names(profiles, wanted), steps=[s.describe() for s in lp.steps])
        if pending != cur:
            out.notes.append("MIG mode off is pending until a GPU reset: these GPU instances go with it")
        if lp.destroy:
            n = dev.vgpus()
            if n:
                raise RefusedError(f"the layout on {bdf} destroys {len(lp.destroy)} GPU instance(s) while "
                                   f"{n} vGPU(s) exist",
                                   hint="remove the MIG-backed vGPUs first ('vgpuhost vgpu list')")
        if not lp.steps:
            out.notes.append(f"{bdf} already has {layout_text(out.layout_before)}")
        return out, lp, wanted, profiles

    dev = _Device(host, backend, bdf)
    out, lp, _, _ = plan(dev)
    if dry_run or not lp.steps:
        return out
    with file_lock(store.state_dir, f"gpu-{bdf}"):
        dev = _Device(host, backend, bdf)
        out, lp, wanted, profiles = plan(dev)
        if not lp.steps:
            return out
        out.writes = _run(dev, store, lp.steps, actor=actor or actor_name(),
                          operation=f"mig apply {bdf} {layout_text(_names(profiles, wanted))}")
        got = backend.gpu_instances(bdf)
        have: Dict[int, int] = {}
        for g in got:
            have[g.profile_id] = have.get(g.profile_id, 0) + 1
        if have != {k: v for k, v in wanted.items() if v}:
            raise DeviceError(f"MIG layout on {bdf} reads back {layout_text(_counts(profiles, got))} after "
                              f"apply, wanted {layout_text(_names(profiles, wanted))}",
                              hint="see 'vgpuhost audit' and 'vgpuhost mig show'")
        out.layout_after = _counts(profiles, got)
        return out


def assert_layout(host: HostRoot, bdf: PciAddress, layout: "str | Mapping[str, int]", *,
                  backend: Optional[NvmlBackend] = None) -> MigAssert:
    """Compare ``bdf``'s GPU instances with ``layout``; ``in_sync`` False on drift, with a diff
    ``[{profile, wanted, actual}]``.  MIG mode off (or a change pending) is drift
    unless the layout is empty."""
    backend = backend or open_backend(host)
    wanted_names = parse_layout(layout) if isinstance(layout, str) else dict(layout)
    dev = _Device(host, backend, bdf)
    dev.require_mig()
    profiles = dev.profiles()
    wanted = _names(profiles, resolve_layout(profiles, wanted_names, where=f"{bdf} ({dev.name})"))
    cur, pending = dev.mode
    actual = _counts(profiles, dev.instances() if cur else [])
    diff: List[Dict[str, object]] = []
    for name in sorted(set(wanted) | set(actual), key=_name_key):
        if wanted.get(name, 0) != actual.get(name, 0):
            diff.append({"profile": name, "wanted": wanted.get(name, 0), "actual": actual.get(name, 0)})
    if wanted and (not cur or pending != cur):
        now = ("on" if cur else "off") + (f" ({'on' if pending else 'off'} pending)" if pending != cur else "")
        diff.insert(0, {"profile": "(mig mode)", "wanted": "on", "actual": now})
    return MigAssert(str(bdf), not diff, wanted, actual, _mode_dict(dev.mode), diff)


__all__ = ["parse_layout", "layout_text", "resolve_layout", "why_not", "place", "plan_layout",
           "LayoutPlan", "CreateGi", "DestroyGi", "SetMigMode", "MigOutcome", "MigAssert",
           "show", "show_text", "enable", "disable", "set_mode", "apply", "assert_layout"]
