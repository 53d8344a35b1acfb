"""The small vocabularies every layer shares: who owns a device, which vGPU backend, a vGPU's state.

Owns: the one spelling of each value, as the state store records it and
every output (tables, ``--json``, audit rows, domain metadata) prints it.
These are string constants on purpose: records, SQLite rows and JSON carry
them unchanged.  Must not: import anything (the qemu hook uses them).
"""

from __future__ import annotations


class Owner:
    """Who holds a device: a domain (its UUID, lower case), a manual command, or the declarative layout.

    ``manual`` and ``layout`` are the *pool* owners: the operator made the
    device for guests, so a domain uses it as it is and never releases it.
    """

    MANUAL = "manual"
    LAYOUT = "layout"
    POOL = (MANUAL, LAYOUT)

    @staticmethod
    def is_pool(owner: str) -> bool:
        return owner in Owner.POOL

    @staticmethod
    def is_domain(owner: str) -> bool:
        """A domain UUID (not a pool owner)."""
        return owner not in Owner.POOL


class Backend:
    """How a GPU serves vGPUs: classic ``mdev`` or NVIDIA's vendor-specific VFIO (``vendor-vfio``, a VF per vGPU).

    The same words name the kind of a vGPU device in domain metadata and
    ``attach`` output (with ``passthrough`` for a whole GPU).
    """

    MDEV = "mdev"
    VENDOR_VFIO = "vendor-vfio"
    ALL = (MDEV, VENDOR_VFIO)


class VgpuState:
    """A vGPU as ``vgpuhost vgpu list`` sees it, host against records.

    ``active``: recorded and present with its type; ``mismatched``: present
    with another type; ``foreign``: present, not made by vgpuhost; ``missing``:
    recorded, gone from the host.
    """

    ACTIVE = "active"
    MISMATCHED = "mismatched"
    FOREIGN = "foreign"
    MISSING = "missing"
