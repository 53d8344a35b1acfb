"""vGPU lifecycle on both NVIDIA backends: create, remove, list, reconcile.

Owns: resolving profile names per device, building placement offers from an
inventory and the records, creating and removing vGPUs through the sysfs
layer under a per-GPU lock with the record written in one transaction,
ownership (never touch a vGPU vgpuhost did not create; a release for owner X
never removes a device now owned by Y), mdevctl persistence and reconcile.
Must not: spell kernel paths (HostRoot does) or choose GPUs itself
(:mod:`vgpuhost.placement` does).

Backends (docs/reference/hardware.md#mdev, #vendor-vfio): classic mdev — write a UUID to
``<parent>/mdev_supported_types/<type>/create``, remove by writing ``1`` to
``<mdev>/remove``; the parent is the PF or, on SR-IOV GPUs, a VF holding at
most one vGPU.  Vendor-specific VFIO (vGPU 17+) — write the type id to the
VF's ``nvidia/current_vgpu_type``, ``0`` to destroy; EPERM when the VF is
taken.  Persistence of classic mdevs is mdevctl's format
(``/etc/mdevctl.d/<parent>/<uuid>``, docs/reference/hardware.md#mdev); vendor-VFIO and
MIG-backed vGPUs cannot persist that way and are re-created by
``reconcile`` at boot.
"""

from __future__ import annotations

import errno
import os

from ..model.errors import DeviceError, GpuFailedError, InputError, RefusedError, SysfsError, VgpuhostError
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..model.records import VgpuRecord
from ..io.state import StateStore, VgpuRecordTaken, claim_vgpu, delete_vgpu, give_back_vgpu, put_vgpu, utcnow
from ..model.kinds import Backend, Owner, PlacementStrategy, VgpuState
from ..plan.executor import Executor, describe
from ..plan.journal import Journal
from ..plan.steps import CreateVgpu, RemoveConfig, RemoveVgpu, SetPlacement, SetVgpuParams, Step, WriteConfig
from .recover import destroy
from ..io.sysfs import Sysfs
from ..io.vfioholders import RemoveTimedOut, VgpuInUse
from ..io.vgpudev import MDEVCTL_PARAMS_ATTR, for_backend, mdevctl_attrs, vgpu_exists
from ..io.process import actor as actor_name
from ..model.values import (PciAddress, VgpuProfile, field, json_flag, json_small_int, json_text, parse_device_id,
                            parse_uuid, record, replace, validate_owner)

# What only a create (or a listing) needs, the inventory, placement and the offers, is imported
# where it is used: the qemu hook's ``release end`` removes through this module in a process of its
# own, and those imports were about 1.5 ms of its start (measured 2026-12-01).
BACKEND_MDEV = Backend.MDEV                 # = vgpuhost.observe.inventory.BACKEND_MDEV
BACKEND_VENDOR_VFIO = Backend.VENDOR_VFIO
MANUAL = Owner.MANUAL                       # = vgpuhost.policy.placement.MANUAL
LAYOUT = Owner.LAYOUT

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Collection, Dict, FrozenSet, List, Optional, Sequence, Tuple, Union
    from ..observe.inventory import Inventory
    from ..policy.placement import Decision, GpuOffer
    #: what must be committed with a new vGPU's record: called with the record's transaction and the record
    OnRecord = Callable[[object, VgpuRecord], None]


def list_vgpus(inv, records, removing: FrozenSet[str] = frozenset()):
    """:func:`vgpuhost.observe.vgpus.list_vgpus` (imported on use)."""
    from ..observe.vgpus import list_vgpus as listed
    return listed(inv, records, removing)


def removal_pending(store: StateStore) -> FrozenSet[str]:
    """The vGPU ids whose removal is pending: named by an open ``vgpu-remove`` journal entry (its write
    blocked by a holder, or its writer ended without answering), which ``reconcile`` finishes."""
    if store.absent:
        return frozenset()
    return frozenset(str(d.get("id")) for j in store.journal_entries(open_only=True) if j.kind == "vgpu-remove"
                     for d in j.devices)


def resolve_profile(*args, **kwargs):
    """:func:`vgpuhost.policy.offers.resolve_profile` (imported on use)."""
    from ..policy.offers import resolve_profile as resolve
    return resolve(*args, **kwargs)

MAX_PLACEMENT_ATTEMPTS = 5


# ---------------------------------------------------------------------------
# outcomes

@record
class VgpuOutcome:
    action: str
    changed: bool
    dry_run: bool
    id: Optional[str] = None
    gpu: Optional[str] = None
    parent: Optional[str] = None
    type_id: Optional[str] = None
    type_name: Optional[str] = None
    backend: Optional[str] = None
    owner: Optional[str] = None
    reason: str = ""
    steps: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    writes: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d = {"schema": "vgpuhost.vgpu/v1", **d}
        return d


#: compiled on first use (re caches it): most creates pass no parameters
#: matched whole (``fullmatch``): ``$`` would let a trailing newline through, ``\s`` embedded ones,
#: and the driver splits the written string on newlines (tester finding F3)
_PARAMS_PATTERN = r"[A-Za-z][A-Za-z0-9_-]*=[A-Za-z0-9_.:-]*(,[ ]*[A-Za-z][A-Za-z0-9_-]*=[A-Za-z0-9_.:-]*)*"


def _validate_params(params: str) -> None:
    """``vgpu_params``: comma-separated key=value pairs (docs/reference/hardware.md#mdev), at most 1000 characters."""
    if len(params) > 1000:
        raise InputError(f"--params is {len(params)} characters; at most 1000")
    import re           # here: the qemu hook's path imports no re (most creates pass no parameters)
    if not re.fullmatch(_PARAMS_PATTERN, params):
        raise InputError(f"--params {params[:80]!r} is not a list of key=value pairs",
                         hint="e.g. frame_rate_limiter=0,disable_vnc=1")
    keys = [kv.split("=", 1)[0].strip() for kv in params.split(",")]
    if len(set(keys)) != len(keys):
        raise InputError(f"--params names a key twice: {params[:80]!r}")


# ---------------------------------------------------------------------------
# create

@record(frozen=True)
class VgpuCreateRequest:
    """What one ``vgpu create`` asks for, parsed once (:meth:`parse`) where it enters (the click
    command, the agent's ``POST /v1/vgpus``, the keyword form :func:`create`) and carried as a
    value to :func:`create_vgpu`.

    ``profile``: the vGPU type asked for, parsed (``A40-8Q``: asked in any case).  ``gpu``: the GPU it must
    go on, or None.  ``uuid``: the mdev UUID (normalised), None for a new one.  ``vf`` (vendor
    VFIO only): exactly this VF (the qemu hook's hostdev names it).  ``strategy``: the placement
    strategy's name.  ``owner``: a domain UUID, ``manual`` or ``layout``.  ``params``: the
    ``vgpu_params`` (``key=value,...``) or None.  ``numa_node``: the NUMA node to prefer, or
    None.  ``anti_affinity``: a key no two vGPUs on one GPU share, or None.  ``persist``: define
    it in mdevctl.  ``create_gi``: for a MIG-backed profile, create the GPU instance it needs.
    ``allowed_gpus``: the GPUs placement may use (the hook's operator allow-list), None: all.
    ``resolved``: ``str(profile)`` is already the type name as this host's devices spell it (the qemu
    hook's ``prepare`` resolved it once, before admission): it is created as it is, not resolved again.
    """

    profile: VgpuProfile
    gpu: Optional[PciAddress] = None
    uuid: Optional[str] = None
    vf: Optional[PciAddress] = None
    strategy: str = PlacementStrategy.FIRST_FIT
    owner: str = MANUAL
    params: Optional[str] = None
    numa_node: Optional[int] = None
    anti_affinity: Optional[str] = None
    persist: bool = False
    create_gi: bool = False
    allowed_gpus: Optional[FrozenSet[PciAddress]] = None
    resolved: bool = False

    @classmethod
    def parse(cls, profile: Union[VgpuProfile, str], *, gpu: Union[PciAddress, str, None] = None, uuid: Optional[str] = None,
              vf: Union[PciAddress, str, None] = None, strategy: str = PlacementStrategy.FIRST_FIT, owner: str = MANUAL,
              params: Optional[str] = None, numa_node: Optional[int] = None, anti_affinity: Optional[str] = None,
              persist: bool = False, create_gi: bool = False,
              allowed_gpus: Optional[Collection[PciAddress]] = None, resolved: bool = False) -> VgpuCreateRequest:
        """The request, checked before anything is read or changed (``profile``: a VgpuProfile or its
        name; ``gpu``, ``vf``: a PciAddress or its text).  Raises InputError for a profile that is no
        vGPU type name, a GPU or VF address, owner, UUID or anti-affinity key that is not valid, an unknown strategy, a UUID and a VF both, ``params`` that are not
        ``key=value`` pairs, and ``persist`` with a MIG-backed profile."""
        from ..policy.placement import RESERVING, STRATEGIES
        profile = VgpuProfile.parse(profile) if isinstance(profile, str) else profile
        gpu = PciAddress.parse(gpu) if isinstance(gpu, str) else gpu
        vf = PciAddress.parse(vf) if isinstance(vf, str) else vf
        if strategy not in STRATEGIES and strategy not in RESERVING:
            raise InputError(f"unknown placement strategy {strategy!r}",
                             hint="one of " + ", ".join(STRATEGIES + RESERVING))
        owner = validate_owner(owner)
        if uuid is not None:
            uuid = parse_uuid(uuid)
        if vf is not None and uuid is not None:
            raise InputError("give an mdev UUID or a VF, not both", hint="a VF names its vGPU on vendor VFIO")
        if params is not None:
            _validate_params(params)
        if anti_affinity is not None:
            from ..libvirt.domxml import valid_key
            if not valid_key(anti_affinity):
                raise InputError(f"--anti-affinity {anti_affinity[:64]!r} is not a valid key",
                                 hint="letters, digits and _.:+- only, starting with a letter or digit, at most 64 "
                                      "characters (the rule of the domain metadata's anti-affinity=)")
        if persist and profile.mig_backed:    # before a GPU instance is touched
            raise InputError(f"--persist cannot keep a MIG-backed vGPU ({profile}) across reboots: MIG-backed "
                             "vGPUs do not survive a reboot (docs/reference/hardware.md#mdev)",
                             hint="create it without --persist and enable the boot unit that runs "
                                  "'vgpuhost reconcile'")
        return cls(profile, gpu, uuid, vf, strategy, owner, params, numa_node, anti_affinity, persist, create_gi,
                   frozenset(allowed_gpus) if allowed_gpus is not None else None, resolved)

    #: the agent's ``POST /v1/vgpus`` body keys of a request (:meth:`from_json`, :meth:`body`; agent/openapi.yaml)
    JSON_KEYS = ("profile", "gpu", "vgpu_uuid", "strategy", "owner", "params", "numa_node", "anti_affinity",
                 "persist", "create_gi")

    @classmethod
    def from_json(cls, body: Optional[Dict[str, object]]) -> VgpuCreateRequest:
        """The request from the agent's JSON body (:data:`JSON_KEYS`; other keys are the route's).  Raises
        InputError naming the first key of the wrong type or length, then as :meth:`parse`."""
        body = body or {}
        return cls.parse(json_text(body, "profile", 128, required=True), gpu=json_text(body, "gpu", 32),
                         uuid=json_text(body, "vgpu_uuid", 64),
                         strategy=json_text(body, "strategy", 32) or PlacementStrategy.FIRST_FIT,
                         owner=json_text(body, "owner", 64) or MANUAL, params=json_text(body, "params", 1024),
                         numa_node=json_small_int(body, "numa_node"),
                         anti_affinity=json_text(body, "anti_affinity", 256),
                         persist=json_flag("persist", body.get("persist", False)),
                         create_gi=json_flag("create_gi", body.get("create_gi", False)))

    def body(self) -> Dict[str, object]:
        """The agent's ``POST /v1/vgpus`` body that asks for this request (what ``vgpuhost vgpu create``
        forwards; ``allowed_gpus``, ``vf`` and ``resolved`` are the hook's and have no key there)."""
        return {"profile": str(self.profile), "gpu": str(self.gpu) if self.gpu is not None else None,
                "vgpu_uuid": self.uuid, "strategy": self.strategy, "owner": self.owner, "params": self.params,
                "numa_node": self.numa_node, "anti_affinity": self.anti_affinity, "persist": self.persist,
                "create_gi": self.create_gi}


def create(host: HostRoot, store: StateStore, *, profile: Union[VgpuProfile, str], gpu: Optional[PciAddress] = None,
           uuid: Optional[str] = None, strategy: str = PlacementStrategy.DEFAULT, owner: str = MANUAL,
           params: Optional[str] = None, numa_node: Optional[int] = None,
           anti_affinity: Optional[str] = None, persist: bool = False, dry_run: bool = False,
           create_gi: bool = False, actor: Optional[str] = None, vf: Optional[PciAddress] = None,
           allowed_gpus: Optional[Collection[PciAddress]] = None,
           inventory: Optional[Inventory] = None, resolved: bool = False,
           on_record: Optional[OnRecord] = None) -> VgpuOutcome:
    """:func:`create_vgpu` of the :class:`VgpuCreateRequest` these keywords spell (its fields, the
    same names): the form the qemu hook's devices, attach, layout apply and the tests call.
    ``on_record``: as :func:`create_vgpu` takes it."""
    request = VgpuCreateRequest.parse(profile, gpu=gpu, uuid=uuid, vf=vf, strategy=strategy, owner=owner,
                                      params=params, numa_node=numa_node, anti_affinity=anti_affinity,
                                      persist=persist, create_gi=create_gi, allowed_gpus=allowed_gpus,
                                      resolved=resolved)
    return create_vgpu(host, store, request, dry_run=dry_run, actor=actor, inventory=inventory, on_record=on_record)


def create_vgpu(host: HostRoot, store: StateStore, request: VgpuCreateRequest, *, dry_run: bool = False,
                actor: Optional[str] = None, inventory: Optional[Inventory] = None,
                on_record: Optional[OnRecord] = None) -> VgpuOutcome:
    """Create one vGPU as ``request`` asks, on a GPU chosen by its strategy (or the one it pins).

    With ``request.vf`` (vendor-specific VFIO only, docs/reference/hardware.md#vendor-vfio): set
    the type on exactly this VF.  Refused when the VF is not a VF of an NVIDIA GPU on vendor
    VFIO, holds a vGPU, or does not offer the type now; a no-op (``changed`` False) when the
    record already says the owner holds this VF with this type and the VF reads it back.
    ``inventory``: a snapshot the caller has just read (``discover(Sysfs(host))``, the qemu
    hook's), used for the first, unlocked placement look instead of reading the host again; the
    choice is always re-checked under the GPU lock on a fresh discovery of that GPU alone, and a
    request that look cannot take (no room, a MIG step missing) is looked at again on a fresh read
    before it is refused or a GPU instance made for it (the agent's snapshot misses a MIG change
    made through NVML alone, :mod:`vgpuhost.io.changes`).
    ``on_record``: called as ``on_record(conn, record)`` inside the transaction that writes the new
    vGPU's record (a :class:`~vgpuhost.model.records.VgpuRecord`), so what it writes on ``conn`` is
    committed with the record or not at all (a tenant's allocate: its allocation row takes the VF's id).
    Cost: with a pinned GPU or VF only that GPU's sysfs is read
    (:func:`vgpuhost.observe.inventory.discover_gpu`); otherwise the first look reads the whole
    host (placement compares GPUs) and the check under the lock the chosen GPU.

    Raises InputError (unknown profile, --persist or --uuid where it cannot work), RefusedError
    (nothing fits: the reason names each GPU), or DeviceError when the kernel refuses (errno in
    operator language; a half-created vGPU is removed again).

    MIG-backed profiles (``H200X-1-18C``) need, in order, SR-IOV VFs, MIG mode and a free GPU
    instance of the profile's GI profile; with ``create_gi`` a missing GPU instance is created
    first (through :func:`vgpuhost.mig.apply`, audited), otherwise the refusal names the step
    that is missing.
    """
    fs = Sysfs(host)
    req = request
    gi_tried = False
    scope = _physfn(fs, req.vf) if req.vf is not None else req.gpu     # the one GPU to read (None: the whole host)
    failed: List[GpuFailedError] = []       # GPUs that failed under this call (issue 27)
    for _ in range(MAX_PLACEMENT_ATTEMPTS):
        theirs = inventory is not None  # this look is the caller's (the agent's warm snapshot), not read now
        inv, records, seen = _look(fs, store, inventory, scope, req.vf, dry_run, owner=req.owner)
        inventory = None                # the caller's look serves the first attempt only
        pin = req.gpu
        if req.vf is not None:
            pin = _vf_gpu(inv, req.vf, req.gpu)
            done = _vf_held(fs, records, req.vf, req.owner, str(req.profile), dry_run)
            if done is not None:
                return done
        if theirs and req.profile.mig_backed and not _offered_now(inv, str(req.profile), pin):
            # never refused (nor a GPU instance made) for a MIG step the caller's look says is missing: a
            # GPU instance made behind it (NVML alone: nvidia-smi) moves no file its check watches, so
            # the host is read now and looked at again (trial 8 T1)
            continue
        if _check_pin(host, store, inv, req, pin, gi_tried=gi_tried, dry_run=dry_run, actor=actor):
            gi_tried = True
            continue                    # a GPU instance was made for the MIG-backed profile: look again
        name = str(req.profile) if req.resolved else resolve_profile(inv, records, str(req.profile), pin, seen)
        req, pin, defined_parent = _follow_definition(host, fs, store, inv, req, name, pin)
        limits_of = limits_lookup(host, inv, records)
        limits = {} if req.vf is not None else limits_of(name)    # a chosen VF: the driver decides
        try:
            decision = _decide(inv, records, seen, req, name, pin, defined_parent, strict=dry_run, limits=limits,
                               limits_of=limits_of)
        except RefusedError as e:
            if theirs:      # never refused for room on the caller's look: read the host now, look again (T1)
                continue
            if failed:      # a device write failed (exit 3): the GPU that failed first, then why nothing else fits
                last = failed[-1]
                last.message = ("; ".join(f.message for f in failed) + " (marked unhealthy); no other GPU takes it: "
                                + e.message)
                raise last from None
            raise
        if failed:          # the audit's (placement) row names the GPU that failed and the one chosen now
            decision = type(decision)(decision.gpu, decision.parent, decision.type_id,
                                "; ".join(f.message for f in failed) + f" (marked unhealthy); placed again on "
                                f"{decision.gpu}: {decision.reason}", decision.rejected)
        out = _planned(host, req, inv.gpu(decision.gpu).vgpu_backend, decision, name, dry_run)
        if dry_run:
            _refuse_recorded(fs, store, out.id)         # as the run says (nothing written, no audit row)
            return out
        try:
            done = _create_locked(fs, store, inv, seen, req, out, decision, defined_parent, actor, on_record)
        except GpuFailedError as e:
            # the GPU failed (EIO/ENODEV): out of service from now on; an unpinned request tries the next GPU
            # placement allows, within this same call (issue 27); a pinned one cannot move
            from . import health
            from ..policy.health import Source
            health.mark_unhealthy(store, PciAddress.parse(e.gpu), e.message, Source.IO, actor=actor or actor_name(),
                                  operation=f"vgpu create {out.type_name} owner={req.owner}")
            failed.append(e)
            if req.gpu is not None or req.vf is not None or len(failed) >= MAX_PLACEMENT_ATTEMPTS:
                e.message += " (the GPU is marked unhealthy and left out of placement)"
                if len(failed) > 1:
                    e.message = "; ".join(f.message for f in failed[:-1]) + "; then " + e.message
                raise
            continue
        if done is not None:
            if failed:
                done.notes.append("; ".join(f"{f.message} (marked unhealthy)" for f in failed)
                                  + f"; created on {done.gpu} instead")
            return done
    raise RefusedError(f"cannot place {req.profile}: the host kept changing under placement "
                       f"({MAX_PLACEMENT_ATTEMPTS} attempts)", hint="try again")


def _look(fs: Sysfs, store: StateStore, inventory: Optional[Inventory], scope: Optional[PciAddress],
          vf: Optional[PciAddress], dry_run: bool, *, owner: Optional[str] = None
          ) -> Tuple[Inventory, List[VgpuRecord], list]:
    """``(inventory, records, seen type rows)`` of one placement look: of the GPU ``scope`` alone
    when there is one (never the whole host), else of every GPU.  ``inventory``: the caller's
    look, taken instead of a read.  Remembers the types seen (not on a dry run).  VFs reserved for
    an incoming migration other than ``owner``'s (a domain UUID) count as taken."""
    from ..observe.inventory import discover, discover_gpu, gpu_part
    from ..policy.offers import seen_rows
    if inventory is not None:
        inv = gpu_part(inventory, scope) if scope is not None else inventory
    elif scope is not None:
        inv = discover_gpu(fs, scope, host_facts=False)
    else:
        inv = discover(fs)
    if vf is not None and inv.gpu(scope) is None:
        inv = discover(fs)              # the VF's PF is no NVIDIA GPU: the whole host says what it is
    from . import health     # ops.health and policy.health: on create, not on the hook's release
    if scope is None and not dry_run:
        # the check each operation runs (cheap: the store's GPUs against this read): a GPU gone from the tree
        health.quick_check(fs.host, store, inv, actor=actor_name(), whole=inventory is None)
    # a GPU out of service offers nothing (docs/guide/failures.md), a VF reserved for another domain's
    # incoming migration neither (docs/guide/migration.md)
    inv = health.in_service(inv, store, owner=owner)
    # the GPU's records when one GPU is read (what the checks look at), else every record
    records = store.vgpu_records(gpu=str(scope) if scope is not None else None)
    rows = seen_rows(inv)               # once: every type of the look (a VF host: thousands)
    if not dry_run:
        store.remember_types(rows)
    if scope is None:
        seen = store.seen_types() + rows
    else:                               # the one GPU's rows: what resolve and offers look at
        here = str(scope)
        seen = store.seen_types(gpu=here) + [row for row in rows if row[0] == here]
    return inv, records, seen


def _check_pin(host: HostRoot, store: StateStore, inv: Inventory, req: VgpuCreateRequest,
               pin: Optional[PciAddress], *, gi_tried: bool, dry_run: bool, actor: Optional[str]) -> bool:
    """Refuse what the pinned GPU (or, for a MIG-backed profile, the host) cannot take in any case:
    no such GPU (InputError), a MIG-backed profile nothing offers now (RefusedError naming the
    missing step), a GPU passed through.  True when a GPU instance was just created for the
    profile (``create_gi``, once, not on a dry run): look again."""
    from ..policy.iommu import VFIO_PCI
    if pin is not None and inv.gpu(pin) is None:
        raise InputError(f"no NVIDIA GPU at {pin}", hint="'vgpuhost gpus' lists them")
    wanted = req.profile
    if wanted.mig_backed and not _offered_now(inv, str(wanted), pin):
        if req.create_gi and not gi_tried and not dry_run:
            _create_gpu_instance(host, store, inv, wanted, pin, actor)
            return True
        _refuse_mig_order(host, inv, wanted, str(wanted), pin, req.create_gi, dry_run)
    if pin is not None and inv.gpu(pin).pci.driver == VFIO_PCI:
        # passed through (its SR-IOV VFs are off then, so it lists no types): say that, not "unknown profile"
        raise RefusedError(f"GPU {pin} is passed through (bound to vfio-pci): it carries no vGPUs",
                           hint=f"release it first (vgpuhost passthrough release {pin}) or name another GPU; "
                                "nothing was changed")
    return False


def _follow_definition(host: HostRoot, fs: Sysfs, store: StateStore, inv: Inventory, req: VgpuCreateRequest,
                       name: str, pin: Optional[PciAddress]
                       ) -> Tuple[VgpuCreateRequest, Optional[PciAddress], Optional[PciAddress]]:
    """``(request, pin, parent)`` as an mdevctl definition (defined, not started) of the request's
    UUID makes them: its GPU pinned, its parent the only one, its attrs' params taken and nothing
    persisted again (it is defined already); unchanged, parent None, without one.  Raises
    RefusedError when the definition disagrees with the request (:func:`_respect_definition`)."""
    if req.uuid is None or req.vf is not None or store.vgpu_records(vgpu_id=req.uuid):
        return req, pin, None
    defined = mdevctl_definition(host, fs, req.uuid)
    if defined is None:
        return req, pin, None
    pin = _respect_definition(inv, defined, req.uuid, name, pin)
    params = _definition_params(defined, req.uuid, req.params)      # its attrs: applied, or refused
    return replace(req, params=params, persist=False), pin, defined[0]


def _placement(req: VgpuCreateRequest, name: str, pin: Optional[PciAddress]):
    """The placement request (:class:`vgpuhost.policy.placement.Request`) for ``name`` pinned to ``pin``."""
    from ..policy.placement import Request
    return Request(name, req.owner, req.strategy, req.numa_node, req.anti_affinity, pin)


def mode_limits(host: HostRoot, inv: Inventory, name: str, records: Optional[Sequence[VgpuRecord]] = None) -> dict:
    """``{gpu: max instances of name in its vGPU mode}`` for vendor-VFIO GPUs, whose VFs list a type
    on every free VF (mdev parents count the mode's max themselves), and, with ``records``, for GPUs
    holding a record whose vGPU is missing; NVML and the catalog are asked only when such a GPU lists
    ``name``.  What placement here, the re-check under the GPU's lock and admission
    (:func:`vgpuhost.ops.tenancy.admitting`'s ``limits_for``) count."""
    return limits_lookup(host, inv, records)(name)


def limits_lookup(host: HostRoot, inv: Inventory, records: Optional[Sequence[VgpuRecord]] = None):
    """``name -> {gpu: max}`` as :func:`mode_limits` gives it, for many names on one look (``types``,
    a refusal's "types that still fit"): NVML is asked for the GPUs' modes once, at the first name a
    vendor-VFIO GPU (or a GPU of a missing record) lists, and never on a host without one.

    In mixed-size mode the max is what still fits at free placement ids, the records whose vGPU is
    missing from the GPU counted at the ids ``reconcile`` re-creates them at
    (:func:`vgpuhost.policy.config.mixed_reserved`; trial 8 retest R4).  ``records``: the vGPU records
    (None: a vendor-VFIO GPU's are read from the store when it is in mixed-size mode; an mdev GPU's
    missing records are then not looked for).  The callable's ``modes()`` gives ``{gpu: mixed-size
    mode on}`` as NVML reports it (read once, on the first call; empty where NVML cannot be had), for
    :func:`vgpuhost.policy.offers.offers`' ``modes``."""
    gone: Dict[PciAddress, List[VgpuRecord]] = {}
    if records:
        from ..policy.offers import missing_records
        for g in inv.gpus:
            ix = inv.on_gpu(g.address) if g.vgpu_backend else None
            miss = missing_records(ix, g.address, records) if ix is not None else None
            if miss:
                gone[g.address] = miss
    vfio = [g.address for g in inv.gpus if (g.vfs and g.vgpu_backend and g.vgpu_backend != BACKEND_MDEV)
            or g.address in gone]
    listed: set = set()         # the names those GPUs list, lower-case: gathered at the first name asked about
    mixed: List[dict] = []
    cache: Dict[str, dict] = {}

    def modes() -> dict:
        if not mixed:
            from .tenancy import mixed_size_of      # here: the catalog (yaml) and NVML, never on the hook's mdev path
            mixed.append(mixed_size_of(host, inv))
        return mixed[0]

    def of(name: str) -> dict:
        if not vfio:
            return {}           # no vendor-VFIO GPU: nothing to read (an mdev host's start)
        key = name.lower()
        if not listed:
            # the vendor-VFIO GPUs' rows alone (Inventory.types_of), not the host's; '' marks it done
            listed.update(t.name.lower() for g in vfio for t in inv.types_of(g) if t.name)
            listed.update(r.type_name.lower() for rs in gone.values() for r in rs)
            listed.add("")
        if not key or key not in listed:
            return {}
        if key not in cache:
            from ..policy.config import mode_limits as limits_in_mode
            on = modes()
            limits = limits_in_mode(inv, name, on)
            for g in [g for g in inv.gpus if g.address in vfio and on.get(g.address)]:
                # mixed-size mode: what still fits at free placement ids (fragmentation), not the max alone
                n = _mixed_fit(host, inv, g, name, placed, gone.get(g.address) if records is not None else None)
                if n is not None:
                    limits[g.address] = min(limits.get(g.address, n), n)
            cache[key] = limits
        return cache[key]
    placed: Dict[PciAddress, list] = {}
    of.modes = modes            # type: ignore[attr-defined]
    return of


#: a time-sliced profile, for a record whose type name does not parse
_TS = VgpuProfile("x", 0, "Q")


def _mixed_fit(host: HostRoot, inv: Inventory, g, name: str, placed: Dict[PciAddress, list],
               gone: Optional[Sequence[VgpuRecord]] = None) -> Optional[int]:
    """:func:`vgpuhost.policy.config.mixed_limit` for GPU ``g`` in mixed-size mode: its vGPUs (its VFs'
    or mdevs') with their placement ids (``nvidia/placement_id``, read once per GPU into ``placed``),
    and the records whose vGPU is missing from it (``gone``; None: read from the store) at the ids
    ``reconcile`` re-creates them at (:func:`vgpuhost.policy.config.mixed_reserved`), less those of
    ``name`` (a missing record is no vGPU present; the caller counts it)."""
    from ..io.sysfs import Sysfs
    from ..io.vgpudev import read_placement
    from ..policy.config import mixed_limit, mixed_reserved
    if g.address not in placed:
        names = {t.type_id: t.name for t in inv.vgpu_types if t.gpu == g.address and t.name}
        here = set(inv.on_gpu(g.address).vgpus) if inv.on_gpu(g.address) is not None else set()
        recs: List[VgpuRecord] = []
        if gone is None or any(v.gpu == g.address and v.type_id is not None and v.type_id not in names
                               for v in inv.vf_vgpus) \
                or any(m.uuid in here and m.type_id not in names for m in inv.mdevs):
            # a type no free VF lists any more (none fits): its name from what the store remembers
            try:
                store = StateStore(host.state_dir, create=False)
                recs = store.vgpu_records(gpu=str(g.address))
                for r in recs:
                    names.setdefault(r.type_id, r.type_name)
                for _g, tid, n, _fb in store.seen_types(gpu=str(g.address)):
                    names.setdefault(str(tid), str(n))
            except VgpuhostError:
                pass
        if gone is None:
            from ..policy.offers import missing_records
            gone = missing_records(inv.on_gpu(g.address), g.address, recs)
        fs = Sysfs(host)
        rows = []
        for v in inv.vf_vgpus:
            if v.gpu == g.address and v.type_id is not None:
                rows.append((names.get(v.type_id, ""), read_placement(fs, Backend.VENDOR_VFIO, v.vf, str(v.vf))))
        for m in inv.mdevs:
            if m.uuid in here:
                rows.append((names.get(m.type_id, ""), read_placement(fs, Backend.MDEV, m.parent, m.uuid)))
        held = [r.type_name for r in gone if not (VgpuProfile.try_parse(r.type_name) or _TS).mig_backed] if gone else []
        reserved = mixed_reserved(g.pci.device, rows, held) if held else []
        placed[g.address] = (rows, reserved)
    rows, reserved = placed[g.address]
    if reserved is None:
        return mixed_limit(g.pci.device, name, rows)
    n = mixed_limit(g.pci.device, name, rows + reserved)
    return None if n is None else n - sum(1 for t, _ in reserved if t.lower() == name.lower())


def _decide(inv: Inventory, records: Sequence[VgpuRecord], seen: list, req: VgpuCreateRequest, name: str,
            pin: Optional[PciAddress], parent: Optional[PciAddress], *, strict: bool,
            limits: Optional[dict] = None, limits_of=None) -> Decision:
    """Where ``name`` goes on this look; RefusedError when nowhere: the reason, each GPU's types
    that still fit, and the GPUs passed through (which list no types, so make no offer)."""
    from ..policy.iommu import VFIO_PCI
    from ..policy.offers import fitting_elsewhere, offers, recorded_vfs
    from ..policy.placement import place
    modes = getattr(limits_of, "modes", None)
    all_offers = _narrow(inv, offers(inv, records, name, seen, limits, modes=modes), name, req.allowed_gpus, req.vf, strict=strict,
                         parent=parent)
    decision = place(all_offers, _placement(req, name, pin))
    if decision.admitted:
        return decision
    # a GPU passed through lists no types (the vGPU manager unregistered it), so it makes no offer:
    # name it rather than leave "no vGPU-capable GPU" unexplained
    offered = {o.gpu for o in all_offers}
    passed = [g.address for g in inv.gpus if g.pci.driver == VFIO_PCI and g.address not in offered
              and (pin is None or g.address == pin)]
    recorded = recorded_vfs(records)
    fit = "; ".join([f"{o.gpu}: {fitting_elsewhere(inv, o.gpu, seen, limits_of, recorded, records, modes)}"
                     for o in all_offers if pin is None or o.gpu == pin] + [f"{a}: none" for a in passed])
    why = decision.reason + ("; passed through (bound to vfio-pci), so carrying no vGPUs: "
                             + ", ".join(map(str, passed)) if passed else "")
    raise RefusedError(f"cannot place {name}: {why}", hint=f"types that still fit: {fit or 'none'}")


def _planned(host: HostRoot, req: VgpuCreateRequest, backend: str, decision: Decision, name: str,
             dry_run: bool) -> VgpuOutcome:
    """The outcome of creating ``name`` where ``decision`` puts it on ``backend``, its steps
    described (what a dry run shows).  Raises InputError for what that backend cannot do:
    --persist of a vendor-VFIO or MIG-backed vGPU, --uuid on vendor VFIO."""
    mig_backed = bool((VgpuProfile.try_parse(name) or VgpuProfile("x", 0, "C")).mig_backed)
    if req.persist and (backend != BACKEND_MDEV or mig_backed):
        raise InputError(
            f"--persist cannot keep a {'MIG-backed' if mig_backed else 'vendor-VFIO'} vGPU across "
            "reboots (mdevctl only defines classic mdevs)",
            hint="create it without --persist and enable the boot unit that runs 'vgpuhost reconcile'")
    if req.uuid is not None and backend != BACKEND_MDEV:
        raise InputError("--uuid applies to mdev vGPUs; on vendor VFIO the vGPU is named by its VF")
    vid = (req.uuid or _new_uuid()) if backend == BACKEND_MDEV else str(decision.parent)
    out = VgpuOutcome("create", changed=True, dry_run=dry_run, id=vid, gpu=str(decision.gpu),
                      parent=str(decision.parent), type_id=decision.type_id, type_name=name,
                      backend=backend, owner=req.owner, reason=decision.reason)
    out.steps = _create_steps(host, backend, decision, vid, req.params, req.persist)
    return out


def _create_locked(fs: Sysfs, store: StateStore, inv: Inventory, seen: list, req: VgpuCreateRequest,
                   out: VgpuOutcome, decision: Decision, parent: Optional[PciAddress],
                   actor: Optional[str], on_record: Optional[OnRecord] = None) -> Optional[VgpuOutcome]:
    """Under the GPU's lock: finish what an interrupted operation left, re-check the placement on a
    fresh read of that GPU alone, and create the vGPU as re-placed (``out`` updated and returned).
    None when recovery changed the host or the choice no longer fits: place again."""
    from ..observe.inventory import discover_gpu
    from ..policy.offers import offers
    from ..policy.placement import Decision, place
    host, name = fs.host, out.type_name
    with file_lock(store.dir, f"gpu-{decision.gpu}"):
        if any(r.result in ("finished", "rolled-back") for r in _recover_first(host, store, decision.gpu, actor)):
            return None         # recovery changed the host: place again on what it left (the reason too)
        # this GPU alone, under its lock: what can change (free instances, vGPUs present) read again; of
        # the mdev types' counts only the wanted type's, all the capacity rule counts for it (an A100's 20
        # VFs list 12 types each: 20 counts instead of 240); the look's counts of the others are not used
        from . import health
        wanted = frozenset({decision.type_id} | {t.type_id for t in inv.types_of(decision.gpu)
                                                 if t.name.lower() == name.lower()})
        inv2 = health.in_service(discover_gpu(fs, decision.gpu, host_facts=False, known=inv, only=wanted), store,
                                 owner=req.owner)
        records2 = store.vgpu_records(gpu=str(decision.gpu))
        limits_of2 = limits_lookup(host, inv2, records2)
        limits = {} if req.vf is not None else limits_of2(name)
        again = place(_narrow(inv2, offers(inv2, records2, name, seen, limits, modes=limits_of2.modes), name, req.allowed_gpus, req.vf,
                              parent=parent), _placement(req, name, decision.gpu))
        if not again.admitted:
            return None         # someone took it between placement and the lock: place again
        decision = Decision(again.gpu, again.parent, again.type_id, decision.reason)
        vid = out.id if out.backend == BACKEND_MDEV else str(decision.parent)
        # the id the record will have (an mdev's UUID, a VF) is no other record's, before anything is written
        _refuse_recorded(fs, store, vid, actor=actor or actor_name(), operation=f"vgpu create {name} owner={req.owner}")
        out.steps = _create_steps(host, out.backend, decision, vid, req.params, req.persist)   # as re-placed
        out.id, out.parent, out.type_id = vid, str(decision.parent), decision.type_id
        _execute_create(host, store, inv2, records2, req, out, decision, actor, on_record)
        return out


def _refuse_unsupported_params(fs: Sysfs, backend: str, parent, vid: str, params: Optional[str]) -> None:
    """RefusedError (nothing changed) when ``params`` are asked for and the device has no
    ``nvidia/vgpu_params``: a vendor-VFIO VF's ``nvidia/`` may lack it (docs/reference/hardware.md#vendor-vfio)."""
    if params and not for_backend(backend).params_supported(fs, parent, vid):
        raise RefusedError(f"vgpu_params are not supported here: VF {parent} has no nvidia/vgpu_params "
                           "(NVIDIA's vendor-specific VFIO driver defines none)", hint="create it without --params")


def _execute_create(host: HostRoot, store: StateStore, inv: Inventory, records: Sequence[VgpuRecord],
                    req: VgpuCreateRequest, out: VgpuOutcome, decision: Decision, actor: Optional[str],
                    on_record: Optional[OnRecord] = None) -> None:
    """Create vGPU ``out`` as ``decision`` places it (its GPU's lock held): the decision audited,
    the writes journalled, then the record written (``on_record`` called in its transaction) and,
    with ``persist``, the mdevctl definition;
    ``out.writes`` counts the writes.  Raises DeviceError when the kernel or the definition's
    write fails (the vGPU removed again)."""
    backend, vid, name = out.backend, out.id, out.type_name
    _refuse_unsupported_params(Sysfs(host), backend, decision.parent, vid, req.params)
    ex = Executor(host, store, actor=actor or actor_name(), operation=f"vgpu create {name} owner={req.owner}")
    # the decision goes in the audit log beside the writes it led to
    store.audit(actor=ex.actor, operation=ex.operation, path="(placement)", value=decision.reason)
    ex.journal = Journal.start(store, kind="vgpu-create", operation=ex.operation, owner=req.owner,
                               actor=ex.actor, gpu=str(decision.gpu), group=None, steps=out.steps,
                               devices=[_journal_device(vid, backend, decision.gpu, decision.parent,
                                                        decision.type_id, name, req.persist, "creating")])
    with ex.journal:
        _do_create(ex, inv, records, backend, decision, vid, name, req.params, limits_lookup(host, inv, records))
        try:
            rec = VgpuRecord(vid, backend, str(decision.gpu), str(decision.parent), decision.type_id, name,
                             req.owner, req.anti_affinity, req.params, req.persist, utcnow())
            with store.transaction() as conn:
                put_vgpu(conn, rec)
                if on_record is not None:
                    on_record(conn, rec)
        except VgpuRecordTaken:
            _undo_taken(ex, store, backend, decision, vid)
        if req.persist:
            _persist(host, store, ex, backend, decision, vid, req.params)
        out.writes = ex.writes


def _refuse_recorded(fs: Sysfs, store: StateStore, vid: str, *, actor: Optional[str] = None,
                     operation: Optional[str] = None) -> None:
    """Refuse (nothing written) a new vGPU whose id ``vid`` (an mdev UUID, a VF on vendor VFIO) a
    record holds: one present on the host already exists (InputError, "already exists"); one missing
    from the host (lost at a reboot, a remove that failed) is kept for ``vgpuhost reconcile`` to make
    again there, and a new device under its id would be adopted by the old record (RefusedError
    naming its owner and the fix).  With ``actor`` and ``operation`` (not on a dry run) the refusal
    gets a ``(placement)`` audit row, result ``refused``."""
    rec = next(iter(store.vgpu_records(vgpu_id=vid)), None)
    if rec is None:
        return
    present = for_backend(rec.backend).current_type(fs, PciAddress.parse(rec.parent), rec.id) is not None
    if present:
        err: VgpuhostError = InputError(f"vGPU {vid} already exists (owner {rec.owner})", hint="'vgpuhost vgpu list'")
    else:
        err = RefusedError(_missing_line(rec), hint=_missing_fix(rec))
    if actor is not None and operation is not None:
        store.audit(actor=actor, operation=operation, path="(placement)", value=err.message, result="refused")
    raise err


def _missing_line(rec: VgpuRecord) -> str:
    """The refusal's line for a new vGPU under the id of ``rec``, a record whose device is missing."""
    what = f"VF {rec.id}" if rec.backend == BACKEND_VENDOR_VFIO else f"vGPU {rec.id}"
    return (f"{what} is recorded for {rec.type_name} of owner {rec.owner}, missing from the host: kept for "
            "'vgpuhost reconcile' to re-create, not made anew")


def _missing_fix(rec: VgpuRecord) -> str:
    """The hint of :func:`_missing_line`: re-create it, or drop the record."""
    return (f"run 'vgpuhost reconcile' to re-create it, or drop the record with 'vgpuhost vgpu remove {rec.id} "
            f"--owner {rec.owner}'{'' if rec.backend == BACKEND_VENDOR_VFIO else '; or omit --uuid for a new one'}"
            "; nothing was changed")


def _undo_taken(ex: Executor, store: StateStore, backend: str, decision: Decision, vid: str) -> None:
    """The new device ``vid`` was made but its record could not be written: another record holds the
    id (:class:`vgpuhost.io.state.VgpuRecordTaken`).  Remove the device again (the Executor's undo,
    audited) and raise RefusedError naming the record's owner; DeviceError when the removal fails
    (the device is then left on the host, unrecorded, and the line says so)."""
    rec = next(iter(store.vgpu_records(vgpu_id=vid)), None)
    held = (f"{rec.type_name} of owner {rec.owner}" if rec is not None else "another record")
    try:
        ex.run([RemoveVgpu(backend, decision.parent, vid)])
    except SysfsError as e:
        raise DeviceError(f"vGPU {vid} was made but its id is recorded for {held}; removing it again failed: "
                          f"{e.errno_name}, so it is on the host unrecorded",
                          hint=f"remove it by hand ({ex.host.relative(e.path)}), then 'vgpuhost reconcile'") from e
    fix = _missing_fix(rec).replace("; nothing was changed", "") if rec is not None else "try again"
    raise RefusedError(f"vGPU {vid} is recorded for {held} (recorded meanwhile): the new device was removed again",
                       hint=fix)


def _persist(host: HostRoot, store: StateStore, ex: Executor, backend: str, decision: Decision, vid: str,
             params: Optional[str]) -> None:
    """Write mdevctl's definition of the new mdev ``vid``; when that fails, remove the vGPU and its
    record again and raise DeviceError naming the file."""
    try:
        from ..io.configfiles import mdevctl_json
        ex.run([WriteConfig(host.mdevctl_d / str(decision.parent) / vid,
                            mdevctl_json(decision.type_id, mdevctl_attrs(params)))])
    except SysfsError as e:
        ex.run([RemoveVgpu(backend, decision.parent, vid)])
        with store.transaction() as conn:
            delete_vgpu(conn, vid)
        raise DeviceError(f"--persist could not write {host.relative(e.path)}: {e.errno_name}; "
                          f"the vGPU {vid} was removed again",
                          hint=f"make {host.relative(host.mdevctl_d)} writable, or create "
                               "without --persist") from e


def _new_uuid() -> str:
    import uuid       # lazily: the qemu hook always passes the domain's UUID
    return str(uuid.uuid4())


def _physfn(fs: Sysfs, vf: PciAddress) -> Optional[PciAddress]:
    """The physical function ``vf``'s ``physfn`` link names; None when it has none (not a VF: the
    whole-host read then says why)."""
    name = fs.link_name(os.path.join(fs.host.s.pci_device(vf), "physfn"))
    return PciAddress.parse(name) if name and PciAddress.is_valid(name) else None


def _vf_gpu(inv: Inventory, vf: PciAddress, gpu: Optional[PciAddress]) -> PciAddress:
    """The physical GPU of ``vf``, a VF on NVIDIA's vendor-specific VFIO path; raises otherwise."""
    dev = inv.devices.get(vf)
    if dev is None:
        raise InputError(f"no PCI device at {vf}", hint="'vgpuhost gpus' lists the GPUs and their VFs")
    g = inv.gpu(dev.physfn) if dev.physfn is not None else None
    if g is None:
        raise RefusedError(f"{vf} is not an SR-IOV VF of an NVIDIA GPU ({dev.class_name}): left alone",
                           hint="a vendor-VFIO vGPU is named by a VF of an NVIDIA GPU ('vgpuhost gpus')")
    if g.vgpu_backend != BACKEND_VENDOR_VFIO:
        raise RefusedError(f"VF {vf} of {g.address} is on the {g.vgpu_backend or 'no vGPU'} path, not "
                           "vendor-specific VFIO", hint="on the classic mdev path a vGPU is named by an mdev "
                                                        "UUID, not a VF")
    if gpu is not None and gpu != g.address:
        raise InputError(f"VF {vf} belongs to {g.address}, not {gpu}")
    return g.address


def _vf_held(fs: Sysfs, records: Sequence[VgpuRecord], vf: PciAddress, owner: str, profile: str,
             dry_run: bool) -> Optional[VgpuOutcome]:
    """An outcome (no change) when ``owner`` already holds ``vf`` with ``profile``; raises RefusedError
    (nothing written) when another owner's record holds it, or a record whose vGPU is missing from the
    host (kept for ``vgpuhost reconcile``: the line names its owner and the fix)."""
    rec = next((r for r in records if r.id == str(vf)), None)
    if rec is None:
        return None
    current = for_backend(rec.backend).current_type(fs, PciAddress.parse(rec.parent), rec.id)
    if current is None:                 # missing from the host: reconcile's to make again, for its owner
        raise RefusedError(_missing_line(rec), hint=_missing_fix(rec))
    if rec.owner != owner:
        raise RefusedError(f"VF {vf} holds {rec.type_name} of {rec.owner}: left alone",
                           hint="another owner holds this VF; choose a free one ('vgpuhost vgpu list')")
    if rec.type_name.lower() != profile.strip().lower():
        raise RefusedError(f"VF {vf} already holds {rec.type_name} of {owner}, not {profile}",
                           hint=f"remove it first (vgpuhost vgpu remove {vf} --owner {owner})")
    if current != rec.type_id:
        raise RefusedError(f"VF {vf} is recorded for {owner} with {rec.type_name} but holds type {current} now",
                           hint=f"drop the stale record: vgpuhost vgpu remove {vf} --owner {owner}")
    out = VgpuOutcome("create", changed=False, dry_run=dry_run, id=rec.id, gpu=rec.gpu, parent=rec.parent,
                      type_id=rec.type_id, type_name=rec.type_name, backend=rec.backend, owner=owner,
                      reason=f"{owner} already holds {rec.type_name} on {vf}")
    out.notes.append(f"VF {vf} already holds {rec.type_name} for {owner}: nothing to do")
    return out


def _narrow(inv: Inventory, all_offers: List[GpuOffer], name: str, allowed: Optional[frozenset],
            vf: Optional[PciAddress], *, strict: bool = True, parent: Optional[PciAddress] = None) -> List[GpuOffer]:
    """Offers restricted to ``allowed`` GPUs, and with ``vf`` to that VF alone; with ``parent``
    (an mdevctl definition's) to that mdev parent alone.

    ``strict`` (under the GPU lock, or a dry run): refuse a VF that is taken
    or does not list ``name`` as creatable now.  Not strict (the first look,
    without the lock): only pin the offer to the VF, and let the check under
    the lock decide, so a VF's state read while another process changes the
    GPU never refuses a request that would fit.
    """
    if allowed is not None:
        all_offers = [o for o in all_offers if o.gpu in allowed]
    if parent is not None:
        taken = f"its mdevctl definition names parent {parent}, which has no free instance"
        all_offers = [replace(o, parents=(parent,)) if parent in o.parents else
                      replace(o, available=0, parents=(), note=taken if o.type_id else o.note)
                      for o in all_offers]
    if vf is None:
        return all_offers
    if not strict:
        gpu = inv.devices[vf].physfn
        serving = inv.gpu(gpu) is not None and inv.gpu(gpu).pci.driver == "nvidia"
        return [(replace(o, parents=(vf,), available=max(o.available, 1)) if serving else o)
                if o.gpu == gpu and o.type_id else
                replace(o, available=0, parents=(), note=f"the request names VF {vf}") for o in all_offers]
    v = next((x for x in inv.vf_vgpus if x.vf == vf), None)
    if v is None:
        raise RefusedError(f"VF {vf} has no nvidia/ directory: the vGPU manager does not serve it",
                           hint="check nvidia-vgpu-mgr and that the VF is bound to nvidia")
    if v.type_id:
        raise RefusedError(f"VF {vf} already holds vGPU type {v.type_id}, not created for this request",
                           hint="choose a free VF ('vgpuhost vgpu list' shows who holds which)")
    offered = [t.name for t in inv.vgpu_types if t.parent == vf]
    if not any(n.lower() == name.lower() for n in offered):
        raise RefusedError(f"VF {vf} does not offer {name} now (creatable: {', '.join(offered) or 'none'})",
                           hint="the GPU is full or holds vGPUs of another size (equal-size mode)")
    here = next((o for o in all_offers if o.gpu == v.gpu and o.type_id), None)
    held = sorted(str(r) for r in inv.reserved if inv.devices[r].physfn == v.gpu) if inv.reserved else []
    if here is not None and here.available < 1 and held:
        # the driver still lists the type on this VF, but the GPU's last slot of it is promised to an
        # incoming live migration (trial 5 retest N1: placed again and again, "the host kept changing")
        raise RefusedError(f"VF {vf}: {v.gpu}'s {name} slots are reserved for other incoming migrations "
                           f"(VF {', '.join(held)})",
                           hint="start the domain once that migration ended or on another GPU; "
                                "'vgpuhost reconcile' frees an expired reservation; nothing was changed")
    return [replace(o, parents=(vf,)) if o.gpu == v.gpu else replace(o, available=0, parents=(),
                                                                      note=f"the request names VF {vf}")
            for o in all_offers]


def mdevctl_definition(host: HostRoot, fs: Sysfs, uuid: str) -> Optional[Tuple[PciAddress, str, str, tuple]]:
    """``(parent, mdev type id, path under the root, attrs)`` of mdevctl's definition for ``uuid``
    (``etc/mdevctl.d/<parent>/<uuid>``, docs/reference/hardware.md#mdev), or None when there is none.
    ``attrs``: its ``attrs`` as ``((attribute, value), ...)`` in order (mdevctl writes each value to
    the mdev's sysfs attribute of that relative path after creating it).

    Raises InputError when a definition is there but is not one mdevctl wrote (not JSON, no
    ``mdev_type``, a parent directory that is not a PCI address, ``attrs`` that are not a list
    of one-entry ``{attribute: value}`` objects); the message names the file and the position,
    never its content.
    """
    for parent_name in fs.listdir(host.s.mdevctl_d):
        path = os.path.join(host.s.mdevctl_d, parent_name, uuid)
        if not fs.exists(path):
            continue
        import json         # only here: the hook's path imports no json when nothing is defined
        from ..io.files import read_text_capped
        where = host.relative(path)
        if not PciAddress.is_valid(parent_name):
            raise InputError(f"mdevctl definition {where}: its directory is not a parent device's PCI address",
                             hint=f"remove it (mdevctl undefine --uuid {uuid}) or move it where it belongs")
        try:
            text = read_text_capped(path, 64 * 1024)
            doc = json.loads(text or "")
        except json.JSONDecodeError as e:
            raise InputError(f"mdevctl definition {where} is not valid JSON (line {e.lineno}, column {e.colno})",
                             hint=f"fix it, or remove it: mdevctl undefine --uuid {uuid}") from None
        except (OSError, UnicodeDecodeError):
            raise InputError(f"mdevctl definition {where} cannot be read as text",
                             hint=f"fix it, or remove it: mdevctl undefine --uuid {uuid}") from None
        type_id = doc.get("mdev_type") if isinstance(doc, dict) else None
        import re       # here: only with an mdevctl definition to read
        if not isinstance(type_id, str) or not re.match(r"[A-Za-z0-9_.-]{1,64}\Z", type_id):
            raise InputError(f"mdevctl definition {where} names no valid mdev_type",
                             hint=f"fix it, or remove it: mdevctl undefine --uuid {uuid}")
        attrs = doc.get("attrs") or []
        bad = None if isinstance(attrs, list) else "its attrs are not a list"
        for i, a in enumerate(attrs if bad is None else []):
            if not (isinstance(a, dict) and len(a) == 1
                    and all(isinstance(k, str) and isinstance(v, str) for k, v in a.items())):
                bad = f"its attrs entry {i} is not one {{attribute: value}} pair of strings"
                break
        if bad is not None:
            raise InputError(f"mdevctl definition {where}: {bad}",
                             hint=f"fix it, or remove it: mdevctl undefine --uuid {uuid}")
        return PciAddress.parse(parent_name), type_id, where, tuple(next(iter(a.items())) for a in attrs)
    return None


def _definition_params(defined: tuple, uuid: str, params: Optional[str]) -> Optional[str]:
    """The vgpu_params to create ``uuid`` with: those of its mdevctl definition's attrs (issue 12 #4l:
    they were ignored), which must agree with ``params`` when both are given.

    Raises RefusedError naming the definition and the attrs entry when an attribute is not
    ``nvidia/vgpu_params`` (vgpuhost applies no other), its value is not ``key=value`` pairs, or
    it disagrees with ``params``; nothing has been changed then.
    """
    where, attrs = defined[2], defined[3]
    fix = (f"remove that entry from the definition (mdevctl modify --uuid {uuid} --delattr --index N) or "
           f"the definition itself (mdevctl undefine --uuid {uuid}); nothing was changed")
    out = params
    for i, (attr, value) in enumerate(attrs):
        if attr != MDEVCTL_PARAMS_ATTR:
            import re   # here: only with an mdevctl definition that sets another attribute
            shown = f"{attr!r} " if re.match(r"[A-Za-z0-9_./-]{1,64}\Z", attr) else ""
            raise RefusedError(f"mdevctl definition {where} sets the attribute {shown}(attrs entry {i}), which "
                               f"vgpuhost does not apply: it applies {MDEVCTL_PARAMS_ATTR} only", hint=fix)
        try:
            _validate_params(value)
        except InputError:
            raise RefusedError(f"mdevctl definition {where}: its {MDEVCTL_PARAMS_ATTR} (attrs entry {i}) is not a "
                               "list of key=value pairs", hint=fix) from None
        if out is not None and out != value:
            raise RefusedError(f"mdevctl definition {where} sets {MDEVCTL_PARAMS_ATTR} to {value!r}, but "
                               f"{out!r} is asked for", hint="make them agree, or " + fix)
        out = value
    return out


def _respect_definition(inv: Inventory, defined: Tuple[PciAddress, str, str], uuid: str, name: str,
                        pin: Optional[PciAddress]) -> PciAddress:
    """The GPU of an mdevctl definition that agrees with the request (``name`` on that parent);
    RefusedError naming the definition and what disagrees otherwise (issue 12 #4l)."""
    parent, type_id, where = defined[:3]
    fix = (f"make the domain ask for what the definition says, or remove the definition "
           f"(mdevctl undefine --uuid {uuid}); nothing was changed")
    g = next((x for x in inv.gpus if parent in x.mdev_parents), None)
    if g is None:
        raise RefusedError(f"mdevctl definition {where} defines {uuid} on {parent}, which is not an mdev "
                           "parent of an NVIDIA GPU on this host", hint=fix)
    if pin is not None and pin != g.address:
        raise RefusedError(f"mdevctl definition {where} defines {uuid} on {parent} (GPU {g.address}), but the "
                           f"request pins GPU {pin}", hint=fix)
    t = next((t for t in inv.vgpu_types if t.parent == parent and t.type_id == type_id), None)
    if t is None:
        raise RefusedError(f"mdevctl definition {where} defines {uuid} as type {type_id}, which {parent} "
                           "does not offer", hint=fix)
    if t.name.lower() != name.lower():
        raise RefusedError(f"mdevctl definition {where} defines {uuid} as {t.name} ({type_id}) on {parent}, "
                           f"but {name} is asked for", hint=fix)
    return g.address


def _offered_now(inv: Inventory, profile: str, gpu: Optional[PciAddress]) -> bool:
    want = profile.strip().lower()
    return any(t.available_instances > 0 for t in inv.vgpu_types
               if t.name.lower() == want and (gpu is None or t.gpu == gpu))


def _gi_profile_for(profiles, wanted: VgpuProfile):
    """The device's GI profile a MIG-backed type sits on: same slices, GB and suffix (docs/reference/hardware.md#vgpu-types, #mig-profiles)."""
    from ..model.values import MigProfile
    for p in profiles:
        try:
            mp = MigProfile.parse(p.name)
        except InputError:
            continue
        if mp.slices == wanted.gi_slices and mp.memory_gb == wanted.framebuffer_gb and mp.suffix == wanted.gi_suffix:
            return p
    return None


def _mig_candidates(host: HostRoot, inv: Inventory, wanted: VgpuProfile, gpu: Optional[PciAddress]):
    """``[(gpu, backend, gi profile or None, (current, pending) or None)]`` for GPUs of the type's board."""
    from ..io.backends import open_backend
    backend = open_backend(host)
    out = []
    for g in inv.gpus:
        if gpu is not None and g.address != gpu:
            continue
        if g.board is not None and g.board != wanted.board:
            continue
        try:
            mode = backend.mig_mode(g.address)
            gi = _gi_profile_for(backend.gi_profiles(g.address), wanted) if mode else None
        except VgpuhostError:
            mode, gi = None, None
        out.append((g, backend, gi, mode))
    return out


def _create_gpu_instance(host: HostRoot, store: StateStore, inv: Inventory, wanted: VgpuProfile,
                         gpu: Optional[PciAddress], actor: Optional[str]) -> None:
    """Add one GPU instance for ``wanted`` on the first GPU where MIG mode is on and it fits."""
    from . import mig
    from ..policy.mig import resolve_layout, why_not
    reasons = []
    for g, backend, gi, mode in _mig_candidates(host, inv, wanted, gpu):
        lacking = _type_missing(inv, g, wanted)
        if lacking:
            reasons.append(lacking)
            continue
        if not mode or not mode[0]:
            reasons.append(f"{g.address}: MIG mode is off")
            continue
        if gi is None:
            reasons.append(f"{g.address}: no GPU-instance profile for {wanted}")
            continue
        profiles = backend.gi_profiles(g.address)
        by_id = {p.profile_id: p for p in profiles}
        counts: Dict[str, int] = {}
        for inst in backend.gpu_instances(g.address):
            n = by_id[inst.profile_id].name if inst.profile_id in by_id else str(inst.profile_id)
            counts[n] = counts.get(n, 0) + 1
        counts[gi.name] = counts.get(gi.name, 0) + 1
        wanted_ids = resolve_layout(profiles, counts, where=str(g.address))
        why = why_not(profiles, wanted_ids)
        if why:
            reasons.append(f"{g.address}: another {gi.name} does not fit ({why})")
            continue
        mig.apply(host, store, g.address, counts, backend=backend, actor=actor)
        return
    raise RefusedError(f"cannot create a GPU instance for {wanted}: " + ("; ".join(reasons) or _no_board(inv, wanted, gpu)),
                       hint=f"order: {_mig_order()}")


def _refuse_mig_order(host: HostRoot, inv: Inventory, wanted: VgpuProfile, profile: str,
                      gpu: Optional[PciAddress], create_gi: bool, dry_run: bool) -> None:
    """Refuse a MIG-backed request no GPU can take now, naming the missing step per GPU."""
    steps = []
    try:
        cands = _mig_candidates(host, inv, wanted, gpu)
    except VgpuhostError:
        cands = []
    for g, backend, gi, mode in cands:
        lacking = _type_missing(inv, g, wanted)
        if lacking:
            steps.append(lacking)
        elif g.vfs == () and g.vgpu_backend is None:
            steps.append(f"{g.address}: no vGPU backend (enable SR-IOV VFs: sriov-manage -e {g.address})")
        elif not mode or not mode[0]:
            steps.append(f"{g.address}: enable MIG mode (vgpuhost mig enable --gpu {g.address})"
                         + (", pending a GPU reset" if mode and mode[1] else ""))
        elif gi is None:
            steps.append(f"{g.address}: the device has no GPU-instance profile for {wanted}")
        else:
            steps.append(f"{g.address}: create a {gi.name} GPU instance (vgpuhost mig apply --gpu "
                         f"{g.address} ..., or --create-gi)")
    if dry_run and create_gi:
        steps.append("a dry run does not create GPU instances")
    raise RefusedError(f"no GPU offers a free {profile} (MIG-backed) now: " + ("; ".join(steps) or
                       _no_board(inv, wanted, gpu)),
                       hint=f"order: {_mig_order()}")


def _type_missing(inv: Inventory, g, wanted: VgpuProfile) -> Optional[str]:
    """Why GPU ``g`` of ``wanted``'s board will never offer ``wanted``: on the classic mdev path the
    driver lists every type it has under ``mdev_supported_types`` (0 available when none fits,
    docs/reference/hardware.md#mdev), so a GPU that lists types but none of this name has a driver
    without it.  None when it lists it, lists nothing (vendor VFIO lists only what is creatable
    now), or is of another board."""
    ix = inv.on_gpu(g.address)
    if ix is None or g.vgpu_backend != Backend.MDEV or not ix.types:
        return None
    want = str(wanted).lower()
    if any(t.name.lower() == want for t in ix.types):
        return None
    return (f"GPU {g.address} has board {g.board or wanted.board} but its driver offers no {wanted} type "
            "(its mdev types list none of that name: this driver release does not have it; "
            f"'vgpuhost types' lists what it offers)")


def _no_board(inv: Inventory, wanted: VgpuProfile, gpu: Optional[PciAddress]) -> str:
    """The reason when no GPU is a candidate for ``wanted``: no GPU there, or none of its board."""
    others = [g for g in inv.gpus if gpu is None or g.address == gpu]
    if not others:
        return f"no NVIDIA GPU at {gpu}" if gpu is not None else "no NVIDIA GPU on this host"
    return f"no GPU of board {wanted.board} (" + ", ".join(f"{g.address} is {g.board or g.model}"
                                                          for g in others[:4]) + ")"


def _mig_order() -> str:
    from ..policy.mig import ORDER
    return ORDER


def _create_plan(backend: str, d: Decision, vid: str, name: str, params: Optional[str],
                 placement: Optional[int] = None) -> List[Step]:
    """The sysfs steps that create one vGPU (its placement id first where one is chosen, and its
    ``vgpu_params``)."""
    steps: List[Step] = [SetPlacement(backend, d.parent, vid, placement)] if placement is not None else []
    steps.append(CreateVgpu(backend, d.parent, d.type_id, vid, name))
    if params:
        steps.append(SetVgpuParams(backend, d.parent, d.type_id, vid, params))
    return steps


def _create_steps(host: HostRoot, backend: str, d: Decision, vid: str, params: Optional[str],
                  persist: bool) -> List[str]:
    steps = describe(host, _create_plan(backend, d, vid, "", params))
    if persist:
        steps.append(f"write mdevctl definition {host.relative(host.mdevctl_d / str(d.parent) / vid)}")
    return steps


def _do_create(ex: Executor, inv: Inventory, records: Sequence[VgpuRecord], backend: str, d: Decision,
               vid: str, name: str, params: Optional[str], limits_of=None) -> None:
    """Create, read back (never report success for a device that does not exist), set params;
    a failure after the create removes the vGPU again (the Executor's undo)."""
    placement = _placement_for(ex.host, inv, backend, d, name, records, vid, limits_of)
    try:
        ex.run(_create_plan(backend, d, vid, name, params, placement))
    except SysfsError as e:
        if isinstance(ex.failed, (CreateVgpu, SetPlacement)):
            failed = gpu_failed(e, d.gpu, f"creating {name}")
            if failed is not None:                  # the GPU failed, not the request (docs/guide/failures.md)
                raise failed from e
            if e.errno == errno.ENOSPC:
                # what still fits there, from every type's count now (the check under the lock read the
                # wanted type's alone: discover_gpu's ``only``)
                from ..observe.inventory import discover_gpu
                try:
                    inv = discover_gpu(Sysfs(ex.host), d.gpu, host_facts=False)
                except SysfsError:
                    pass
            raise DeviceError(_explain(e, inv, records, d, name, limits_of), hint="see 'vgpuhost audit'") from e
        raise DeviceError(f"setting vgpu_params {params!r} on {vid} failed: {e.errno_name}; "
                          "the vGPU was removed again", hint="check the parameter names") from e


def gpu_failed(e: SysfsError, gpu: "Union[PciAddress, str]", what: str) -> Optional[GpuFailedError]:
    """The GpuFailedError (``what on GPU failed: EIO``) when the device write ``e`` on ``gpu`` failed in a
    way that means the GPU itself failed (:func:`vgpuhost.policy.health.write_failure`: EIO, ENODEV),
    None for a refusal of the request.  The one classification of every vGPU write: a create
    (:func:`create_vgpu`), a recorded vGPU made again (:func:`recreate_recorded`: a layout's re-create,
    :func:`reconcile`)."""
    from ..policy.health import write_failure
    if write_failure(e.errno, None) is None:
        return None
    return GpuFailedError(f"{what} on {gpu} failed: {e.errno_name}", gpu=str(gpu), errno=e.errno,
                          hint="see 'vgpuhost audit'")


def recreate_recorded(host: HostRoot, store: StateStore, rec: VgpuRecord, *, actor: str, operation: str) -> bool:
    """Make the recorded vGPU ``rec`` again with its own id, type and parameters, under its GPU's lock: what
    a layout's re-create step and :func:`reconcile` do for a record whose device is missing.  The record
    stays whatever happens (a failed try leaves it missing, and the next apply or reconcile tries the same
    id again); a half-made vGPU is reported, not removed.  False when the device reads back already (it
    came back meanwhile), True when it was made.  Raises GpuFailedError after recording the GPU unhealthy
    (:func:`vgpuhost.ops.health.mark_unhealthy`, source ``io``) when the create failed with EIO/ENODEV
    (:func:`gpu_failed`), DeviceError when the kernel refused otherwise or the device does not read back."""
    parent = PciAddress.parse(rec.parent)
    backend = for_backend(rec.backend)
    with file_lock(store.dir, f"gpu-{rec.gpu}"):
        ex = Executor(host, store, actor=actor, operation=operation)
        if backend.current_type(ex.fs, parent, rec.id) == rec.type_id:
            return False
        steps: List[Step] = [CreateVgpu(rec.backend, parent, rec.type_id, rec.id, rec.type_name)]
        if rec.params and backend.params_supported(ex.fs, parent, rec.id):
            steps.append(SetVgpuParams(rec.backend, parent, rec.type_id, rec.id, rec.params))
        # (no vgpu_params on this VF: not supported here, the vGPU is made without them)
        try:
            ex.run(steps, undo=False)
        except SysfsError as e:
            what = f"re-creating {rec.type_name} {rec.id}"
            failed = gpu_failed(e, rec.gpu, what) if isinstance(ex.failed, CreateVgpu) else None
            if failed is not None:
                from . import health
                from ..policy.health import Source
                health.mark_unhealthy(store, PciAddress.parse(rec.gpu), failed.message, Source.IO, actor=actor,
                                      operation=operation)
                failed.message += " (the GPU is marked unhealthy and left out of placement)"
                raise failed from e
            raise DeviceError(f"{what} on {rec.parent} failed: {e.errno_name}",
                              hint="the record stays: the next apply (or 'vgpuhost reconcile') tries again") from e
    return True


def _placement_for(host: HostRoot, inv: Inventory, backend: str, d: Decision, name: str,
                   records: Sequence[VgpuRecord] = (), vid: str = "", limits_of=None) -> Optional[int]:
    """The placement id vgpuhost chooses for ``name`` on vendor-VFIO GPU ``d.gpu`` in mixed-size mode:
    the best-fit free one (:func:`vgpuhost.policy.config.mixed_best_id`, from the VFs' placement ids),
    the ids of ``records`` whose vGPU is missing from the GPU (but ``vid``'s own, the one made now)
    kept for ``reconcile`` (trial 8 retest R4).  None (the driver places it) on classic mdev (the mdev
    does not exist before the create), on a GPU whose vGPUs have no placement id (equal-size mode, or
    none there yet and no missing record kept on a GPU ``limits_of.modes()`` says is in mixed-size
    mode: the first goes where the driver puts it), and where the catalog cannot say.  Lean: the
    catalog and the model are loaded only for a GPU whose vGPUs have placement ids (the hook's path,
    issue 17)."""
    if backend != Backend.VENDOR_VFIO:
        return None
    g = next((g for g in inv.gpus if g.address == d.gpu), None)
    if g is None:
        return None
    from ..io.vgpudev import read_placement
    fs = Sysfs(host)
    from ..policy.offers import missing_records
    gone = [r for r in missing_records(inv.on_gpu(g.address), g.address, records) if r.id != vid]
    if not any(read_placement(fs, Backend.VENDOR_VFIO, v.vf, str(v.vf)) is not None
               for v in inv.vf_vgpus if v.gpu == g.address and v.type_id is not None):
        modes = getattr(limits_of, "modes", None)
        if not gone or modes is None or not modes().get(g.address):
            return None
    from ..policy.config import mixed_best_id
    placed: Dict[PciAddress, list] = {}
    if _mixed_fit(host, inv, g, name, placed, gone) is None:
        return None
    rows, reserved = placed[g.address]
    # a record whose vGPU is missing keeps its placement id for 'reconcile' (trial 8 retest R4)
    return mixed_best_id(g.pci.device, name, rows + (reserved or []))


def _explain(e: SysfsError, inv: Inventory, records: Sequence[VgpuRecord], d: Decision, name: str,
             limits_of=None) -> str:
    from ..policy.offers import fitting_elsewhere, recorded_vfs
    if e.errno == errno.ENOSPC:
        fit = fitting_elsewhere(inv, d.gpu, limits_of=limits_of, recorded=recorded_vfs(records), records=records)
        return f"no {name} instance left on {d.gpu} (ENOSPC); types that still fit there: {fit}"
    if e.errno == errno.EPERM:
        rec = next((r for r in records if r.parent == str(d.parent)), None)
        held = next((v.type_id for v in inv.vf_vgpus if v.vf == d.parent and v.type_id), None)
        who = (f"vGPU {rec.id} of {rec.owner}" if rec else
               f"a vGPU of type {held} not created by vgpuhost" if held else "another writer")
        return f"VF {d.parent} is taken by {who} (EPERM on current_vgpu_type)"
    if e.errno == errno.EINVAL:
        return f"{name} (type {d.type_id}) is not supported on {d.gpu} in its current mode (EINVAL)"
    if e.errno == errno.EEXIST:
        return f"an mdev with UUID {e.value} already exists (EEXIST)"
    return f"creating {name} on {d.parent} failed: {e.errno_name} writing {e.value!r} to {e.path}"


# ---------------------------------------------------------------------------
# remove

def remove(host: HostRoot, store: StateStore, vgpu_id: str, *, owner: Optional[str] = None,
           dry_run: bool = False, actor: Optional[str] = None, while_running: bool = False) -> VgpuOutcome:
    """Remove a vGPU vgpuhost created (``vgpu_id``: mdev UUID or VF BDF).

    With ``owner``, only while that owner still holds it.  A vGPU of a
    running domain (started through the hook, not yet released) is refused,
    with or without ``owner``, unless ``while_running`` (the hook's release
    and undo, and detach, which take it from the domain first).  Raises
    RefusedError for a device vgpuhost did not create, that another owner
    holds now, or that a running domain uses; InputError for an unknown id.
    A removal of it left pending (an open ``vgpu-remove`` journal entry: its write blocked by a holder)
    is that entry's to end, never a second entry's: the GPU's recovery finishes it once the device is
    closed (``out.notes`` says so), else DeviceError (exit 3) names the entry and why it is still pending.
    """
    vid = _normalise_id(vgpu_id)
    if owner is not None:
        owner = validate_owner(owner)
    fs = Sysfs(host)
    rec = next(iter(store.vgpu_records(vgpu_id=vid)), None)
    if rec is None:
        if vgpu_exists(fs, vid):
            raise RefusedError(f"vGPU {vid} was not created by vgpuhost: left alone",
                               hint="remove it with the tool that made it (mdevctl stop, or echo 1 > remove)")
        raise InputError(f"no vGPU {vid}", hint="'vgpuhost vgpu list' shows the vGPUs")
    if owner is not None and rec.owner != owner:
        raise RefusedError(f"vGPU {vid} now belongs to {rec.owner}, not {owner}: left alone",
                           hint="a late release for an earlier owner never removes the next owner's vGPU")
    if not while_running:
        running = store.active_domains()
        if rec.owner in running:
            raise RefusedError(f"vGPU {vid} is in use by running domain {running[rec.owner]} ({rec.owner}): "
                               "left alone", hint="stop the domain first; its qemu hook removes the vGPU when "
                                                  "it stops (or 'vgpuhost detach DOMAIN ID' takes it back)")
    gpu = PciAddress.parse(rec.gpu)
    parent = PciAddress.parse(rec.parent)
    out = VgpuOutcome("remove", changed=True, dry_run=dry_run, id=vid, gpu=rec.gpu, parent=rec.parent,
                      type_id=rec.type_id, type_name=rec.type_name, backend=rec.backend, owner=rec.owner)
    with file_lock(store.dir, f"gpu-{gpu}") if not dry_run else _nolock():
        recovered = [] if dry_run else _recover_first(host, store, gpu, actor)
        if not dry_run:
            # a removal of this vGPU left pending (its write blocked, the entry open) is that entry's to end:
            # the recovery just now finished it, or it is still pending and no second entry is opened
            _refuse_second_removal(store, vid, recovered)
        if not any(r.owner == rec.owner for r in store.vgpu_records(vgpu_id=vid)):
            ended = next((r for r in recovered if vid in r.devices and r.operation.startswith("vgpu remove ")
                          and r.result == "finished"), None)
            if ended is not None:
                out.notes.append(f"{vid}: its pending removal (journal #{ended.entry}) finished now")
                return out
            out.changed = False
            out.notes.append(f"{vid} was removed meanwhile by another vgpuhost process: nothing to do")
            return out
        current = for_backend(rec.backend).current_type(fs, parent, vid)
        if current is not None and current != rec.type_id:
            raise RefusedError(f"{vid} now holds type {current}, not the recorded {rec.type_id}: left alone",
                               hint="another tool reused the slot; 'vgpuhost reconcile --check' reports it")
        if current is None:
            out.notes.append(f"{vid} was already gone from the host; dropping the record")
        else:
            _refuse_if_open(fs, rec, parent, vid)    # before the journal: nothing changes
            out.steps.append(RemoveVgpu(rec.backend, parent, vid).describe(host))
        mdevctl = os.path.join(host.s.mdevctl_d, rec.parent, vid)
        if rec.persisted and fs.exists(mdevctl):
            out.steps.append(f"remove mdevctl definition {host.relative(mdevctl)}")
        if dry_run:
            return out
        ex = Executor(host, store, actor=actor or actor_name(), operation=f"vgpu remove {vid} owner={rec.owner}")
        ex.journal = Journal.start(store, kind="vgpu-remove", operation=ex.operation, owner=rec.owner,
                                   actor=ex.actor, gpu=rec.gpu, group=None, steps=out.steps,
                                   devices=[_journal_device(vid, rec.backend, rec.gpu, rec.parent, rec.type_id,
                                                            rec.type_name, rec.persisted, "removing")])
        with ex.journal:
            if current is not None:
                try:
                    destroy(ex.fs, rec.backend, parent, vid)     # refused while open; the write bounded
                except RemoveTimedOut as e:
                    # "remove pending": the write completes by itself once the device is closed, and
                    # reconcile (or the next operation on this GPU) then ends the entry
                    ex.journal.keep_open()
                    e.hint = (f"the removal stays pending: 'vgpuhost reconcile' (or the next operation on "
                              f"{rec.gpu}) finishes it once the device is closed")
                    raise
                except VgpuInUse:
                    raise                       # a holder that came since the check: nothing was written
                except SysfsError as e:
                    if e.errno == errno.EPERM and rec.backend != BACKEND_MDEV:
                        # NVIDIA's vendor-VFIO driver: a VF's usage count is not zero, and no holder was
                        # seen before the write (docs/reference/hardware.md#vendor-vfio): nothing changed
                        raise RefusedError(f"vGPU {vid} is still open, held by a process vgpuhost cannot see "
                                           "(another PID namespace, or a device fd without its group): not "
                                           "removed (the driver refused: EPERM)",
                                           hint="stop the domain or process that uses it, then remove it") from e
                    raise DeviceError(f"removing {vid} failed: {e.errno_name}", hint="see 'vgpuhost audit'") from e
                except BaseException:
                    # interrupted while the write may be in flight (the hook's alarm, SIGTERM, ^C): the
                    # detached write still completes once the device is closed, so the entry stays open
                    # and reconcile finishes it; closed as failed, reconcile would re-create the vGPU
                    ex.journal.keep_open()
                    raise
                if for_backend(rec.backend).current_type(ex.fs, parent, vid) is not None:
                    raise DeviceError(f"removing {vid} reported success but it is still there",
                                      hint="check dmesg and the NVIDIA vGPU manager")
            with store.transaction() as conn:
                delete_vgpu(conn, vid, owner=rec.owner)
            if rec.persisted and fs.exists(mdevctl):
                ex.run([RemoveConfig(mdevctl)])
            out.writes = ex.writes
            return out


def _refuse_second_removal(store: StateStore, vid: str, recovered: list) -> None:
    """Raise DeviceError (exit 3) when a removal of vGPU ``vid`` is still pending: an open ``vgpu-remove``
    journal entry names it (its write blocked by a holder, its caller gone on; ``recovered``: what the
    recovery of the vGPU's GPU did just now, :class:`vgpuhost.ops.recover.Recovered`, which says why it is
    still pending).  Nothing new is opened or written: the entry finishes once the device is closed."""
    entry = next((e for e in store.journal_entries(open_only=True) if e.kind == "vgpu-remove"
                  and any(str(d.get("id")) == vid for d in e.devices)), None)
    if entry is None:
        return
    why = next((r.detail for r in recovered if r.entry == entry.id and r.detail), "not ended yet")
    raise DeviceError(f"the removal of {vid} is still pending (journal #{entry.id}, opened {entry.opened}): {why}",
                      hint="it ends once the device is closed: stop what holds it open, then run this command "
                           "again or 'vgpuhost reconcile', which finish that entry (no second one is opened)")


def _refuse_if_open(fs: Sysfs, rec: VgpuRecord, parent: PciAddress, vid: str) -> None:
    """Raise VgpuInUse (exit 2, nothing changed) when a process holds vGPU ``vid`` open: a remove write
    would block until it is closed and ask qemu to unplug it (docs/reference/hardware.md#mdev)."""
    seen = for_backend(rec.backend).holders(fs, parent, vid)
    if seen:
        hint = (f"stop the domain that uses it (domain {rec.owner}) or detach the vGPU from it first; then remove it"
                if Owner.is_domain(rec.owner) else
                f"it is owned by {rec.owner}, not by a domain: stop the VM or process that opened it "
                "(named above), then remove it")
        raise VgpuInUse(vid, seen, hint=hint)


def _journal_device(vid: str, backend: str, gpu, parent, type_id: str, name: str, persist: bool,
                    state: str) -> dict:
    return {"id": vid, "backend": backend, "gpu": str(gpu), "parent": str(parent), "type_id": type_id,
            "type_name": name, "persisted": bool(persist), "state": state}


def _recover_first(host: HostRoot, store: StateStore, gpu, actor: Optional[str]) -> list:
    """Finish or roll back what an interrupted operation left on this GPU (its lock held); what was done."""
    from .recover import recover_locked
    return recover_locked(host, store, gpu=str(gpu), actor=actor or actor_name())


def _nolock():
    from contextlib import nullcontext
    return nullcontext()


def release_owner(host: HostRoot, store: StateStore, owner: str, *,
                  actor: Optional[str] = None) -> List[VgpuOutcome]:
    """Remove every vGPU ``owner`` holds (the hook's release); tolerant of ones already gone."""
    owner = validate_owner(owner)
    return [remove(host, store, r.id, owner=owner, actor=actor, while_running=True)
            for r in store.vgpu_records(owner=owner)]


def _normalise_id(text: str) -> str:
    return parse_device_id(text, "vGPU id", "an mdev UUID or, on vendor VFIO, the VF's PCI address (0000:21:00.4)")


# ---------------------------------------------------------------------------
# list and reconcile

@record
class ReconcileReport:
    recreated: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)     # recorded, absent, and (with check) not re-created
    failed: List[str] = field(default_factory=list)
    orphans: List[str] = field(default_factory=list)     # present, not created by vgpuhost: left alone
    mismatched: List[str] = field(default_factory=list)  # recorded id holds another type now
    # GPUs whose mixed-size mode reconcile turned on (or, with check, would) before re-creating records of
    # two sizes there (mixed-size mode is lost at a reboot: trial 8 retest R5)
    mixed_size_on: List[str] = field(default_factory=list)
    # recorded running, holding nothing, its start over (devices.stale_domains): reported (check) or forgotten
    stale_domains: List[str] = field(default_factory=list)
    forgotten_domains: List[str] = field(default_factory=list)
    # the libvirt URI asked which domains run that did not answer (None: answered, or none asked)
    libvirt_unasked: Optional[str] = None

    @property
    def in_sync(self) -> bool:
        return not (self.missing or self.failed or self.mismatched or self.stale_domains)

    def as_dict(self) -> dict:
        return {"schema": "vgpuhost.reconcile/v1", "in_sync": self.in_sync, **self.__dict__}


def reconcile(host: HostRoot, store: StateStore, *, check: bool = False,
              actor: Optional[str] = None, libvirt_uri: Optional[str] = None,
              forget_unasked: bool = True) -> ReconcileReport:
    """Re-create recorded vGPUs that are missing; report foreign ones; remove nothing.  Forget the domains
    recorded running that hold nothing and whose start is over (:func:`vgpuhost.ops.recover.stale_domains`:
    a start killed half-way), asking libvirt at ``libvirt_uri`` which domains run where it answers.
    With ``forget_unasked`` False, a ``libvirt_uri`` that does not answer leaves them recorded (listed in
    ``stale_domains``, ``libvirt_unasked`` set): the agent's start, which may come while libvirtd restarts.

    With ``check`` nothing changes and the report says what would.
    """
    from ..observe.inventory import discover
    fs = Sysfs(host)
    report = ReconcileReport()
    inv = discover(fs)
    entries = list_vgpus(inv, store.vgpu_records())
    report.orphans = [f"{e.id} ({e.type_name or e.type_id} on {e.parent})" for e in entries if e.state == VgpuState.FOREIGN]
    by_id = {r.id: r for r in store.vgpu_records()}
    for e in entries:
        if e.state == VgpuState.MISMATCHED:
            report.mismatched.append(f"{e.id}: holds {e.type_id}, recorded {by_id[e.id].type_id}")
    # a removal left pending (its write blocked by a holder, its caller timed out) is the journal's to
    # finish: the vGPU it removed is not re-created, even for a domain still recorded
    removing = removal_pending(store)
    gone = [by_id[e.id] for e in entries if e.state == VgpuState.MISSING]
    # records of two sizes on a GPU in equal-size mode: mixed-size mode first, or none re-created there
    blocked = _mixed_size_first(host, store, inv, [r for r in gone if r.id not in removing], report, check=check,
                                actor=actor or actor_name())
    # largest first on each GPU: where the offers counted each record's placement id (ops.vgpu._mixed_fit)
    gone.sort(key=lambda r: -(_size_gb(r.type_name) or 0))
    for rec in gone:
        if rec.id in blocked:
            continue
        if rec.id in removing:
            report.missing.append(f"{rec.id} ({rec.type_name} on {rec.parent}, owner {rec.owner}): its removal "
                                  "is pending (an open journal entry); not re-created")
            continue
        if check:
            report.missing.append(f"{rec.id} ({rec.type_name} on {rec.parent}, owner {rec.owner})")
            continue
        try:        # the record stays; a half-made vGPU is reported, not hidden; EIO/ENODEV marks the GPU
            recreate_recorded(host, store, rec, actor=actor or actor_name(), operation=f"reconcile {rec.id}")
            report.recreated.append(rec.id)
        except VgpuhostError as err:
            report.failed.append(f"{rec.id} ({rec.type_name} on {rec.parent}): {err.message}")
    from .recover import forget_stale, stale_domains
    running = _libvirt_active(libvirt_uri)
    stale = stale_domains(store, running)
    lines = {d["domain"]: f"{d['name']} ({d['domain']}): {d['why']}" for d in stale}
    unasked = libvirt_uri is not None and running is None
    if unasked:
        report.libvirt_unasked = libvirt_uri
    if check or (unasked and not forget_unasked):
        report.stale_domains = list(lines.values())
    elif stale:
        report.forgotten_domains = [lines[u] for u in forget_stale(store, stale, actor=actor or actor_name())]
    return report


def _size_gb(type_name: str) -> Optional[int]:
    """The framebuffer GB of a time-sliced profile name (``L40S-8Q``: 8); None for a MIG-backed or odd one."""
    p = VgpuProfile.try_parse(type_name)
    return None if p is None or p.mig_backed or not p.framebuffer_gb else int(p.framebuffer_gb)


def _mixed_size_first(host: HostRoot, store: StateStore, inv, gone: Sequence[VgpuRecord], report: "ReconcileReport",
                      *, check: bool, actor: str) -> FrozenSet[str]:
    """Before ``reconcile`` re-creates ``gone`` (records whose vGPU is missing): on each GPU where they are
    time-sliced vGPUs of two or more sizes and the GPU is in equal-size mode (mixed-size mode is lost at
    a reboot, a module reload, a GPU reset: they were made in mixed-size mode), turn mixed-size mode on
    first through :func:`vgpuhost.ops.scheduler.mixed_size` (as ``vgpuhost vgpu mode`` does: journaled,
    audited; ``report.mixed_size_on`` names the GPU), when the GPU holds no vGPU.  Where it holds one (the
    mode cannot change then) or the change is refused, none of them is re-created there (re-creating
    one in equal-size mode would fail the others and lock the mode, trial 8 retest R5): each goes to
    ``report.failed`` with the line saying what to run.  With ``check`` nothing changes; the GPU is
    listed as it would be.  Returns the ids not to re-create.  NVML is asked only where a GPU has
    records of two sizes; a GPU whose mode cannot be read is left to the re-creation as before."""
    by_gpu: Dict[str, List[VgpuRecord]] = {}
    for r in gone:
        if _size_gb(r.type_name):
            by_gpu.setdefault(r.gpu, []).append(r)
    need = {g: rs for g, rs in by_gpu.items() if len({_size_gb(r.type_name) for r in rs}) > 1}
    if not need:
        return frozenset()
    from ..io.backends import open_backend
    from .scheduler import mixed_size
    try:
        backend = open_backend(host)
    except (VgpuhostError, OSError, ImportError):
        return frozenset()
    blocked: set = set()
    for gpu, rs in sorted(need.items()):
        bdf = PciAddress.parse(gpu)
        try:
            if backend.heterogeneous_mode(bdf):
                continue
        except (VgpuhostError, OSError):
            continue
        ix = inv.on_gpu(bdf)
        present = len(ix.vgpus) if ix is not None else 0
        sizes = "/".join(sorted({r.type_name for r in rs}))
        why = ""
        if present:
            why = (f"GPU {gpu} is in equal-size mode (mixed-size mode is lost at a reboot) and holds {present} "
                   f"vGPU(s), so its mode cannot change; remove them, run 'vgpuhost vgpu mode --gpu {gpu} "
                   "--mixed-size on', then 'vgpuhost reconcile'")
        elif check:
            report.mixed_size_on.append(f"{gpu} (would turn mixed-size mode on first: records of {sizes})")
            continue
        else:
            try:
                mixed_size(host, store, bdf, True, backend=backend, actor=actor)
                report.mixed_size_on.append(f"{gpu} (records of {sizes})")
                continue
            except VgpuhostError as err:
                why = (f"GPU {gpu} is in equal-size mode and mixed-size mode could not be turned on ({err.message}); "
                       f"fix that, run 'vgpuhost vgpu mode --gpu {gpu} --mixed-size on', then 'vgpuhost reconcile'")
        for r in rs:
            blocked.add(r.id)
            report.failed.append(f"{r.id} ({r.type_name} on {r.parent}): not re-created: records of {sizes} "
                                 f"need mixed-size mode; {why}")
    return frozenset(blocked)


def _libvirt_active(uri: Optional[str]) -> Optional[FrozenSet[str]]:
    """The UUIDs of the domains libvirt at ``uri`` lists active, None without ``uri`` or when it cannot be
    asked (the state store's view decides then)."""
    if uri is None:
        return None
    from ..io.virt import open_connection
    try:
        conn = open_connection(uri)
        try:
            return frozenset(d.uuid.lower() for d in conn.domains() if d.is_active())
        finally:
            conn.close()
    except VgpuhostError:
        return None


# ---------------------------------------------------------------------------
# the pool model: vGPUs a layout pre-created, lent to domains

def claim(host: HostRoot, store: StateStore, vgpu_id: str, *, owner: str, profile: str,
          pool: str = LAYOUT, actor: Optional[str] = None) -> Optional[VgpuOutcome]:
    """Lend pool ``pool``'s vGPU ``vgpu_id`` (an mdev UUID or VF BDF a domain names) to ``owner``.

    No write to the host: the record's owner becomes ``owner`` and its
    ``pool`` column remembers where it goes back (:func:`give_back`).  None
    when ``vgpu_id`` is not a free vGPU of that pool with the profile
    ``profile`` (case-insensitive) and present on the host with its type.
    """
    vid = _normalise_id(vgpu_id)
    rec = next((r for r in store.vgpu_records() if r.id == vid), None)
    if rec is None or rec.owner != pool or rec.type_name.lower() != profile.lower():
        return None
    with file_lock(store.dir, f"gpu-{rec.gpu}"):
        fs = Sysfs(host)
        if for_backend(rec.backend).current_type(fs, PciAddress.parse(rec.parent), vid) != rec.type_id:
            return None
        with store.transaction() as conn:
            if not claim_vgpu(conn, vid, pool=pool, owner=owner):
                return None
            store.audit(actor=actor or actor_name(), operation=f"vgpu claim {vid} owner={owner}",
                        path="(pool)", value=f"{rec.type_name} from {pool}")
    return VgpuOutcome("claim", changed=True, dry_run=False, id=vid, gpu=rec.gpu, parent=rec.parent,
                       type_id=rec.type_id, type_name=rec.type_name, backend=rec.backend, owner=owner,
                       reason=f"claimed from the {pool}'s pool")


def pool_candidates(store: StateStore, *, profile: str, gpu: Optional[PciAddress] = None,
                    allowed: Optional[Collection[PciAddress]] = None, owner: Optional[str] = None,
                    pool: str = LAYOUT) -> List[VgpuRecord]:
    """The pool's free vGPUs of ``profile``, first-fit order (GPU, then id), respecting a GPU pin,
    the allow-list and one vGPU per domain per GPU (``owner``'s own vGPUs); none on a GPU out of service
    (:mod:`vgpuhost.ops.health`: its slot could not be made again for the domain)."""
    recs = store.vgpu_records()
    out_of_service = {row[0] for row in store.gpu_health_rows()}
    mine = {r.gpu for r in recs if owner is not None and r.owner == owner} | out_of_service
    allow = {str(a) for a in allowed} if allowed is not None else None
    out = [r for r in recs if r.owner == pool and r.type_name.lower() == profile.lower()
           and (gpu is None or r.gpu == str(gpu)) and (allow is None or r.gpu in allow) and r.gpu not in mine]
    return sorted(out, key=lambda r: (r.gpu, r.id))


def give_back(host: HostRoot, store: StateStore, vgpu_id: str, *, owner: str,
              actor: Optional[str] = None) -> Optional[str]:
    """Return ``owner``'s claimed vGPU to its pool (no write to the host); the pool, None when it
    was not claimed (then the caller removes it as the owner's own)."""
    rec = next((r for r in store.vgpu_records() if r.id == vgpu_id), None)
    if rec is None or rec.pool is None or rec.owner != owner:
        return None
    with file_lock(store.dir, f"gpu-{rec.gpu}"):
        with store.transaction() as conn:
            pool = give_back_vgpu(conn, vgpu_id, owner=owner)
            if pool is not None:
                store.audit(actor=actor or actor_name(), operation=f"vgpu give back {vgpu_id} owner={owner}",
                            path="(pool)", value=f"{rec.type_name} to {pool}")
    return pool
