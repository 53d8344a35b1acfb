"""The simulator's board catalog: the values of :mod:`vgpuhost.model.catalog`, loaded by :mod:`vgpuhost.io.catalog`.

Facts and their sources are in data/catalog.yaml's comments (docs/reference/hardware.md#pci-and-iommu, #vgpu-types,
#mig-profiles); board identities in :mod:`vgpuhost.model.boards`.  Must not: be used to
resolve names on a real host; real hosts report their own types.
"""

from __future__ import annotations

from ..io.catalog import load_catalog
from ..model.catalog import Catalog, DeviceModel, GpuModel, MigProfileDef, PciIds, VgpuTypeDef

__all__ = ["load_catalog", "Catalog", "DeviceModel", "GpuModel", "MigProfileDef", "PciIds", "VgpuTypeDef"]
