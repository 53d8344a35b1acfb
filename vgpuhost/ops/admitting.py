"""The part of admission a domain start needs on a host without tenants: grants and their records.

Owns: :class:`Granted` (a device and its decision), :class:`Admitting` (what
the hook's admission block yields), :func:`active` (is tenancy in use),
:func:`unenforced` (the grants where there is nothing to enforce: no
tenant, whatever the domain's metadata asks; a domain's trusted tenant is
:func:`vgpuhost.ops.tenancy.trust`'s), :func:`record_allocations` and
:func:`type_framebuffers`.  :mod:`vgpuhost.ops.tenancy` decides where tenancy
is in use and re-exports these; they are apart so that the qemu hook's
``prepare begin`` on a host without tenants imports neither the admission
rules nor the tenant store code (about 0.9 ms of each such start, measured
2026-12-01).  Must not: import :mod:`vgpuhost.policy.admission` or
:mod:`vgpuhost.ops.tenancy`.
"""

from __future__ import annotations

from ..model.tenancy import UNTENANTED_QOS
from ..model.values import PciAddress, record
from ..policy import demand as adm

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Mapping, Optional, Sequence
    from ..io.state import StateStore
    from ..libvirt.domxml import DomainView
    from ..observe.inventory import Inventory

#: the host lock admission decides and records under: ``<state dir>/locks/tenancy.lock``
#: (:func:`vgpuhost.ops.tenancy.host_lock`; named here for the hook's path and reconcile, which import no admission)
HOST_LOCK = "tenancy"

#: settings key: map OpenStack projects to tenants (``project-name`` / ``project-uuid``; absent = off)
OPENSTACK = "openstack_tenants"
#: settings key: refuse the start of a domain bound to no tenant (``on``; absent = off; issue 28)
REQUIRE_BINDING = "require_binding"


@record(frozen=True)
class Granted:
    """One device of a domain and the admission decision for it (``device``: mdev UUID, VF BDF or GPU)."""

    device: str
    demand: adm.Demand
    decision: adm.Admission


def active(store: StateStore) -> bool:
    """Is tenancy in use on this host (a tenant or a pool declared, the OpenStack mapping on, or a binding
    required)?  One query.  Without it admission has nothing to enforce, no domain can be bound (a binding
    names a tenant), and the hook takes no host lock and reads no binding."""
    return store.tenancy_in_use((OPENSTACK, REQUIRE_BINDING))


def type_framebuffers(inv: Optional[Inventory], store: StateStore) -> Dict[str, int]:
    """``{type name (lower case): framebuffer MiB}`` from the inventory and the types seen before."""
    out: Dict[str, int] = {}
    for row in store.seen_types():
        if row[3]:
            out[row[2].lower()] = row[3]
    if inv is not None:
        for t in inv.vgpu_types:
            if t.framebuffer_mib:
                out[t.name.lower()] = t.framebuffer_mib
    return out


class Admitting:
    """What :func:`admitting` yields: the grants, the GPUs each device may go to, and what was made."""

    def __init__(self, granted: List[Granted]):
        self.granted = {g.device: g for g in granted}
        self.gpus: Dict[str, str] = {}
        #: device admitted -> the id the device was made under, where they differ (:meth:`made`)
        self.renamed: Dict[str, str] = {}

    def allowed_gpus(self, device: str, allowed: Optional[frozenset]) -> Optional[frozenset]:
        """The GPUs placement may use for ``device``: its admission candidates, narrowed by ``allowed``."""
        g = self.granted.get(device)
        if g is None or not g.decision.candidates:
            return allowed
        cands = frozenset(PciAddress.parse(c) for c in g.decision.candidates)
        return cands if allowed is None else cands & frozenset(allowed)

    def placed_gpu(self, device: str):
        """The GPU admission placed ``device`` on (a PciAddress), None where it decided no placement (tenancy
        not in use, passthrough): creating the device there re-checks that decision under the GPU lock
        instead of placing it a second time."""
        g = self.granted.get(device)
        if g is None or not g.decision.gpu or g.demand.kind != adm.VGPU:
            return None
        return PciAddress.parse(g.decision.gpu)

    def narrowed_by(self, device: str, allowed: Optional[frozenset]) -> str:
        """What narrowed :meth:`allowed_gpus` for ``device``, for a placement refusal's hint."""
        allow = "the hook allow-list (etc/vgpuhost/hook.allow)"
        g = self.granted.get(device)
        if g is None or not g.decision.candidates:
            return allow
        tenant = f"admission (tenant {g.decision.tenant!r}: isolation and pool)" if g.decision.tenant else \
            "admission (isolation and pool)"
        return tenant if allowed is None else f"{allow} with {tenant}"

    def refused(self, device: str, error: Exception) -> Exception:
        """The error to raise when the device layer refuses ``device`` where admission placed it (its
        re-check under the GPU lock): here ``error`` itself; under tenancy a refusal in admission's terms
        (:class:`vgpuhost.ops.tenancy._Enforced`)."""
        return error

    def made(self, device: str, gpu: Optional[str], made_as: Optional[str] = None) -> None:
        """``device`` exists now on ``gpu`` (recorded when the block ends without an error); ``made_as``: the
        id it was made under when not ``device`` (a vGPU admitted under a UUID and made on vendor VFIO, where
        its VF names it: a tenant's allocate), which its allocation row then takes."""
        if made_as and made_as != device:
            self.renamed[device] = made_as
            device = made_as
        if gpu:
            self.gpus[device] = gpu

    def rename_row(self, store: StateStore, conn, owner: str, device: str, made_as: str, gpu: str) -> None:
        """On ``conn``, the transaction that records ``device`` made under another id ``made_as`` on ``gpu``
        (a vGPU admitted under a UUID and made on a vendor-VFIO VF: a tenant's allocate): the allocation
        row admission wrote under ``device`` for ``owner`` goes, and ``made_as``'s row (the one
        :func:`record_allocations` writes when the block ends) is written, so that a kill after that
        transaction never leaves the row under the admitted id beside the record.  Then as :meth:`made`."""
        g = self.granted.get(device)
        if g is not None and made_as != device:
            store.delete_allocations(conn, devices=[device], of_owner=owner)
            a = adm.allocation(made_as, owner, gpu or g.decision.gpu or "", g.demand, g.decision)
            store.put_allocation(conn, (a.device, a.owner, a.tenant, a.gpu, a.kind, a.profile, a.framebuffer_mib,
                                        a.mig_slices, a.qos, int(a.burst)))
        self.made(device, gpu, made_as=made_as)


def unenforced(store: StateStore, view: DomainView, inv: Inventory,
               types: Optional[Mapping[str, str]] = None) -> List[Granted]:
    """Grants without a decision to make (tenancy not in use): each device's demand, with no tenant and
    class best effort (no tenant exists, so no domain is bound; a tenant its metadata names is never
    recorded: the XML may ask, never claim).

    ``types``: ``{device: type name as the host's devices spell it}`` (the hook's prepare resolved them
    once); a vGPU not named there is asked for as its metadata's profile names it."""
    meta = view.metadata
    tname = None
    qos = UNTENANTED_QOS
    mine = {r[0] for r in store.allocation_rows(owner=view.uuid)}
    fbs = None
    out = []
    for g in meta.passthrough:
        if str(g) not in mine:
            d = adm.Admission(True, "tenancy not in use", tname, qos, gpu=str(g))
            out.append(Granted(str(g), adm.passthrough_demand(), d))
    for v in meta.vgpus:
        if v.device in mine:
            continue
        if fbs is None:
            fbs = type_framebuffers(inv, store)
        d = adm.Admission(True, "tenancy not in use", tname, qos)
        name = types[v.device] if types and v.device in types else str(v.profile)
        out.append(Granted(v.device, adm.vgpu_demand(name, fbs.get(name.lower())), d))
    return out


def record_allocations(store: StateStore, owner: str, granted: Sequence[Granted], gpus: Mapping[str, str],
                       renamed: Optional[Mapping[str, str]] = None) -> None:
    """Record the allocations of devices ``owner`` now holds (``gpus``: device -> the GPU it went to; a vGPU
    not named there is looked up in the records; ``renamed``: device admitted -> the id it was made under,
    :attr:`Admitting.renamed`, which the row takes)."""
    if not granted:
        return
    renamed = renamed or {}
    gpus = dict(gpus)
    if any(renamed.get(gr.device, gr.device) not in gpus for gr in granted):
        for r in store.vgpu_records(owner=owner):
            gpus.setdefault(r.id, r.gpu)
    with store.transaction() as conn:
        if renamed:     # the row admission wrote under the admitted id goes: the device's own id replaces it
            store.delete_allocations(conn, devices=list(renamed), of_owner=owner)
        for gr in granted:
            device = renamed.get(gr.device, gr.device)
            a = adm.allocation(device, owner, gpus.get(device) or gr.decision.gpu or "", gr.demand,
                               gr.decision)
            store.put_allocation(conn, (a.device, a.owner, a.tenant, a.gpu, a.kind, a.profile, a.framebuffer_mib,
                                        a.mig_slices, a.qos, int(a.burst)))


def unenforced_admitting(store: StateStore, view: DomainView, inv: Inventory,
                         types: Optional[Mapping[str, str]] = None) -> "_Unenforced":
    """:func:`vgpuhost.ops.tenancy.admitting` where tenancy is not in use (:func:`active` False), without
    importing it: ``with unenforced_admitting(...) as box:`` admits every device the domain does not hold
    yet (its tenant name, if any, recorded), takes no lock, and records the allocations when the block
    ends without an error.  ``types``: as :func:`unenforced` takes them."""
    return _Unenforced(store, view, inv, types)


class _Unenforced:
    """:func:`unenforced_admitting`'s context manager (a class: the hook's path imports no contextlib)."""

    def __init__(self, store: StateStore, view: DomainView, inv: Inventory, types: Optional[Mapping[str, str]]):
        self.store, self.view, self.inv, self.types = store, view, inv, types
        self.granted: Optional[List[Granted]] = None
        self.box: Optional[Admitting] = None

    def __enter__(self) -> Admitting:
        meta = self.view.metadata
        if meta is None or meta.empty:
            return Admitting([])
        self.granted = unenforced(self.store, self.view, self.inv, self.types)
        self.box = Admitting(self.granted)
        return self.box

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and self.granted is not None:
            record_allocations(self.store, self.view.uuid, self.granted, self.box.gpus, self.box.renamed)
        return False

