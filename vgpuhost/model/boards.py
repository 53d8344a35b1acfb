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
(NVIDIA's vGPU user guide and the PCI ID repository); each board's architecture (Turing, Ampere, Ada,
Hopper, Blackwell) from NVIDIA's product pages and the vGPU user guide's supported-GPU tables, which
decides whether a GPU in MIG mode has a vGPU scheduler (Blackwell and newer only,
docs/reference/hardware.md#vgpu-scheduling).
"""

from __future__ import annotations

from .values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, Optional


#: NVIDIA GPU architectures, oldest first (the order decides "Blackwell or newer").
ARCHITECTURES = ("Turing", "Ampere", "Ada", "Hopper", "Blackwell")
#: the first architecture whose GPUs have a vGPU scheduler in MIG mode, per GPU instance
#: (``nvmlGpuInstanceGet/SetVgpuSchedulerState``: Blackwell GB20x and newer; on A100, H100 and H200 in MIG
#: mode "Software Scheduler is not supported in MIG mode", docs/reference/hardware.md#vgpu-scheduling).
MIG_SCHEDULER_FROM = "Blackwell"
#: the driver's words for a GPU in MIG mode before :data:`MIG_SCHEDULER_FROM`
MIG_NO_SCHEDULER = "Software Scheduler is not supported in MIG mode"


def mig_scheduler_on(architecture: str) -> bool:
    """Whether a GPU of ``architecture`` in MIG mode has a vGPU scheduler (per GPU instance): Blackwell or
    newer.  False for an architecture not in :data:`ARCHITECTURES`."""
    if architecture not in ARCHITECTURES:
        return False
    return ARCHITECTURES.index(architecture) >= ARCHITECTURES.index(MIG_SCHEDULER_FROM)


@record(frozen=True)
class Board:
    """One NVIDIA board: PCI ``device_id`` (vendor 0x10de), ``product`` name, ``framebuffer_mib`` (MiB),
    ``architecture`` (one of :data:`ARCHITECTURES`)."""

    device_id: int
    product: str
    framebuffer_mib: int
    architecture: str

    @property
    def mig_scheduler(self) -> bool:
        """A vGPU scheduler exists in MIG mode (per GPU instance) on this board: Blackwell or newer."""
        return mig_scheduler_on(self.architecture)

    @property
    def family(self) -> str:
        """The product's family: ``A100`` for ``A100-PCIE-40GB``."""
        return self.product.split("-", 1)[0]


BOARDS: Dict[int, Board] = {b.device_id: b for b in (
    Board(0x20f1, "A100-PCIE-40GB", 40960, "Ampere"), Board(0x20b5, "A100-PCIE-80GB", 81920, "Ampere"),
    Board(0x20b7, "A30", 24576, "Ampere"), Board(0x2235, "A40", 49152, "Ampere"),
    Board(0x26b9, "L40S", 49152, "Ada"), Board(0x26b5, "L40", 49152, "Ada"), Board(0x27b8, "L4", 24576, "Ada"),
    Board(0x1eb8, "T4", 16384, "Turing"), Board(0x2330, "H100-SXM5-80GB", 81920, "Hopper"),
    Board(0x2331, "H100-PCIE-80GB", 81920, "Hopper"), Board(0x2335, "H200-SXM-141GB", 144384, "Hopper"),
    Board(0x233b, "H200-NVL", 144384, "Hopper"), Board(0x1e87, "GeForce RTX 2080", 8192, "Turing"),
    Board(0x2204, "GeForce RTX 3090", 24576, "Ampere"), Board(0x2684, "GeForce RTX 4090", 24576, "Ada"),
)}


def board(device_id: int) -> Optional[Board]:
    """The board with PCI ``device_id``, or None when vgpuhost does not know it."""
    return BOARDS.get(device_id)
