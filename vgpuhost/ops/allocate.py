"""A vGPU allocated for a domain of a tenant, admitted at once (the agent's tenant role).

Owns: :func:`allocate_admitted`, the one place a vGPU made for a domain ahead of its start is
admitted under its tenant's quota when it is made (an operator's ``vgpu create --owner`` and
allocate are admitted only at the domain's start).  Must not: decide (admission does, through
:func:`vgpuhost.ops.tenancy.admitting`) or place (``ops/vgpu`` does, on the GPU admission chose).
Its own module: ``ops/tenancy`` and ``ops/vgpu`` each reach the other only inside functions.
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Callable, FrozenSet, Optional

from ..io.hostroot import HostRoot
from ..io.state import StateStore
from ..libvirt.domxml import DomainView, Metadata, VgpuRequest
from ..model.concepts import PlacementStrategy
from ..model.errors import RefusedError
from ..model.values import PciAddress
from ..observe.inventory import BACKEND_VENDOR_VFIO, Inventory
from . import health, migdemand, tenancy, vgpu
from .devices import admission_inputs


def allocate_admitted(host: HostRoot, store: StateStore, inventory: Callable[[], Inventory], *, owner: str,
                      tenant: str, profile: str, gpu: Optional[PciAddress] = None, uuid: Optional[str] = None,
                      strategy: str = PlacementStrategy.FIRST_FIT, anti_affinity: Optional[str] = None,
                      dry_run: bool = False, actor: Optional[str] = None,
                      allowed: Optional[FrozenSet[PciAddress]] = None) -> vgpu.VgpuOutcome:
    """One vGPU of ``profile`` for domain ``owner`` of ``tenant``, admitted as a start's vGPU is (quota,
    isolation, QoS class, pool and placement, under the host lock, on facts read under it) and recorded
    as the tenant's allocation before the vGPU is made, so it counts against the quota from then on (a
    vGPU made for a domain in advance by an operator is admitted only at the domain's start).

    ``inventory``: called once the host lock is held (the agent's snapshot); GPUs out of service and VFs
    reserved for another domain's incoming migration are left out of it (:func:`vgpuhost.ops.health.in_service`).  ``gpu`` a PciAddress to pin
    it, ``uuid`` the mdev UUID (None: a new one).  ``allowed``: the hook allow-list
    (:func:`vgpuhost.ops.devices.load_allow`; None = every GPU): placement only there, a pinned GPU outside
    it refused.  Returns the :func:`vgpuhost.ops.vgpu.create` outcome.
    Raises RefusedError (admission's reason and remedy; a ``refused`` audit row, nothing made), also before
    admission records anything when ``uuid`` is taken (a vGPU record, an allocation row or a device on the
    host, whoever holds it: one line that says the same either way) or ``gpu`` is outside ``allowed``, and
    what ``create`` raises (the allocation row is then dropped and the admission row gets its outcome)."""
    vid = uuid or str(uuidlib.uuid4())
    view = DomainView()
    view.uuid = owner
    view.metadata = Metadata(strategy=strategy, tenant=tenant, anti_affinity=anti_affinity,
                             vgpus=[VgpuRequest(profile, uuid=vid, gpu=gpu)])

    # the tenant the caller's credentials established for this domain (agent/api: its binding, else the
    # tenant of its allocations): weighed as its binding, so an unbound domain's allocate counts against
    # that tenant's quota rather than running as no tenant's
    binding = store.binding(owner.lower()) or (owner.lower(), tenant, None, actor or "agent", "")

    def make(at, dry: bool, inv: Inventory, box: Optional[tenancy.Admitting] = None):
        # admitted under the UUID ``vid``; on a vendor-VFIO GPU a vGPU has no UUID (its VF names it: the
        # VF placement takes), so it is made without one and its allocation takes the VF (trial 8 retest R0)
        g = inv.gpu(at) if at is not None else None
        vfio = g is not None and g.vgpu_backend == BACKEND_VENDOR_VFIO
        if vfio and uuid is not None:
            raise RefusedError(f"vgpu_uuid {uuid} names an mdev, but GPU {at} makes vGPUs on vendor VFIO, where "
                               "a VF names each", hint="omit vgpu_uuid: the answer's id is the VF the vGPU is on")
        # the allocation row admission wrote under ``vid`` takes the VF's id in the transaction that records
        # the vGPU: a kill after it leaves the final row, never the admitted one beside the VF's record
        renamed = (None if box is None else
                   lambda conn, rec: box.rename_row(store, conn, owner, vid, rec.id, rec.gpu))
        return vgpu.create(host, store, profile=profile, gpu=at, uuid=None if vfio else vid, strategy=strategy,
                           owner=owner, anti_affinity=anti_affinity, dry_run=dry, actor=actor, allowed_gpus=allowed,
                           on_record=renamed)

    def refuse(line: str, hint: str):
        if not dry_run:
            store.audit(actor=actor or "agent", operation=f"allocate {owner} {profile}", path="(admission)",
                        value=line, result="refused")
        return RefusedError(line, hint=hint)

    def read() -> Inventory:
        # the host as admission weighs it: GPUs out of service (cordoned, unhealthy) and VFs reserved for
        # another domain's incoming migration offer nothing (ops/health.in_service, as a start's admission,
        # migrate begin, attach and 'vgpu create' read it), so admission, MIG on demand and the create all
        # place on the same GPUs (trial 10 B8: a first-ranked cordoned GPU was admitted, then refused 409)
        return health.in_service(inventory(), store, owner=owner)
    with tenancy.host_lock(store):
        inv = read()
        # before admission records anything: a UUID already in use is refused whoever holds it (the same
        # line for the caller's own vGPU and another's), so no allocation row of another device is touched
        if uuid is not None and (store.vgpu_records(vgpu_id=vid) or any(m.uuid == vid for m in inv.mdevs)
                                 or any(row[0] == vid for row in store.allocation_rows())):
            raise refuse(f"vGPU UUID {vid} is taken; omit vgpu_uuid for a new one",
                         "a new vGPU needs a UUID no vGPU uses; nothing was changed")
        if gpu is not None and allowed is not None and gpu not in allowed:
            raise refuse(f"GPU {gpu} is not in the hook allow-list: vGPUs for domains are placed only on "
                         f"{', '.join(sorted(str(a) for a in allowed)) or 'no GPU'}",
                         "omit gpu, or name a GPU in the allow-list (the operator keeps it); nothing was changed")
        # what the hook's admission weighs beside the domain's devices, from its one source (the allow-list,
        # mixed-size maxima with missing records' placement ids, the pools' scheduler policies)
        def inputs(inv: Inventory) -> dict:
            return admission_inputs(host, inv, allowed, store.vgpu_records(), owner)
        # MIG on demand (opted-in GPUs): a MIG-backed profile no GPU instance takes now gets one made first,
        # as a start's does (ops/devices), destroyed again when admission or the create refuses below, and
        # with the domain's release otherwise (ops/devices.release_domain); a dry run counts the instances
        # that could be made, as capacity does (trial 8 retest: allocate was 409 where capacity counted them)
        on_demand = view.metadata.vgpus[0].profile.mig_backed and bool(migdemand.opted_in(store))
        if dry_run:
            now = inv
            if on_demand:
                inv = migdemand.makeable(host, store, inv)
            at = gpu
            if tenancy.active(store):
                granted = tenancy.admit_domain(store, view, inv, actor=actor, audit=False, binding=binding,
                                               **inputs(inv))
                at = tenancy.Admitting(granted).placed_gpu(vid) or gpu
            if on_demand and not any(t.available_instances > 0 and t.name.lower() == profile.lower()
                                     and at in (None, t.gpu) for t in now.vgpu_types):
                # admitted on the instances that could be made, and none takes it now: create's own dry run
                # would refuse (it makes no GPU instance), so the answer says what the allocate would do
                where = f" on {at}" if at is not None else ""
                return vgpu.VgpuOutcome("create", changed=True, dry_run=True, gpu=str(at) if at else None,
                                        type_name=profile, owner=owner,
                                        reason=f"MIG on demand would make a GPU instance for {profile}{where}, "
                                               "then the vGPU on it",
                                        steps=[f"make a GPU instance for {profile}{where} (MIG on demand)",
                                               f"create {profile} on it for {owner}"])
            return make(at, True, now)
        # a start in progress in the agent's process until its vGPU is made (migdemand.starting)
        with migdemand.starting(owner):
            made = (migdemand.make_for(host, store, owner, view.metadata.vgpus, inv, actor=actor or "agent")
                    if on_demand else [])
            try:
                if made:
                    inv = read()                # read again: the GPU instance offers the type now
                with tenancy.admitting(store, view, inv, actor=actor, binding=binding, **inputs(inv)) as box:
                    try:
                        out = make(box.placed_gpu(vid) or gpu, False, inv, box)
                    except RefusedError as e:
                        raise box.refused(vid, e) from None
                    box.made(vid, out.gpu, made_as=out.id)
            except BaseException:
                if made:
                    migdemand.release_made(host, store, made, actor=actor or "agent")
                raise
            if made:
                migdemand.started(store, made)
        return out
