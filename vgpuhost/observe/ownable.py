"""The devices on a host that vgpuhost may own: what a lost state store would orphan.

Owns: one cheap scan (no inventory) of PCI functions bound to vfio-pci,
mdevs, and VFs holding a vGPU type (vendor-specific VFIO), for the state
store's refusal to re-initialise itself (:class:`~vgpuhost.io.state.StateStore`).
Must not: decide anything beyond listing them.

Sysfs layout (docs/reference/hardware.md#pci-and-iommu, #mdev, #vendor-vfio): ``bus/pci/devices/<BDF>/driver`` links to
the bound driver, ``bus/mdev/devices/<uuid>`` lists mdevs, and
``<VF>/nvidia/current_vgpu_type`` reads non-zero while a VF holds a vGPU.
"""

from __future__ import annotations

from typing import List

from ..io.hostroot import HostRoot
from ..io.sysfs import Sysfs
from ..io.vgpudev import vf_current_type


def devices_vgpuhost_may_own(host: HostRoot) -> List[str]:
    """``['0000:01:00.0 (vfio-pci)', 'mdev 8f01...', 'VF 0000:21:00.4 (vGPU type 1155)']``; [] when none.

    Read errors count as nothing found (the caller only uses this to decide
    whether an empty store file may be initialised, and refuses anyway when
    unsure about a damaged one).
    """
    fs = Sysfs(host)
    out: List[str] = []
    try:
        for bdf in fs.listdir(host.pci_devices):
            d = host.pci_devices / bdf
            if fs.link_name(d / "driver") == "vfio-pci":
                out.append(f"{bdf} (vfio-pci)")
            cur = vf_current_type(fs, bdf)
            if cur is not None:
                out.append(f"VF {bdf} (vGPU type {cur})")
        out += [f"mdev {u}" for u in fs.listdir(host.mdev_devices)]
    except Exception:    # noqa: BLE001 - a read error here must not mask the store's own error
        return out
    return out
