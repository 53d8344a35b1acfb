"""What a domain document may make the qemu hook do.  Pure decisions: no I/O.

Owns: parsing the operator allow-list (:func:`parse_allow`, the bytes of
``etc/vgpuhost/hook.allow``), deciding whether a domain's vgpuhost metadata
may be acted on (:func:`check_request`) and whether another owner holds a
device it names (:func:`check_holders`).  Must not: read files, the state
store or the host (callers pass what they read: :mod:`vgpuhost.ops.devices`);
import anything heavy (the qemu hook runs this on every GPU domain start).
"""

from __future__ import annotations

from ..model.errors import InputError, RefusedError
from ..model.values import PciAddress
from ..model.kinds import Owner

TYPE_CHECKING = False
if TYPE_CHECKING:   # only for annotations: never imported on the hook path
    from typing import Callable, FrozenSet, List, Mapping, Optional, Sequence, Tuple
    from ..libvirt.domxml import DomainView
    from ..observe.inventory import Inventory, PciDevice

    #: ``group_endpoints(inv, gpu) -> (group, endpoints in bind order, bridges)``
    EndpointsOf = Callable[[Inventory, PciAddress], Tuple[int, List[PciDevice], List[PciAddress]]]

#: the allow-list file, under ``<root>/etc``
ALLOW_FILE = ("vgpuhost", "hook.allow")
MAX_ALLOW_BYTES = 64 * 1024
_BDF_CHARS = frozenset("0123456789abcdefABCDEF:.")


# ---------------------------------------------------------------------------
# the operator allow-list

def parse_allow(data: "Optional[bytes]", where: str) -> "Optional[FrozenSet[PciAddress]]":
    """The GPUs the hook may act on, from the allow-list's bytes (None: no file): None = every NVIDIA GPU.

    Format: one GPU BDF (``0000:41:00.0``, the physical GPU: it covers its
    IOMMU-group companions, the vGPUs placed on it and its VFs) per line,
    ``#`` starts a comment, blank lines are ignored, ``*`` allows every
    NVIDIA GPU.  A file with no entry allows none.  The list only narrows:
    a BDF that is not an NVIDIA GPU is never acted on, listed or not.
    ``data`` holds at most :data:`MAX_ALLOW_BYTES` + 1 bytes; ``where`` names
    the file in messages.  Raises InputError (``file:line: ...``) for a bad
    line or a file over the cap; the hook then refuses (fails closed).
    """
    if data is None:
        return None
    if len(data) > MAX_ALLOW_BYTES:
        raise InputError(f"{where} is over {MAX_ALLOW_BYTES} bytes",
                         hint="one GPU BDF per line; a host has a few GPUs")
    out = set()
    for n, raw in enumerate(data.decode("ascii", "backslashreplace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "*":
            return None
        if not PciAddress.is_valid(line):
            # quoted only when it looks like an address: a symlink to another file never has a line shown
            shown = repr(line) if len(line) <= 16 and not set(line) - _BDF_CHARS else \
                f"a line (not shown: {len(line)} characters)"
            raise InputError(f"{where}:{n}: {shown} is not a GPU's PCI address",
                             hint="one full BDF per line (0000:41:00.0), '*' for every NVIDIA GPU, '#' comments")
        out.add(PciAddress.parse(line))
    return frozenset(out)


# ---------------------------------------------------------------------------
# trust: what a domain document may make vgpuhost do

class Checked:
    """What :func:`check_request` admitted: passthrough GPUs with their endpoints, vGPU requests."""

    __slots__ = ("passthrough", "vgpus", "allowed", "pooled")

    def __init__(self):
        self.passthrough: List[Tuple[PciAddress, List[PciAddress]]] = []
        self.vgpus: list = []                              # domxml.VgpuRequest, in metadata order
        self.allowed: Optional[FrozenSet[PciAddress]] = None
        self.pooled: set = set()       # passthrough GPUs the operator bound (owner manual/layout): used as they are


def check_request(inv: "Inventory", view: "DomainView", allow: "Optional[FrozenSet[PciAddress]]",
                  group_endpoints: "EndpointsOf") -> Checked:
    """Decide whether the domain's vgpuhost metadata may be acted on, before anything is touched.

    Pure: reads ``inv`` and ``view`` only.  The XML is untrusted (whoever may
    define a domain wrote it), so vgpuhost acts only on devices it would offer
    for guests: NVIDIA GPUs (vendor 0x10de, display class 0x03xx), their
    IOMMU-group companions (``group_endpoints(inv, gpu)``, as
    :func:`vgpuhost.ops.passthrough.group_endpoints`: it refuses a group
    holding a storage or network controller) and VFs of
    NVIDIA GPUs; each narrowed by ``allow`` (None = all).  The metadata must
    match the domain's own hostdevs: each mdev UUID an mdev hostdev, each VF
    and every endpoint of a passthrough group a ``managed='no'`` PCI
    hostdev (a ``managed='yes'`` one on a group vgpuhost binds is refused:
    never both).  Raises InputError / RefusedError naming the device.
    """
    meta = view.metadata
    out = Checked()
    out.allowed = allow
    if meta is None:
        return out
    pci = {}
    for h in view.hostdevs:
        if h.kind == "pci" and h.source is not None:
            pci[h.source] = h
    mdevs = set(view.mdev_uuids)
    whole = set()
    for gpu in meta.passthrough:
        what = f"passthrough {gpu}"
        _nvidia_gpu(inv, gpu, what)
        _allowed(allow, gpu, what)
        _, endpoints, _ = group_endpoints(inv, gpu)       # refuses a group with a foreign endpoint
        for d in endpoints:
            _need_unmanaged(pci, d.address, what)
        whole.add(gpu)
        out.passthrough.append((gpu, [d.address for d in endpoints]))
    for req in meta.vgpus:
        if req.uuid is not None:
            _check_mdev(inv, req, mdevs, allow, whole)
        else:
            _check_vf(inv, req, pci, allow, whole)
        out.vgpus.append(req)
    return out


def _check_mdev(inv: "Inventory", req, mdevs: set, allow: "Optional[FrozenSet[PciAddress]]", whole: set) -> None:
    """A classic mdev vGPU request (``domxml.VgpuRequest`` with a UUID): its hostdev, its pinned GPU."""
    what = f"vGPU {req.uuid}"
    if req.uuid not in mdevs:
        raise RefusedError(f"{what}: the domain has no <hostdev type='mdev'> with that UUID",
                           hint="attach vGPUs with 'vgpuhost attach', which writes hostdev and "
                                "metadata together")
    if req.gpu is not None:
        _nvidia_gpu(inv, req.gpu, what)
        _allowed(allow, req.gpu, what)
        if req.gpu in whole:
            raise RefusedError(f"{what}: GPU {req.gpu} is also passed through to this domain",
                               hint="a passed-through GPU carries no vGPUs")


def _check_vf(inv: "Inventory", req, pci: dict, allow: "Optional[FrozenSet[PciAddress]]", whole: set) -> None:
    """A vendor-VFIO vGPU request (``domxml.VgpuRequest`` with a VF): a VF of an allowed NVIDIA GPU
    not passed through here, named by a ``managed='no'`` hostdev."""
    what = f"vGPU on VF {req.vf}"
    dev = inv.devices.get(req.vf)
    if dev is None:
        raise InputError(f"{what}: no PCI device at {req.vf} on this host",
                         hint="'vgpuhost gpus' lists the GPUs and their VFs; fix the domain's metadata")
    parent = inv.gpu(dev.physfn) if dev.physfn is not None else None
    if parent is None:
        raise RefusedError(f"{what}: {req.vf} is a {dev.class_name} ({dev.ids}), not a VF of an "
                           "NVIDIA GPU", hint="remove it from the domain's vgpuhost metadata")
    _allowed(allow, parent.address, what)
    if parent.address in whole:
        raise RefusedError(f"{what}: its GPU {parent.address} is also passed through to this domain",
                           hint="a passed-through GPU carries no vGPUs")
    if req.gpu is not None and req.gpu != parent.address:
        raise InputError(f"{what}: the VF belongs to {parent.address}, the metadata says gpu={req.gpu}")
    _need_unmanaged(pci, req.vf, what, vf=True)


def _allowed(allow: "Optional[FrozenSet[PciAddress]]", gpu: PciAddress, what: str) -> None:
    if allow is not None and gpu not in allow:
        raise RefusedError(f"{what}: GPU {gpu} is not in the hook allow-list (etc/vgpuhost/hook.allow)",
                           hint=f"add {gpu} to that file if guests may use it, or change the domain")


def _need_unmanaged(pci: dict, bdf: PciAddress, what: str, vf: bool = False) -> None:
    """``pci``: the domain's PCI hostdevs by source BDF; refuses a missing or ``managed='yes'`` one."""
    h = pci.get(bdf)
    if h is None:
        raise RefusedError(f"{what}: the domain has no <hostdev type='pci' managed='no'> for {bdf}",
                           hint="attach the device with 'vgpuhost attach', which writes hostdev and "
                                "metadata together")
    if h.managed:
        why = ("a vGPU VF stays on NVIDIA's driver, and managed='yes' would have libvirt rebind it"
               if vf else "vgpuhost binds the whole IOMMU group itself (never both)")
        raise RefusedError(f"{what}: the hostdev for {bdf} is managed='yes', but {why}",
                           hint="set managed='no' on it ('vgpuhost attach' does)")


def _nvidia_gpu(inv: "Inventory", bdf: PciAddress, what: str):
    """The NVIDIA GPU at ``bdf``; InputError when nothing is there, RefusedError for another device."""
    g = inv.gpu(bdf)
    if g is not None:
        return g
    dev = inv.devices.get(bdf)
    if dev is None:
        raise InputError(f"{what}: no PCI device at {bdf} on this host",
                         hint="'vgpuhost gpus' lists the GPUs; fix the domain's metadata")
    raise RefusedError(f"{what}: {bdf} is a {dev.class_name} ({dev.ids}), not an NVIDIA GPU: vgpuhost "
                       "gives guests NVIDIA GPUs only", hint="remove it from the domain's vgpuhost metadata")


def holder_text(owner: str, active_domains: "Mapping[str, str]") -> str:
    """Who ``owner`` is, in words: a manual command, the layout, or a domain by name (from ``active_domains``)."""
    if owner == Owner.MANUAL:
        return "a manual vgpuhost command (owner 'manual')"
    if owner == Owner.LAYOUT:
        return "vgpuhost's declarative layout (owner 'layout')"
    name = active_domains.get(owner)
    return f"domain {name!r} ({owner})" if name else f"domain {owner}"


def check_holders(inv: "Inventory", view: "DomainView", checked: Checked, *, vgpu_records: "Sequence",
                  passthrough_records: "Sequence", active_domains: "Mapping[str, str]") -> None:
    """Refuse a device another owner holds (naming it) or one vgpuhost did not make (foreign).

    Pure: ``vgpu_records`` and ``passthrough_records`` are the state store's
    records (``.id``/``.owner``, ``.bdf``/``.owner``), ``active_domains``
    ``{uuid: name}`` of the domains recorded as running.  A passthrough
    group the operator bound (``vgpuhost passthrough prepare`` or a layout:
    owner ``manual`` / ``layout``) is there for guests: it is used as it is,
    never taken over or released by the domain (``checked.pooled``),
    provided every function is on vfio-pci.  Raises RefusedError.
    """
    me = view.uuid
    records = {r.id: r for r in vgpu_records}
    present = {m.uuid for m in inv.mdevs}
    taken_vfs = {str(v.vf): v.type_id for v in inv.vf_vgpus if v.type_id}
    for req in checked.vgpus:
        dev = req.device
        rec = records.get(dev)
        if rec is not None and rec.owner == Owner.LAYOUT and rec.type_name.lower() == str(req.profile).lower():
            continue                        # the layout's pool: claimed at prepare (pool model)
        if rec is not None and rec.owner != me:
            raise RefusedError(f"vGPU {dev} is held by {holder_text(rec.owner, active_domains)}",
                               hint="each domain needs its own device: re-attach with a new one "
                                    "('vgpuhost detach' then 'vgpuhost attach')")
        if rec is None and (dev in present or dev in taken_vfs):
            what = f"an mdev {dev} exists" if dev in present else f"VF {dev} holds vGPU type {taken_vfs[dev]}"
            raise RefusedError(f"{what} that vgpuhost did not create: left alone",
                               hint="remove it with the tool that made it, or attach another device")
    if checked.passthrough:
        pt = {}
        for r in passthrough_records:
            pt[r.bdf] = r.owner
        for gpu, endpoints in checked.passthrough:
            for bdf in endpoints:
                owner = pt.get(str(bdf))
                if owner is None or owner == me:
                    continue
                if Owner.is_pool(owner):
                    loose = [str(b) for b in endpoints if inv.devices[b].driver != "vfio-pci"]
                    if loose:
                        raise RefusedError(f"passthrough {gpu}: IOMMU group of {gpu} is held by "
                                           f"{holder_text(owner, active_domains)} but {', '.join(loose)} is not on "
                                           "vfio-pci", hint=f"run 'vgpuhost passthrough prepare {gpu}' again, or "
                                                            f"release it ('vgpuhost passthrough release {gpu}')")
                    checked.pooled.add(gpu)
                    break
                raise RefusedError(f"passthrough {gpu}: IOMMU group of {gpu} is held by "
                                   f"{holder_text(owner, active_domains)}",
                                   hint="it is given back when that domain stops")
