"""IOMMU viability: what must move with a GPU for passthrough, and what must stop it (pure).

Owns: :func:`group_endpoints` (the endpoints of a GPU's IOMMU group in bind
order, its bridges, and the refusal when the group holds a foreign
endpoint) and :func:`prepare_blockers` (why binding must not start: boot
VGA, nvidia-persistenced, nvidia_drm, vGPUs on the GPU, SR-IOV VFs enabled,
vfio-pci missing).
Inputs are an :class:`~vgpuhost.observe.inventory.Inventory` already read.
Must not: read sysfs, write anything or decide the binding steps
(:mod:`vgpuhost.plan.passthrough` does).

Facts (the project's docs reference, section 1): a group is viable when it
holds only the GPU's own functions and bridges; bridges stay on pcieport;
nothing behind Intel VMD can be passed through (#intel-vmd);
unbinding from nvidia hangs while nvidia-persistenced holds the GPU, and
nvidia_drm holds it for display; vfio-pci refuses to bind a PF whose SR-IOV VFs are
enabled (its probe returns -EBUSY), so the VFs must be disabled first.
"""

from __future__ import annotations

from ..model.errors import InputError, RefusedError
from ..model.values import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import List, Optional, Sequence, Tuple
    from ..observe.inventory import Inventory, PciDevice

VFIO_PCI = "vfio-pci"


def group_endpoints(inv: Inventory, gpu: PciAddress) -> Tuple[int, List[PciDevice], List[PciAddress]]:
    """``(group number, endpoints that must move in bind order, bridges)`` for ``gpu``.

    Raises RefusedError when the IOMMU is off, the GPU has no group, or the
    group holds a foreign endpoint (anything but the GPU's own slot and bridges).
    """
    dev = inv.devices.get(gpu)
    if dev is None:
        raise InputError(f"no PCI device at {gpu}", hint="'vgpuhost gpus' lists the GPUs")
    if not dev.is_display:
        raise InputError(f"{gpu} is a {dev.class_name}, not a GPU",
                         hint="name the GPU's function 0; its companions move with it")
    if dev.is_vf:
        raise InputError(f"{gpu} is an SR-IOV VF of {dev.physfn}",
                         hint="VFs carry vGPUs; pass the physical GPU for passthrough")
    behind = vmd_refusal(inv, gpu)
    if behind:
        raise RefusedError(f"{gpu} cannot be passed through: {behind}",
                           hint="put the GPU in a slot outside VMD, or turn VMD off for its ports in the firmware "
                                "setup; classic mdev vGPUs are not refused behind VMD; nothing was changed")
    if not inv.iommu_enabled:
        raise RefusedError("the IOMMU is off (no IOMMU groups): nothing can be passed through",
                           hint="Intel: add intel_iommu=on iommu=pt to the kernel command line and reboot; AMD: enable "
                                "AMD-Vi in the firmware setup (the kernel turns it on by itself); 'vgpuhost host check' says more")
    group = inv.group_of(gpu)
    if group is None:
        raise RefusedError(f"{gpu} has no IOMMU group", hint="check the IOMMU covers this PCI segment")
    endpoints, bridges, foreign = [], [], []
    for m in group.members:
        d = inv.devices[m]
        if d.stays_in_group:
            bridges.append(m)
        elif m == gpu or m.slot_address == gpu.slot_address:
            endpoints.append(d)
        else:
            foreign.append(d)
    if foreign:
        names = "; ".join(f"{d.address} ({d.class_name}, {d.driver or 'no driver'})" for d in foreign)
        raise RefusedError(
            f"IOMMU group {group.number} of {gpu} is not viable: it also holds {names}, which would "
            "have to go to the same VM",
            hint="move the GPU to a slot whose upstream port has ACS, or use vGPU instead")
    endpoints.sort(key=lambda d: (d.address != gpu, d.address))   # the GPU first, then its functions
    return group.number, endpoints, bridges


def vmd_refusal(inv: Inventory, gpu: PciAddress) -> Optional[str]:
    """Why a device behind Intel VMD cannot be given to a VM whole (one phrase), None when ``gpu``
    is not behind one (docs/reference/hardware.md#intel-vmd): DMA from the VMD's PCI domain carries
    the VMD endpoint's requester id, so the kernel puts the endpoint and everything behind it in
    one IOMMU group (Linux >= 5.6), and the endpoint must stay on the vmd driver (unbinding it
    removes the domain).  VFIO can then hand out neither a GPU nor its SR-IOV VFs."""
    g = inv.gpu(gpu)
    dev = inv.devices.get(gpu)
    host = g.vmd if g is not None else (dev.domain_host if dev is not None else None)
    if host is None:
        return None
    return (f"it is behind Intel VMD {host} (PCI domain {gpu.domain:04x}), whose devices all share the VMD's "
            "IOMMU group and DMA requester id; VFIO cannot give one of them to a VM, and unbinding the VMD "
            "would remove the whole domain (the GPU and any disk behind it)")


def prepare_blockers(inv: Inventory, gpu: PciAddress, endpoints: Sequence[PciDevice], *,
                     allow_boot_vga: bool, boot_vga_fix: Optional[str] = None) -> List[str]:
    """Why prepare must not start (one sentence each, with the fix); empty = go.

    ``boot_vga_fix``: the fix to name for a boot VGA GPU (default: pass
    --allow-boot-vga; the qemu hook, which takes no options, names another).
    """
    out: List[str] = []
    dev = inv.devices[gpu]
    moving = [d for d in endpoints if d.driver != VFIO_PCI]
    if not moving:
        return out
    if dev.boot_vga and not allow_boot_vga and dev.driver != VFIO_PCI:
        out.append(f"{gpu} drives the host console (boot_vga=1); "
                   + (boot_vga_fix or "pass --allow-boot-vga if the host has another console (serial, BMC) "
                                      "or none is needed"))
    on_nvidia = any(d.driver == "nvidia" for d in moving)
    if on_nvidia and inv.host.running("nvidia-persistenced"):
        out.append("nvidia-persistenced is running and holds the GPU (unbind would hang): "
                   "systemctl stop nvidia-persistenced")
    if on_nvidia and "nvidia_drm" in inv.host.modules_loaded:
        out.append("nvidia_drm is loaded and holds the GPU for display: modprobe -r nvidia_drm nvidia_modeset")
    busy = [m.uuid for m in inv.mdevs if m.parent == gpu or inv.devices.get(m.parent, dev).physfn == gpu]
    busy += [str(v.vf) for v in inv.vf_vgpus if v.gpu == gpu and v.type_id]
    if busy:
        out.append(f"{gpu} carries vGPUs ({', '.join(busy[:4])}{'...' if len(busy) > 4 else ''}): "
                   "remove them first")
    out += sriov_blockers(moving)
    if not inv.host.module_present("vfio_pci"):
        out.append("the vfio-pci driver is not loaded: modprobe vfio-pci")
    return out


def sriov_blockers(endpoints: Sequence[PciDevice]) -> List[str]:
    """One sentence, with the fix, per function of ``endpoints`` that has SR-IOV VFs enabled:
    vfio-pci's probe refuses a PF with VFs enabled (-EBUSY; the VFs may be in use by the host),
    so passthrough cannot bind it (docs/reference/hardware.md#pci-and-iommu).  What
    :func:`prepare_blockers` and ``attach --passthrough`` refuse alike."""
    return [f"{d.address} has {d.sriov_numvfs} SR-IOV VFs enabled, and vfio-pci does not bind a PF "
            f"with SR-IOV VFs enabled: disable them first (/usr/lib/nvidia/sriov-manage -d {d.address}; "
            "vgpuhost does not run it)" for d in endpoints if d.sriov_numvfs]


__all__ = ["VFIO_PCI", "group_endpoints", "prepare_blockers", "sriov_blockers", "vmd_refusal"]
