"""MIG on demand: a GPU instance made at a domain's start for its MIG-backed vGPU, destroyed at its stop.

Owns: the opt-in (per GPU, the state store's settings ``mig.on-demand/<BDF>``, set by ``vgpuhost mig
on-demand`` or a layout's ``mig: {on_demand: true}``), :func:`make_for` (the qemu hook's ``prepare
begin``: a MIG-backed vGPU that no free GPU instance can take gets one made, when a free slice range
allows it), :func:`release_for` (``release end``, and the undo of a start that failed later: what
was made for the domain is destroyed) and :func:`sweep` (``reconcile``: what a domain no longer
running left).  Every GPU-instance change is :func:`vgpuhost.ops.mig.make_instance` /
:func:`~vgpuhost.ops.mig.destroy_instance`: under the GPU's lock, journaled, audited, undone on failure.
Must not: call NVML or spell kernel paths (the doors do); destroy a GPU instance a vGPU sits on.

Crash safety: the intent ``mig.made/<BDF>/<profile id>/<start>`` = ``<owner> pid=<maker>`` is written
before the create (the placement is chosen first) and gains `` gi=<id>`` once the instance reads back;
a kill between them leaves a record that :func:`release_for` (the domain's ``release end``) or
:func:`sweep` (``reconcile``, once the maker is gone and the domain neither runs nor holds a vGPU) end,
after the journal entry of the create is finished or rolled back under the GPU's lock, so no instance
made on demand is left behind nor half made.  Facts: docs/guide/nvml-mig-scheduler.md#mig-on-demand, a MIG-backed vGPU takes
one whole GPU instance and needs no compute instance on the host (docs/reference/hardware.md#mig-backed-vgpus).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple

from ..io import files
from ..io.backends import open_backend
from ..io.catalog import load_catalog
from ..io.hostroot import HostRoot
from ..io.sysfs import Sysfs
from ..model.concepts import Backend
from ..model.errors import InputError, RefusedError, VgpuhostError
from ..model.values import PciAddress, VgpuProfile, replace
from ..observe.inventory import VgpuType, discover_gpu
from ..policy.mig import place
from . import mig
from .migmade import MADE, Made, _STARTING, adopt, in_progress, made, maker_alive, started, starting  # noqa: F401
from .vgpu import _gi_profile_for

ON = "mig.on-demand/"
#: a file in the state dir, present while a GPU may be opted in: the lean `types` (which loads no
#: state store, :mod:`vgpuhost.cli.lean`) opens the store only then.  The store holds the opt-in.
HINT_FILE = "mig-on-demand"

def opted_in(store) -> FrozenSet[str]:
    """The GPUs (BDF text) where MIG on demand is on."""
    return frozenset(k[len(ON):] for k, v in store.settings_under(ON).items() if v == "on")


def set_opt_in(host: HostRoot, store, gpu: PciAddress, on: bool, *, actor: str) -> bool:
    """Turn MIG on demand on or off for ``gpu``; True when that changed something (one audit row).

    Raises InputError when ``gpu`` is no NVIDIA GPU of this host, RefusedError when it is not
    MIG-capable (turning it off is always allowed)."""
    if on:
        inv = discover_gpu(Sysfs(host), gpu, with_types=False, host_facts=False)
        g = inv.gpu(gpu)
        if g is None:
            raise InputError(f"no NVIDIA GPU at {gpu}", hint="'vgpuhost gpus' lists them")
        try:
            mode = open_backend(host).mig_mode(gpu)
        except VgpuhostError:
            mode = None
        if mode is None:
            raise RefusedError(f"{gpu} is not MIG-capable (or NVML does not see it): MIG on demand needs MIG",
                               hint="'vgpuhost mig show' lists the MIG-capable GPUs; nothing was changed")
    key = f"{ON}{gpu}"
    was = store.setting(key) == "on"
    if was == on:
        return False
    if on:                                  # the hint first: the lean `types` then opens the store
        files.write_atomic(Path(store.dir) / HINT_FILE, "MIG on demand is on for a GPU: see the state store\n")
    store.set_setting(key, "on" if on else None)
    if not on and not opted_in(store):
        files.remove(os.path.join(store.dir, HINT_FILE))
    store.audit(actor=actor, operation=f"mig on-demand {'on' if on else 'off'} {gpu}", path="(settings)",
                value=f"{key}={'on' if on else 'off'}")
    return True


def wanted_gi(host: HostRoot, gpu: PciAddress, profile: VgpuProfile):
    """``(backend, GI profile)`` of MIG-backed ``profile`` on ``gpu``, or ``(backend, None)``."""
    backend = open_backend(host)
    try:
        mode = backend.mig_mode(gpu)
        return backend, (_gi_profile_for(backend.gi_profiles(gpu), profile) if mode and mode[0] else None)
    except VgpuhostError:
        return backend, None


def room_for(profiles, current, gi) -> int:
    """How many more GPU instances of ``gi`` fit beside ``current`` (the device's placements and max
    count, :func:`vgpuhost.policy.mig.place`)."""
    k = 0
    while k < gi.max_count and place(profiles, {gi.profile_id: k + 1}, current) is not None:
        k += 1
    return k


def makeable(host: HostRoot, store, inv):
    """``inv`` as capacity, ``types`` and the exporter count it: on each GPU where MIG on demand is on
    (MIG mode on), every MIG-backed type of its board is listed on each free VF or mdev
    parent, with 1 available where its GPU-instance profile has room beside the instances there and 0
    where not (a full GPU, or one out of service, lists them all with 0: trial 5 finding 15, retest
    N3), and the
    GPU's ``gpu_instances`` count those that could be made as free ones (so the count is the
    instances that exist free plus those a start would make).  ``inv`` itself when nothing is opted
    in.  The type ids come from the board's catalog entry (docs/reference/hardware.md#vgpu-types)."""
    on = opted_in(store)
    gpus = [g for g in inv.gpus if str(g.address) in on
            and g.pci.driver == "nvidia" and (g.vfs or g.mdev_parents)]
    if not gpus:
        return inv
    backend = open_backend(host)
    models = {m.ids.device: m for m in load_catalog().gpus.values()}
    rows = list(inv.vgpu_types)
    index = {(t.parent, t.name.lower()): i for i, t in enumerate(rows)}
    new_gpus = {}
    for g in gpus:
        model = models.get(g.pci.device)
        if model is None or not model.mig_capable:
            continue
        try:
            mode = backend.mig_mode(g.address)
            if not mode or not mode[0]:
                continue
            profiles = backend.gi_profiles(g.address)
            current = backend.gpu_instances(g.address)
        except VgpuhostError:
            continue
        # a VF reserved for an incoming migration (ops/health.in_service) is held too: its GPU instance
        # counts as taken where the reservation's type id is a MIG-backed type of the GPU
        held = {m.parent for m in inv.mdevs} | {v.vf for v in inv.vf_vgpus if v.type_id} | set(inv.reserved)
        parents = [p for p in (g.vfs or g.mdev_parents) if p not in held]
        names = {p.profile_id: p.name for p in profiles}
        counts: Dict[str, int] = {}
        for x in current:
            n = names.get(x.profile_id, f"profile {x.profile_id}")
            counts[n] = counts.get(n, 0) + 1
        for t in model.vgpu_types:
            if not t.profile.mig_backed:
                continue
            gi = _gi_profile_for(profiles, t.profile)
            if gi is None:
                continue
            # a GPU out of service (cordoned, unhealthy) lists its profiles with 0, as a full one does
            room = 0 if g.address in inv.out_of_service else room_for(profiles, current, gi)
            if room:
                counts[gi.name] = counts.get(gi.name, 0) + room
            for parent in parents:
                i = index.get((parent, t.name.lower()))
                if i is not None:
                    if room:
                        rows[i] = replace(rows[i], available_instances=max(1, rows[i].available_instances))
                    continue
                backend_name = g.vgpu_backend or Backend.VENDOR_VFIO
                tid = str(t.type_id) if backend_name == Backend.VENDOR_VFIO else f"nvidia-{t.type_id}"
                rows.append(VgpuType(g.address, parent, backend_name, tid, f"{model.type_name_prefix} {t.name}",
                                     t.name, t.profile, t.framebuffer_mib, t.max_instances, 1 if room else 0,
                                     "vfio-pci"))
                index[(parent, t.name.lower())] = len(rows) - 1
        new_gpus[g.address] = replace(g, gpu_instances=counts)
    if not new_gpus:
        return inv
    return replace(inv, gpus=tuple(new_gpus.get(g.address, g) for g in inv.gpus), vgpu_types=tuple(rows))


def make_for(host: HostRoot, store, me: str, requests, inv, *, actor: str) -> List[Made]:
    """For each MIG-backed vGPU of ``requests`` (:class:`vgpuhost.libvirt.domxml.VgpuRequest`, the
    checked ones of a start) on a GPU where MIG on demand is on that no GPU instance offers now, make
    one GPU instance of its profile; what was made (empty: nothing).

    The GPU is the request's VF's GPU or its pin; an unpinned mdev request takes the first opted-in
    GPU of its board in ``inv`` (the domain's GPUs).  A GPU out of service (``inv.out_of_service``:
    unhealthy or cordoned) gets no GPU instance: RefusedError naming why when no other GPU is left.  A request the domain already holds (a retried
    start) makes nothing.  Raises RefusedError when no free slice range takes the instance (naming
    what is in the way; what this call made is destroyed first), or when a request's GPU already
    carries a vGPU of the domain or of an earlier request (one vGPU per VM per GPU), DeviceError when
    NVML fails.  Callers run it and the rest of the start inside :class:`starting`.
    """
    on = opted_in(store)
    if not on:
        return []
    mine = store.vgpu_records(owner=me)
    held = {r.id for r in mine}
    # GPUs this domain's vGPUs already use, and those earlier requests of this start take: one vGPU per
    # VM per GPU, so a second MIG-backed vGPU there is refused naming that rule (trial 10a finding 12)
    used = {str(r.gpu): r.id for r in mine}
    out: List[Made] = []
    try:
        for req in requests:
            profile = req.profile
            if not getattr(profile, "mig_backed", False) or req.device in held:
                continue
            name = str(profile).lower()
            if req.vf is not None:
                dev = inv.devices.get(req.vf)
                gpus = [dev.physfn] if dev is not None and dev.physfn is not None else []
            elif req.gpu is not None:
                gpus = [req.gpu]
            else:
                gpus = [g.address for g in inv.gpus if g.board in (None, profile.board)]
            gpus = [g for g in gpus if str(g) in on]
            if not gpus:
                continue
            if all(str(g) in used for g in gpus):
                other = used[str(gpus[0])]
                raise RefusedError(f"domain {me} asks for {profile} ({req.device}) on GPU {gpus[0]}, where "
                                   f"its vGPU {other} goes too: one vGPU per VM per GPU",
                                   hint="put the domain's vGPUs on different GPUs (their VFs or pins); "
                                        "nothing was changed")
            gpus = [g for g in gpus if str(g) not in used]
            oos = [g for g in gpus if g in inv.out_of_service]
            gpus = [g for g in gpus if g not in inv.out_of_service]
            if not gpus:                  # no NVML write on a GPU out of service (docs/guide/failures.md)
                line = (f"MIG on demand makes no GPU instance for {profile} on {oos[0]}: it is out of "
                        f"service ({inv.out_of_service[oos[0]]})")
                store.audit(actor=actor, operation=f"prepare {me}", path=f"(mig on-demand) {oos[0]}", value=line,
                            result="refused")
                e = RefusedError(line, hint=f"'vgpuhost gpu uncordon {oos[0]}' after repair, or start the domain "
                                            "on a GPU in service; nothing was changed")
                e.audited = True
                raise e
            free = [t.gpu for t in inv.vgpu_types if t.available_instances > 0 and t.name.lower() == name
                    and t.gpu in gpus and (req.vf is None or t.parent == req.vf)]
            if free:
                used[str(free[0])] = req.device
                continue                  # a GPU instance takes it now
            reasons = []
            for gpu in gpus:
                backend, gi = wanted_gi(host, gpu, profile)
                if gi is None:
                    reasons.append(f"{gpu}: no GPU-instance profile for {profile} (MIG mode off?)")
                    continue
                rec: Dict[str, Made] = {}

                def record(start: int, gpu=gpu, gi=gi) -> None:
                    m = Made(str(gpu), gi.profile_id, start, me, os.getpid())
                    store.set_setting(m.key, m.value())
                    rec["m"] = m

                try:
                    inst = mig.make_instance(host, store, gpu, gi.name, owner=me, actor=actor, record=record,
                                             backend=backend)
                except VgpuhostError as e:
                    if "m" in rec:              # the create failed and was undone: its intent goes too
                        release_made(host, store, [rec["m"]], actor=actor)
                    if not isinstance(e, RefusedError):
                        raise
                    reasons.append(e.message)
                    continue
                m = Made(str(gpu), inst.profile_id, inst.start, me, os.getpid(), inst.gi_id)
                store.set_setting(m.key, m.value())
                out.append(m)
                used[str(gpu)] = req.device
                break
            else:
                raise RefusedError(f"MIG on demand cannot make a GPU instance for {profile}: " + "; ".join(reasons),
                                   hint="stop a VM on that GPU, or re-slice its free instances ('vgpuhost mig "
                                        "apply'); nothing was changed")
    except BaseException:
        release_made(host, store, out, actor=actor)
        raise
    return out


def release_made(host: HostRoot, store, items: List[Made], *, actor: str, leftover: bool = False) -> List[str]:
    """Destroy the GPU instances ``items`` made on demand (last first) and drop their records; the
    ones that could not go (NVML failed: the record stays for the next try), each as a line.

    One another vGPU sits on now (the driver puts a vGPU on the lowest free GPU instance of its
    profile: a concurrent start's can land on this one) stays, and so does its record: the instance
    is still one made on demand, destroyed by the ``release end`` (or ``reconcile``) that finds it
    empty (:func:`release_for` ends such leftovers too).  The owner's release audits that, result
    ``kept``; ``leftover`` (a later release or ``reconcile`` trying the records left so) passes a
    busy one over without a row."""
    failed = []
    for m in reversed(items):
        try:
            mig.destroy_instance(host, store, PciAddress.parse(m.gpu), profile_id=m.profile_id, start=m.start,
                                 gi_id=m.gi_id, owner=m.owner, actor=actor)
        except RefusedError as e:
            if not leftover:
                store.audit(actor=actor, operation=f"mig on-demand release {m.owner}", path="(settings)",
                            value=f"{m.key} kept: {e.message}; the release that finds it empty destroys it",
                            result="kept")
            continue
        except VgpuhostError as e:
            failed.append(f"GPU instance at memory slice {m.start} on {m.gpu}: {e.message}")
            continue
        store.set_setting(m.key, None)
    return failed


def release_for(host: HostRoot, store, me: str, *, actor: str) -> List[str]:
    """``release end``: destroy what was made on demand for domain ``me``, then the :func:`orphans`
    of other domains (instances a vGPU of another domain kept busy at their owner's release: empty
    now that it went); the failures, as lines."""
    failed = release_made(host, store, made(store, owner=me), actor=actor)
    others = [m for m in orphans(store) if m.owner != me]
    return failed + (release_made(host, store, others, actor=actor, leftover=True) if others else [])


def orphans(store) -> List[Made]:
    """What was made on demand for a domain no longer starting nor running: its owner not recorded
    active, holding no vGPU, and the process that made it gone (an interrupted start's, or one a
    vGPU of another domain kept busy at its owner's release)."""
    active = set(store.active_domains())
    owners = {r.owner for r in store.vgpu_records()}
    return [m for m in made(store) if m.owner not in active and m.owner not in owners and not maker_alive(m)]


def busy_instances(backend, gpu: PciAddress) -> Optional[FrozenSet[int]]:
    """The ids of the GPU instances on ``gpu`` a vGPU sits on; None when NVML cannot say which
    (vGPUs exist but not per instance: every one counts as busy).  Raises VgpuhostError (NVML)."""
    try:
        return frozenset(k for k, n in dict(backend.gpu_instance_vgpus(gpu)).items() if n)
    except VgpuhostError as e:
        if not getattr(e, "not_supported", False):
            raise
    return None if int(backend.active_vgpus(gpu)) else frozenset()


def left(host: HostRoot, store) -> List[Tuple[Made, str]]:
    """``reconcile --check``: the GPU instances made on demand that nothing ends by itself, each with
    why: its owner holds no vGPU, the process that made it is gone and no vGPU sits on the instance
    (one a vGPU of another domain keeps busy is in use, not left).  Why is "an interrupted start"
    (the create never read back), "an interrupted stop: ..." (the owner is still recorded running:
    its ``release end`` was killed) or "left empty after its owner's stop"."""
    active = set(store.active_domains())
    owners = {r.owner for r in store.vgpu_records()}
    backend = None
    busy: Dict[str, Optional[FrozenSet[int]]] = {}
    out = []
    for m in made(store):
        if m.owner in owners or maker_alive(m):
            continue
        if m.gi_id is not None:
            if m.gpu not in busy:
                backend = backend or open_backend(host)
                try:
                    busy[m.gpu] = busy_instances(backend, PciAddress.parse(m.gpu))
                except VgpuhostError:
                    busy[m.gpu] = None
            ids = busy[m.gpu]
            if ids is None or m.gi_id in ids:
                continue
        why = ("an interrupted start" if m.gi_id is None else
               "an interrupted stop: its release end did not finish" if m.owner in active else
               "left empty after its owner's stop")
        out.append((m, why))
    return out


def gone(host: HostRoot, store) -> List[Made]:
    """Records whose GPU instance read back once and is no longer there (a stop killed after its
    destroy landed): nothing left to destroy."""
    backend = open_backend(host)
    out = []
    for m in made(store):
        if m.gi_id is None:
            continue                      # a create that may still land: the journal's and sweep's
        try:
            there = backend.gpu_instances(PciAddress.parse(m.gpu))
        except VgpuhostError:
            continue
        if not any(g.gi_id == m.gi_id and g.profile_id == m.profile_id and g.start == m.start for g in there):
            out.append(m)
    return out


def sweep(host: HostRoot, store, *, actor: str) -> Tuple[List[Made], List[str]]:
    """``reconcile`` (after the journal's open entries are ended and stale domains forgotten): drop
    the records of instances already :func:`gone`, and destroy the :func:`orphans` (an interrupted
    start's or stop's, or one left empty after its owner's stop; one a vGPU sits on stays);
    ``(ended, failures)``."""
    ended = gone(host, store)
    for m in ended:
        store.set_setting(m.key, None)
        store.audit(actor=actor, operation=f"reconcile {m.owner}", path="(settings)",
                    value=f"{m.key} dropped: its GPU instance is gone")
    left = orphans(store)
    failed = release_made(host, store, left, actor=actor, leftover=True)
    return ended + [m for m in left if store.setting(m.key) is None], failed


__all__ = ["ON", "MADE", "HINT_FILE", "Made", "opted_in", "set_opt_in", "made", "make_for", "release_made", "release_for",
           "orphans", "left", "busy_instances", "sweep", "room_for", "makeable", "starting", "maker_alive",
           "started", "in_progress", "adopt"]
