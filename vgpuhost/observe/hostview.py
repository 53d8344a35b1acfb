"""HostView: one immutable snapshot of a host, taken once per operation.

Owns: :func:`observe`, the one function that reads what a planner compares a
desired state with — the sysfs inventory, the state store's vGPU and
passthrough records, the domains the qemu hook reports running, the vGPU
types seen before, NVML facts per GPU, and the configuration files plans
compare against (driverctl overrides, vgpuhost's modprobe.d scheduler file;
the kernel command line and modules are in the inventory's host facts) —
and the frozen values that hold them (:class:`HostView`, :class:`NvmlFacts`,
:class:`MigMode`, :class:`SeenType`).  Every read goes
through an io/ door while the view is built; afterwards it is a value, and a
planner given one does no I/O.  Must not: decide anything (planners in
:mod:`vgpuhost.plan` do) or write anything.

Scope: ``gpus`` limits the NVML probes and the driverctl reads to the GPUs an
operation touches; the rest of the view covers the whole host (placement and
ownership need it).  NVML answers NOT_SUPPORTED and NOT_FOUND as None (NVML
sees only GPUs on the ``nvidia`` driver, docs/reference/hardware.md#nvml); any other failure
to read a GPU — NVML missing on the host included — is kept in that GPU's
facts and raised by :meth:`HostView.nvml` when a planner asks for them, so an
operation that never needs NVML (a passthrough-only layout) never fails for
want of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from ..io.backends import open_backend
from ..io.configfiles import modprobe_conf_files, read_config_text
from ..io.hostroot import HostRoot
from ..io.nvml import NvmlError
from ..io.state import StateStore
from ..io.sysfs import Sysfs
from ..model.errors import HostEnvironmentError, VgpuhostError
from ..model.nvml import GiProfile, GpuInstance, SchedulerCaps, SchedulerState
from ..model.records import PassthroughRecord, VgpuRecord
from ..model.values import PciAddress
from .inventory import Inventory, discover, discover_gpu
from .vgpus import VgpuEntry, list_vgpus

#: vgpuhost's modprobe.d file for the persistent vGPU scheduler (the file
#: :func:`vgpuhost.ops.scheduler.conf_path` names)
SCHEDULER_CONF = "vgpuhost-scheduler.conf"

# ---------------------------------------------------------------------------
# values

class SeenType(NamedTuple):
    """A vGPU type a GPU listed, now or before: ``gpu`` BDF, ``type_id`` (``nvidia-566``),
    ``name`` (``A40-8Q``), ``framebuffer_mib`` (None: unknown).  A tuple in the field order of
    the state store's ``seen_types`` rows, so code that takes those rows takes these."""

    gpu: str
    type_id: str
    name: str
    framebuffer_mib: Optional[int]


@dataclass(frozen=True)
class MigMode:
    """A GPU's MIG mode: ``current`` and ``pending`` (what it is after the next GPU
    reset, docs/reference/hardware.md#mig-profiles).  They differ while a change waits for that reset."""

    current: bool
    pending: bool

    @property
    def waiting(self) -> bool:
        """A change waits for a GPU reset."""
        return self.current != self.pending

    @property
    def on_or_pending(self) -> bool:
        return self.current or self.pending

    def text(self) -> str:
        """``on``, ``off``, ``on, off pending`` or ``off, on pending``."""
        now = "on" if self.current else "off"
        if self.waiting:
            now += f", {'on' if self.pending else 'off'} pending"
        return now


@dataclass(frozen=True)
class NvmlFacts:
    """What NVML reports about one GPU (None / empty: not reported — not supported,
    NVML does not see the GPU, or not read in this GPU's state).

    ``name``, ``uuid``: ``nvmlDeviceGetName`` / ``GetUUID``; ``mig_mode``: None when
    not MIG-capable; ``gi_profiles`` (when MIG-capable) and ``gpu_instances`` (read
    only while MIG mode is on); ``compute_processes``: CUDA processes (blocks a MIG
    mode change; read when MIG-capable); read only while MIG mode is off:
    ``mixed_size`` (heterogeneous vGPU mode; None: the GPU has no such mode),
    ``scheduler`` and ``scheduler_caps`` (device-level vGPU scheduler, docs/reference/hardware.md#vgpu-scheduling) and ``active_vgpus`` (vGPUs running).  ``error``: why the GPU could not be
    read (raised by :meth:`HostView.nvml`).
    """

    name: Optional[str] = None
    uuid: Optional[str] = None
    mig_mode: Optional[MigMode] = None
    gi_profiles: Tuple[GiProfile, ...] = ()
    gpu_instances: Tuple[GpuInstance, ...] = ()
    compute_processes: Optional[int] = None
    mixed_size: Optional[bool] = None
    scheduler: Optional[SchedulerState] = None
    scheduler_caps: Optional[SchedulerCaps] = None
    active_vgpus: Optional[int] = None
    error: Optional[VgpuhostError] = field(default=None, compare=False)


def listed_types(inv: Inventory) -> List[SeenType]:
    """A :class:`SeenType` for every type the inventory lists (sorted, no duplicates)."""
    return [SeenType(*row) for row in sorted({(str(t.gpu), t.type_id, t.name, t.framebuffer_mib)
                                               for t in inv.vgpu_types})]


_NO_FACTS = NvmlFacts()


@dataclass(frozen=True)
class HostView:
    """One snapshot of a host (values only).

    ``inventory``: sysfs as :func:`vgpuhost.observe.inventory.discover` reads it;
    ``records``: the store's vGPU records; ``running``: ``{domain UUID: name}`` of the
    domains the qemu hook reports started and not released; ``passthrough``: the
    store's passthrough records by BDF (str); ``seen``: the types the store remembers,
    then those the inventory lists (later rows win where a consumer builds a map);
    ``vgpus``: inventory and records joined (:func:`vgpuhost.observe.vgpus.list_vgpus`); ``nvml_facts``: by
    GPU, for the GPUs in scope on the nvidia driver (:meth:`nvml`); ``driverctl``:
    ``{BDF: override file text}`` for every function in the IOMMU groups of the GPUs
    in scope (absent: no file); ``scheduler_conf``: the text of vgpuhost's modprobe.d
    scheduler file (None: no file); ``modprobe_files``: ``[(path, text)]`` of every modprobe.d file in
    modprobe's reading order (:func:`vgpuhost.io.configfiles.modprobe_conf_files`; empty: not read) and
    ``cmdline``: the kernel command line (None: not read), so a plan sees what the nvidia module gets.
    """

    inventory: Inventory
    records: Tuple[VgpuRecord, ...] = ()
    running: Mapping[str, str] = field(default_factory=dict)
    passthrough: Mapping[str, PassthroughRecord] = field(default_factory=dict)
    seen: Tuple[SeenType, ...] = ()
    vgpus: Tuple[VgpuEntry, ...] = ()
    nvml_facts: Mapping[PciAddress, NvmlFacts] = field(default_factory=dict)
    driverctl: Mapping[str, str] = field(default_factory=dict)
    scheduler_conf: Optional[str] = None
    modprobe_files: Tuple[Tuple[str, str], ...] = ()
    cmdline: Optional[str] = None

    @classmethod
    def of(cls, inventory: Inventory, records: Sequence[VgpuRecord] = (), *, running: Mapping[str, str] = None,
           passthrough: Sequence[PassthroughRecord] = (), seen: Sequence[Tuple] = (),
           nvml: Mapping[PciAddress, NvmlFacts] = None, driverctl: Mapping[str, str] = None,
           scheduler_conf: Optional[str] = None, modprobe_files: Sequence[Tuple[str, str]] = (),
           cmdline: Optional[str] = None) -> "HostView":
        """A view from parts (what :func:`observe` builds, and what tests build by hand):
        derives ``vgpus`` and appends the inventory's types to ``seen`` (store rows)."""
        records = tuple(records)
        return cls(inventory=inventory, records=records,
                   running=MappingProxyType(dict(running or {})),
                   passthrough=MappingProxyType({r.bdf: r for r in passthrough}),
                   seen=tuple(SeenType(*row) for row in seen) + tuple(listed_types(inventory)),
                   vgpus=tuple(list_vgpus(inventory, records)),
                   nvml_facts=MappingProxyType(dict(nvml or {})),
                   driverctl=MappingProxyType(dict(driverctl or {})),
                   scheduler_conf=scheduler_conf, modprobe_files=tuple(modprobe_files), cmdline=cmdline)

    def nvml(self, gpu: PciAddress) -> NvmlFacts:
        """NVML's facts about ``gpu`` (all None when NVML does not see it or it was not in
        scope).  Raises the error that kept the GPU from being read (HostEnvironmentError
        when NVML is not available, NvmlError for a failed call)."""
        facts = self.nvml_facts.get(gpu, _NO_FACTS)
        if facts.error is not None:
            raise facts.error
        return facts

    def driverctl_override(self, bdf: Union[str, PciAddress]) -> Optional[str]:
        """The text of the function's driverctl override file, None when it has none."""
        return self.driverctl.get(str(bdf))

    def record_time(self, vgpu_id: str) -> str:
        """When the record of ``vgpu_id`` was written ('' when not recorded)."""
        return next((r.time for r in self.records if r.id == vgpu_id), "")


# ---------------------------------------------------------------------------
# observing

Scope = Union[None, Iterable[PciAddress], Callable[[Inventory], Iterable[PciAddress]]]


def observe(host: HostRoot, store: StateStore, *, gpus: Scope = None, nvml: bool = True) -> HostView:
    """Read ``host`` and ``store`` once into a :class:`HostView`.

    ``gpus``: the GPUs the operation touches — None (every GPU), addresses, or a
    function of the inventory that returns them (a planner's scope); NVML facts
    and driverctl overrides are read for those only.  ``nvml``: False when the
    operation needs no NVML at all (the backend is then not opened).
    Raises HostEnvironmentError when ``host`` does not look like a host root or a
    configuration file exists but cannot be read; NVML failures are kept in the
    view (see :meth:`HostView.nvml`).  Cost: one sysfs scan, three store queries,
    at most ten NVML reads per GPU in scope.
    """
    host.require_host()
    fs = Sysfs(host)
    inv = discover(fs)
    if gpus is None:
        scope = [g.address for g in inv.gpus]
    else:
        scope = list(gpus(inv) if callable(gpus) else gpus)
    wanted = sorted({a for a in scope if inv.gpu(a) is not None})
    on_nvidia = [a for a in wanted if inv.gpu(a).pci.driver == "nvidia"]
    facts = _probe_all(host, on_nvidia) if nvml and on_nvidia else {}
    return HostView.of(inv, store.vgpu_records(), running=store.active_domains(),
                       passthrough=store.passthrough_records(), seen=store.seen_types(), nvml=facts,
                       driverctl=_driverctl(host, inv, wanted),
                       scheduler_conf=read_config_text(host.modprobe_d / SCHEDULER_CONF),
                       modprobe_files=modprobe_conf_files(host), cmdline=read_config_text(host.proc_cmdline))


def refresh(view: HostView, host: HostRoot, store: StateStore, gpus: Iterable[PciAddress], *,
            nvml: bool = True) -> HostView:
    """``view`` with what ``gpus`` hold read again, each GPU alone; every other GPU as it was.

    For an operation that changed those GPUs and carries one view across its
    steps (apply): each GPU is read with
    :func:`vgpuhost.observe.inventory.discover_gpu` (its PF, VFs, IOMMU groups,
    types, vGPUs), its NVML facts probed again when ``nvml`` and it is on the
    nvidia driver, its driverctl overrides read again; the store's records,
    running domains and seen types are read again (one query each).  The
    host facts are kept.  Where nothing else changed the host, the result
    equals a fresh :func:`observe` with the same scope.  Cost: proportional to
    the GPUs refreshed (sysfs, NVML) plus one pass over the view's records
    and types.  Raises what :func:`observe` raises.
    """
    host.require_host()
    fs = Sysfs(host)
    inv = view.inventory
    facts = dict(view.nvml_facts)
    driverctl = dict(view.driverctl)
    for gpu in sorted(set(gpus)):
        part = discover_gpu(fs, gpu, host_facts=False)
        old_group = inv.group_of(gpu)
        inv = _merged(inv, part, gpu)
        g = inv.gpu(gpu)
        facts.pop(gpu, None)
        if nvml and g is not None and g.pci.driver == "nvidia":
            facts.update(_probe_all(host, [gpu]))
        for m in (old_group.members if old_group is not None else (gpu,)):
            driverctl.pop(str(m), None)
        if g is not None:
            driverctl.update(_driverctl(host, inv, [gpu]))
    return HostView.of(inv, store.vgpu_records(), running=store.active_domains(),
                       passthrough=store.passthrough_records(), seen=store.seen_types(), nvml=facts,
                       driverctl=driverctl, scheduler_conf=view.scheduler_conf, modprobe_files=view.modprobe_files,
                       cmdline=view.cmdline)


def _merged(inv: Inventory, part: Inventory, gpu: PciAddress) -> Inventory:
    """``inv`` with GPU ``gpu``'s records replaced by ``part``'s (a :func:`discover_gpu` of it), in
    the order :func:`discover` gives them (GPUs by address, mdevs by UUID)."""
    old = inv.gpu(gpu)
    new = part.gpu(gpu)
    gone = set(old.vfs) - set(new.vfs if new is not None else ()) if old is not None else set()
    devices = {a: d for a, d in inv.devices.items() if a not in gone}
    devices.update(part.devices)
    parents = set(old.mdev_parents if old is not None else ()) | set(new.mdev_parents if new is not None else ())
    dropped = {m.iommu_group for m in inv.mdevs if m.parent in parents}      # the GPU's mdevs' own groups
    groups = {n: grp for n, grp in inv.groups.items()
              if n not in dropped and (not gone or not set(grp.members) <= gone)}
    groups.update(part.groups)
    gpus = tuple(sorted([g for g in inv.gpus if g.address != gpu] + ([new] if new is not None else []),
                        key=lambda g: g.address))
    types: Dict[PciAddress, List] = {}
    for t in inv.vgpu_types:
        if t.gpu != gpu:
            types.setdefault(t.gpu, []).append(t)
    types[gpu] = list(part.vgpu_types)
    vfv: Dict[PciAddress, List] = {}
    for v in inv.vf_vgpus:
        if v.gpu != gpu:
            vfv.setdefault(v.gpu, []).append(v)
    vfv[gpu] = list(part.vf_vgpus)
    mdevs = sorted([m for m in inv.mdevs if m.parent not in parents] + list(part.mdevs), key=lambda m: m.uuid)
    return Inventory(devices=devices, groups=groups, gpus=gpus,
                     vgpu_types=tuple(t for g in gpus for t in types.get(g.address, ())), mdevs=tuple(mdevs),
                     vf_vgpus=tuple(v for g in gpus for v in vfv.get(g.address, ())), host=inv.host,
                     out_of_service=inv.out_of_service)


def _driverctl(host: HostRoot, inv: Inventory, gpus: Sequence[PciAddress]) -> Dict[str, str]:
    """``{BDF: override text}`` for every function in the GPUs' IOMMU groups that has a file."""
    out: Dict[str, str] = {}
    for a in gpus:
        group = inv.group_of(a)
        members = group.members if group is not None else (a,)
        for m in members:
            try:
                text = read_config_text(host.driverctl_d / f"pci-{m}")
            except HostEnvironmentError:        # unreadable: compares as no override
                text = None
            if text is not None:
                out[str(m)] = text
    return out


def _probe_all(host: HostRoot, gpus: Sequence[PciAddress]) -> Dict[PciAddress, NvmlFacts]:
    try:
        backend = open_backend(host)
    except VgpuhostError as e:
        return {a: NvmlFacts(error=e) for a in gpus}
    return {a: probe(backend, a) for a in gpus}


def _quiet(call, bdf: PciAddress):
    """One NVML read: NOT_SUPPORTED and NOT_FOUND read as None."""
    try:
        return call(bdf)
    except NvmlError as e:
        if e.not_supported or e.nvml_name == "NVMLError_NotFound":
            return None
        raise


def probe(backend, bdf: PciAddress) -> NvmlFacts:
    """The :class:`NvmlFacts` of one GPU through ``backend`` (an
    :class:`vgpuhost.io.nvml.NvmlBackend`); a failed read is kept as ``error``."""
    try:
        name = _quiet(backend.device_name, bdf)
        uuid = _quiet(backend.device_uuid, bdf)
        raw = _quiet(backend.mig_mode, bdf)
        mode = MigMode(bool(raw[0]), bool(raw[1])) if raw is not None else None
        profiles = tuple(_quiet(backend.gi_profiles, bdf) or ()) if mode is not None else ()
        instances = tuple(_quiet(backend.gpu_instances, bdf) or ()) if mode is not None and mode.current else ()
        procs = _quiet(backend.compute_processes, bdf) if mode is not None else None
        if mode is None or not mode.current:
            mixed = _quiet(backend.heterogeneous_mode, bdf)
            sched = _quiet(backend.scheduler_state, bdf)
            caps = _quiet(backend.scheduler_caps, bdf)
            active = _quiet(backend.active_vgpus, bdf)
        else:
            mixed = sched = caps = active = None
    except VgpuhostError as e:
        return NvmlFacts(error=e)
    return NvmlFacts(name=name, uuid=uuid, mig_mode=mode, gi_profiles=profiles, gpu_instances=instances,
                     compute_processes=procs, mixed_size=None if mixed is None else bool(mixed), scheduler=sched,
                     scheduler_caps=caps, active_vgpus=active)


__all__ = ["HostView", "NvmlFacts", "MigMode", "SeenType", "observe", "refresh", "probe", "listed_types",
           "SCHEDULER_CONF"]
