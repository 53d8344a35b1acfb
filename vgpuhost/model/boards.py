"""The one board catalog: which NVIDIA boards vgpuhost knows, by PCI device id.

Owns: :data:`BOARDS`, every board's identity as the product names it
(``A100-PCIE-40GB``, ``GeForce RTX 2080``) and its framebuffer (MiB), used
by the inventory (a GPU's name and framebuffer), the config schema
(``board:`` selectors) and the simulator.  The detailed tables of the boards
vgpuhost simulates and checks layouts against (vGPU types with max
instances, MIG GPU-instance profiles, SR-IOV) are the catalog file
``vgpuhost/data/catalog.yaml``, parsed by :mod:`vgpuhost.model.catalog` and
read by :mod:`vgpuhost.io.catalog`; each of its boards names a device id
listed here and takes its framebuffer from here.
Must not: read files or import anything heavy (the qemu hook's inventory
imports this module).

Sources: PCI device ids and framebuffer sizes, docs/reference/hardware.md#pci-and-iommu, #vgpu-types
(NVIDIA's vGPU user guide and the PCI ID repository).
"""

from __future__ import annotations

from .values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, Optional


@record(frozen=True)
class Board:
    """One NVIDIA board: PCI ``device_id`` (vendor 0x10de), ``product`` name, ``framebuffer_mib`` (MiB)."""

    device_id: int
    product: str
    framebuffer_mib: int

    @property
    def family(self) -> str:
        """The product's family: ``A100`` for ``A100-PCIE-40GB``."""
        return self.product.split("-", 1)[0]


BOARDS: Dict[int, Board] = {b.device_id: b for b in (
    Board(0x20f1, "A100-PCIE-40GB", 40960), Board(0x20b5, "A100-PCIE-80GB", 81920), Board(0x20b7, "A30", 24576),
    Board(0x2235, "A40", 49152), Board(0x26b9, "L40S", 49152), Board(0x26b5, "L40", 49152),
    Board(0x27b8, "L4", 24576), Board(0x1eb8, "T4", 16384), Board(0x2330, "H100-SXM5-80GB", 81920),
    Board(0x2331, "H100-PCIE-80GB", 81920), Board(0x2335, "H200-SXM-141GB", 144384),
    Board(0x233b, "H200-NVL", 144384), Board(0x1e87, "GeForce RTX 2080", 8192),
    Board(0x2204, "GeForce RTX 3090", 24576), Board(0x2684, "GeForce RTX 4090", 24576),
)}


def board(device_id: int) -> Optional[Board]:
    """The board with PCI ``device_id``, or None when vgpuhost does not know it."""
    return BOARDS.get(device_id)
