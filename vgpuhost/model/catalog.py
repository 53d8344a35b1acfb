"""The detailed board catalog as values: vGPU types, MIG GPU-instance profiles, SR-IOV, other PCI functions.

Owns: the value types of the catalog file (``vgpuhost/data/catalog.yaml``,
read by :func:`vgpuhost.io.catalog.load_catalog`) and :func:`parse_catalog`,
which turns its parsed YAML into them.  Board identities (device id,
product, framebuffer) are :mod:`vgpuhost.model.boards`'s; this adds what the
simulator builds and the config schema checks against.  Facts and their
sources are in the catalog file's comments (docs/reference/hardware.md#pci-and-iommu, #vgpu-types, #mig-profiles).
Must not: read files; be used to resolve names on a real host (real hosts
report their own types).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .boards import BOARDS
from .values import MigProfile, VgpuProfile


@dataclass(frozen=True)
class PciIds:
    vendor: int
    device: int
    subsystem_vendor: int = 0
    subsystem_device: int = 0


@dataclass(frozen=True)
class MigProfileDef:
    """One GPU-instance profile of a board: id, name, max count, placements, memory.

    ``memory_mib``: the memory a GPU instance of it has, as the driver reports it (``nvidia-smi mig
    -lgip``, ``memorySizeMB``): below the name's GB (a real H200's 1g.18gb has 16384 MiB,
    NVIDIA/mig-parted issue 120; docs/reference/hardware.md#mig-profiles); None where the catalog
    has no real figure.
    """

    profile_id: int
    name: str
    max_count: int
    placement_starts: Tuple[int, ...]
    size: int  # memory slices out of 8 (the A30: out of 4)
    memory_mib: Optional[int] = None

    @property
    def profile(self) -> MigProfile:
        return MigProfile.parse(self.name)


@dataclass(frozen=True)
class VgpuTypeDef:
    """A vGPU type as a board offers it (framebuffer in MiB)."""

    type_id: int
    name: str                  # without vendor prefix: "A100-4C"
    max_instances: int         # equal-size mode
    max_instances_mixed: int   # mixed-size mode
    profile: VgpuProfile
    framebuffer_mib: int
    gi_profile: Optional[str] = None  # MIG-backed: the GPU-instance profile name


@dataclass(frozen=True)
class GpuModel:
    key: str
    marketing_name: str
    ids: PciIds
    pci_class: int
    framebuffer_mib: int
    reset_method: str
    vgpu_board: Optional[str]
    type_name_prefix: str
    sriov_totalvfs: int = 0
    sriov_offset: int = 0
    sriov_stride: int = 1
    vf_device: Optional[int] = None
    mig_profiles: Tuple[MigProfileDef, ...] = ()
    vgpu_types: Tuple[VgpuTypeDef, ...] = ()
    driver: str = "nvidia"

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)


@dataclass(frozen=True)
class DeviceModel:
    key: str
    ids: PciIds
    pci_class: int
    driver: Optional[str]
    reset_method: str = ""
    acs: bool = True


@dataclass
class Catalog:
    gpus: Dict[str, GpuModel] = field(default_factory=dict)
    devices: Dict[str, DeviceModel] = field(default_factory=dict)
    series_description: Dict[str, Dict[str, object]] = field(default_factory=dict)

    def model_names(self) -> List[str]:
        return sorted(self.gpus) + sorted(self.devices)


def _ids(d: dict) -> PciIds:
    return PciIds(d["vendor"], d["device"], d.get("subsystem_vendor", 0), d.get("subsystem_device", 0))


def parse_catalog(raw: dict) -> Catalog:
    """The catalog file's parsed YAML (``version: 1``) as values.

    Each GPU board names its PCI ids; its framebuffer comes from
    :data:`vgpuhost.model.boards.BOARDS` (the one table of board identities).
    Raises KeyError for a board whose device id that table does not list.
    """
    cat = Catalog(series_description=raw.get("series_description", {}))
    tables = {
        name: tuple(MigProfileDef(r[0], r[1], r[2], tuple(r[3]), r[4], r[5] if len(r) > 5 else None) for r in rows)
        for name, rows in raw.get("mig_tables", {}).items()
    }
    for key, g in raw.get("gpus", {}).items():
        mig = tables[g["mig_table"]] if g.get("mig_table") else ()
        types = []
        for tid, name, mx, mxm in g.get("vgpu_types", []):
            prof = VgpuProfile.parse(name)
            gi = None
            if prof.mig_backed:
                gi = _gi_profile_for(prof, mig)
            types.append(VgpuTypeDef(tid, name, mx, mxm, prof, prof.framebuffer_gb * 1024, gi))
        sriov = g.get("sriov") or {}
        cat.gpus[key] = GpuModel(
            key=key, marketing_name=g["marketing_name"], ids=_ids(g["ids"]),
            pci_class=g["class"], framebuffer_mib=BOARDS[g["ids"]["device"]].framebuffer_mib,
            reset_method=g.get("reset_method", ""), vgpu_board=g.get("vgpu_board"),
            type_name_prefix=g.get("type_name_prefix", "NVIDIA"),
            sriov_totalvfs=sriov.get("totalvfs", 0), sriov_offset=sriov.get("offset", 0),
            sriov_stride=sriov.get("stride", 1), vf_device=sriov.get("vf_device"),
            mig_profiles=mig, vgpu_types=tuple(types), driver=g.get("driver", "nvidia"))
    for key, d in raw.get("devices", {}).items():
        cat.devices[key] = DeviceModel(key, _ids(d["ids"]), d["class"], d.get("driver"),
                                       d.get("reset_method", ""), d.get("acs", True))
    return cat


def _gi_profile_for(prof: VgpuProfile, table: Tuple[MigProfileDef, ...]) -> Optional[str]:
    """The GPU-instance profile a MIG-backed type sits on: same slices, same GB, the suffix's (ME: +me)."""
    for row in table:
        mp = row.profile
        if mp.slices == prof.gi_slices and mp.memory_gb == prof.framebuffer_gb and mp.suffix == prof.gi_suffix:
            return row.name
    return None
