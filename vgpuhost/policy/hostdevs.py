"""Every GPU device a domain names is admitted or refused.  Pure decisions: no I/O.

Owns: classifying each host device a domain document names (its ``<hostdev>`` of type ``pci`` and
``mdev``, its ``<interface type='hostdev'>``; :class:`vgpuhost.libvirt.domxml.Hostdev`) against what
its vgpuhost metadata declares and what the host and the state store say of that device
(:func:`classify`), and the refusal the qemu hook's ``prepare begin`` and ``vgpuhost attach`` make
of the first one that is not declared (:func:`check_hostdevs`).

A device is a *GPU device* when it is:

- an NVIDIA PCI function (vendor 0x10de: a GPU, its audio function, a VF of it);
- any function in the IOMMU group of an NVIDIA GPU (libvirt detaching it takes the GPU's group);
- a VF whose physical function is an NVIDIA GPU (a vGPU-capable GPU's VF);
- an mdev the state store records (any owner), or one that lives on an NVIDIA parent.

Each GPU device must be declared by the metadata: a PCI function by a ``<vgpuhost:passthrough>``
whose IOMMU group holds it, or by a ``<vgpuhost:vgpu vf=>`` naming it; an mdev by a
``<vgpuhost:vgpu uuid=>``.  Declared devices are admitted by the rest of ``prepare begin``
(:mod:`vgpuhost.policy.hookrequest`, admission); an undeclared one would bypass all of that
(libvirt detaches a ``managed='yes'`` GPU for the guest itself), so it is refused, naming what
holds it when something does.  A declared mdev that already exists (made in advance, ``vgpuhost
vgpu create --owner``) is refused when the hook allow-list does not list its GPU.  Anything else (a
NIC, a USB device, an mdev of another vendor) passes untouched.

Must not: read files, the state store or the host (callers pass what they read:
:mod:`vgpuhost.ops.devices`, :mod:`vgpuhost.ops.attach`); import anything heavy (the qemu hook runs
this on every start of a domain with hostdevs).
"""

from __future__ import annotations

from ..model.errors import RefusedError
from ..model.kinds import Owner
from ..model.values import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:   # only for annotations: never imported on the hook path
    from typing import FrozenSet, List, Mapping, Optional, Sequence
    from ..libvirt.domxml import DomainView, Hostdev
    from ..observe.inventory import Inventory, PciDevice

NVIDIA_VENDOR = 0x10de          # observe/inventory.py NVIDIA_VENDOR (not imported: the hook's path)

#: outcomes of :func:`classify`
NOT_GPU = "not-gpu"             # not a GPU device: passes untouched
DECLARED = "declared"           # declared by the metadata: admitted by the rest of prepare
REFUSED = "refused"


class Verdict:
    """What :func:`classify` says of one hostdev.

    ``hostdev``: the :class:`~vgpuhost.libvirt.domxml.Hostdev`; ``outcome``: :data:`NOT_GPU`,
    :data:`DECLARED` or :data:`REFUSED`; ``gpu``: the NVIDIA GPU (BDF) it belongs to, when known;
    ``what``: the device in words; ``line`` / ``hint``: the refusal (REFUSED only).
    """

    __slots__ = ("hostdev", "outcome", "gpu", "what", "line", "hint")

    def __init__(self, hostdev: "Hostdev", outcome: str, gpu: "Optional[PciAddress]" = None, what: str = "",
                 line: str = "", hint: str = ""):
        self.hostdev, self.outcome, self.gpu, self.what, self.line, self.hint = hostdev, outcome, gpu, what, line, hint

    def __repr__(self) -> str:
        return f"Verdict({self.hostdev.device}, {self.outcome}, gpu={self.gpu}, {self.line!r})"


def declared_functions(view: "DomainView", inv: "Inventory") -> "FrozenSet[PciAddress]":
    """The PCI functions the metadata declares: each declared passthrough GPU and every member of its
    IOMMU group (``inv.groups``: passthrough binds the whole group; whether the group may be passed
    through is :func:`vgpuhost.policy.hookrequest.check_request`'s to say), and each
    ``<vgpuhost:vgpu vf=>``."""
    meta = view.metadata
    out: set = set()
    if meta is not None:
        for g in meta.passthrough:
            out.add(g)
            group = inv.group_of(g)
            if group is not None:
                out.update(group.members)
        out.update(r.vf for r in meta.vgpus if r.vf is not None)
    return frozenset(out)


def classify(inv: "Inventory", view: "DomainView", *, declared_pci: "FrozenSet[PciAddress]",
             allow: "Optional[FrozenSet[PciAddress]]", vgpu_records: "Sequence",
             passthrough_records: "Sequence", active_domains: "Mapping[str, str]") -> "List[Verdict]":
    """One :class:`Verdict` per hostdev of ``view``, in document order.

    ``inv``: what the host says of the named devices (``devices``, ``groups``, ``mdevs``: a whole
    :func:`~vgpuhost.observe.inventory.discover` or :func:`~vgpuhost.observe.inventory.discover_named`);
    ``declared_pci``: :func:`declared_functions`; ``allow``: the hook allow-list (None: every GPU);
    ``vgpu_records`` / ``passthrough_records``: the state store's (``.id``/``.gpu``/``.owner``/
    ``.type_name``, ``.bdf``/``.gpu``/``.owner``); ``active_domains``: ``{uuid: name}`` of running domains.
    """
    me = view.uuid
    name = view.name or me
    meta = view.metadata
    declared_mdevs = {r.uuid for r in meta.vgpus if r.uuid is not None} if meta is not None else set()
    vrec = {r.id: r for r in vgpu_records}
    prec = {r.bdf: r for r in passthrough_records}
    live = {m.uuid: m for m in inv.mdevs}
    out: List[Verdict] = []
    for h in view.hostdevs:
        if h.kind == "mdev":
            out.append(_mdev(inv, h, name, me, declared_mdevs, allow, vrec.get(h.mdev_uuid), live.get(h.mdev_uuid),
                             active_domains))
        elif h.source is not None:
            out.append(_pci(inv, h, name, me, declared_pci, vrec.get(str(h.source)), prec.get(str(h.source)),
                            active_domains))
        else:
            out.append(Verdict(h, NOT_GPU))
    return out


def check_hostdevs(inv: "Inventory", view: "DomainView", **facts) -> "List[Verdict]":
    """:func:`classify`, raising RefusedError (one line, exit 2) for the first refused hostdev;
    the verdicts otherwise.  Keywords as :func:`classify` takes them."""
    verdicts = classify(inv, view, **facts)
    for v in verdicts:
        if v.outcome == REFUSED:
            raise RefusedError(v.line, hint=v.hint)
    return verdicts


# ---------------------------------------------------------------------------

def _nvidia(dev: "Optional[PciDevice]") -> bool:
    return dev is not None and dev.vendor == NVIDIA_VENDOR


def _nvidia_gpu(dev: "Optional[PciDevice]") -> bool:
    return _nvidia(dev) and dev.base_class == 0x03 and dev.physfn is None


def _gpu_of(inv: "Inventory", bdf: PciAddress) -> "tuple":
    """``(gpu, what)``: the NVIDIA GPU the function at ``bdf`` belongs to (None: none found) and the
    function in words; ``what`` is empty when the function is no GPU device."""
    dev = inv.devices.get(bdf)
    if dev is None:
        return None, ""
    ids = f"{dev.class_name}, {dev.ids}"
    if dev.physfn is not None:
        pf = inv.devices.get(dev.physfn)
        if _nvidia(pf) or _nvidia(dev):
            return dev.physfn, f"VF {bdf} ({ids}) of NVIDIA GPU {dev.physfn}"
    if _nvidia_gpu(dev):
        return bdf, f"NVIDIA GPU {bdf} ({ids})"
    group = inv.group_of(bdf)
    gpus = [m for m in (group.members if group is not None else ()) if _nvidia_gpu(inv.devices.get(m))]
    if gpus:
        return gpus[0], f"{bdf} ({ids}), in the IOMMU group of NVIDIA GPU {gpus[0]}"
    if _nvidia(dev):
        return None, f"NVIDIA function {bdf} ({ids})"
    return None, ""


def _held(owner: str, me: str, active_domains: "Mapping[str, str]") -> str:
    if owner == me:
        return "recorded for this domain"
    if owner == Owner.MANUAL:
        return "bound or made for guests by a manual vgpuhost command (owner 'manual')"
    if owner == Owner.LAYOUT:
        return "held by vgpuhost's declarative layout (owner 'layout')"
    other = active_domains.get(owner)
    return f"held by domain {other!r} ({owner})" if other else f"held by domain {owner}"


def _pci(inv: "Inventory", h: "Hostdev", name: str, me: str, declared: "FrozenSet[PciAddress]", vrec, prec,
         active_domains: "Mapping[str, str]") -> Verdict:
    gpu, what = _gpu_of(inv, h.source)
    if not what:
        return Verdict(h, NOT_GPU)
    if h.source in declared:
        return Verdict(h, DECLARED, gpu, what)
    owner = prec.owner if prec is not None else (vrec.owner if vrec is not None else None)
    held = f", {_held(owner, me, active_domains)}" if owner is not None else ""
    managed = "" if h.origin == "interface" else f" managed='{'yes' if h.managed else 'no'}'"
    line = (f"{h.element[:-1]}{managed}> names {what}{held}, which vgpuhost's metadata does not declare: "
            "a GPU device the domain does not declare would bypass admission")
    if owner is not None and Owner.is_domain(owner) and owner != me:
        hint = "each domain needs its own device: remove the hostdev from this domain"
    elif vrec is not None or (gpu is not None and h.source != gpu and inv.devices[h.source].physfn is not None):
        hint = (f"remove the hostdev and give the domain a vGPU with 'vgpuhost attach {name} --profile "
                "PROFILE' (it writes hostdev and metadata together)")
    elif gpu is None:
        hint = (f"remove the hostdev: vgpuhost gives guests an NVIDIA GPU whole ('vgpuhost attach {name} "
                "--passthrough GPU') or as vGPUs ('--profile PROFILE')")
    elif not _nvidia(inv.devices.get(h.source)):
        hint = (f"remove the hostdev: it shares NVIDIA GPU {gpu}'s IOMMU group, so it goes to a VM only with the "
                f"whole group; 'vgpuhost host check' says whether {gpu}'s group can be passed through")
    else:
        hint = (f"remove the hostdev and declare the GPU with 'vgpuhost attach {name} --passthrough {gpu}' "
                "(it writes hostdev and metadata together)")
    return Verdict(h, REFUSED, gpu, what, line, hint)


def _mdev(inv: "Inventory", h: "Hostdev", name: str, me: str, declared: set,
          allow: "Optional[FrozenSet[PciAddress]]", rec, mdev, active_domains: "Mapping[str, str]") -> Verdict:
    uuid = h.mdev_uuid
    gpu = None
    if mdev is not None:
        parent = inv.devices.get(mdev.parent)
        if parent is not None and parent.physfn is not None:
            gpu = parent.physfn if _nvidia(inv.devices.get(parent.physfn)) or _nvidia(parent) else None
        elif _nvidia(parent):
            gpu = mdev.parent
    if gpu is None and rec is not None:
        gpu = PciAddress.parse(rec.gpu) if PciAddress.is_valid(rec.gpu) else None
    if rec is None and gpu is None:
        return Verdict(h, NOT_GPU)          # not recorded, not on an NVIDIA parent (or not there at all)
    what = f"vGPU {uuid}" + (f" ({rec.type_name} on GPU {gpu})" if rec is not None and gpu is not None else
                             f" (on GPU {gpu})" if gpu is not None else "")
    if uuid in declared:
        if mdev is not None and gpu is not None and allow is not None and gpu not in allow:
            listed = ", ".join(sorted(map(str, allow))) or "none"
            return Verdict(h, REFUSED, gpu, what,
                           f"{what} exists already, on GPU {gpu}, which is not in the hook allow-list "
                           "(etc/vgpuhost/hook.allow)",
                           f"the allow-list lets guests use only: {listed}; remove the vGPU ('vgpuhost vgpu remove "
                           f"{uuid}') so the hook places it on an allowed GPU, or add {gpu} to the list")
        return Verdict(h, DECLARED, gpu, what)
    held = f", {_held(rec.owner, me, active_domains)}" if rec is not None else ""
    line = (f"<hostdev type='mdev'> names {what}{held}, which vgpuhost's metadata does not declare: "
            "a GPU device the domain does not declare would bypass admission")
    if rec is not None and Owner.is_domain(rec.owner) and rec.owner != me:
        hint = "each domain needs its own device: remove the hostdev from this domain"
    else:
        hint = (f"remove the hostdev and give the domain a vGPU with 'vgpuhost attach {name} --profile PROFILE' "
                "(it writes hostdev and metadata together)")
    return Verdict(h, REFUSED, gpu, what, line, hint)
