"""GPU health: which signals take a GPU out of service, and the line that says why (pure).

Owns: the critical Xid table (:data:`CRITICAL_XIDS`, each with its source),
the errnos of a device write or read that mean the GPU itself failed
(:data:`UNHEALTHY_ERRNOS`), the sources of a health row (:class:`Source`) and
the reason lines.  Must not: read or write anything (:mod:`vgpuhost.ops.health`
reads NVML, the tree and the state store and records transitions).

Sources (docs/guide/failures.md#signals):

- EIO / ENODEV from a device write or read: the kernel's answer when the
  driver could not reach the GPU (an mdev ``create``, ``current_vgpu_type``,
  a driver bind).  EINVAL, ENOSPC, EBUSY, EPERM, EEXIST are refusals of the
  request and say nothing about the GPU.
- NVML ``NVML_ERROR_GPU_IS_LOST`` (15): "the GPU has fallen off the bus or
  has otherwise become inaccessible" (NVML API reference, nvmlReturn_t).
- A critical Xid through NVML's event API (``nvmlEventTypeXidCriticalError``,
  NVML API reference, Event Types): the Xid numbers below, from NVIDIA's Xid
  catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) and
  the public reports that motivated this (NVIDIA/NVSentinel#155,
  leptonai/gpud#604: Xid 79 and GPU_IS_LOST).
- A GPU that disappears from the PCI tree (``/sys/bus/pci/devices/BDF``
  gone: hot removal, or the kernel removing a device that fell off the bus).
"""

from __future__ import annotations

import errno

from ..model.values import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, Optional, Tuple


class Source:
    """Where a health row came from (the ``source`` column; plain strings, the hook imports no enum)."""

    IO = "io"               #: EIO/ENODEV from a device write or read
    NVML = "nvml"           #: NVML GPU_IS_LOST or a critical Xid
    PCI = "pci"             #: gone from the PCI tree
    OPERATOR = "operator"   #: cordoned by hand

    ALL = (IO, NVML, PCI, OPERATOR)


#: errnos of a device write or read that mean the GPU failed (not that the request was refused)
UNHEALTHY_ERRNOS = frozenset({errno.EIO, errno.ENODEV})

#: NVML's return code name for a lost GPU (pynvml: ``NVMLError_GpuIsLost``; NVML_ERROR_GPU_IS_LOST = 15)
GPU_IS_LOST = "NVMLError_GpuIsLost"

#: Xid -> (what NVIDIA's catalog calls it, why vgpuhost takes the GPU out of service, source).
#: Source: NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, Ampere and newer),
#: whose "Resolution Bucket" for each is RESET_GPU, RESTART_BM or worse; 94 (contained ECC) is taken out too:
#: the catalog asks to restart the application, and on a vGPU host the application is a VM that vgpuhost
#: cannot restart, so no new VM is placed there until an operator has looked (uncordon).
CRITICAL_XIDS: "Dict[int, Tuple[str, str]]" = {
    48: ("double bit ECC error (DBE)", "uncorrectable memory error; NVIDIA: reset the GPU, RMA on recurrence"),
    62: ("internal micro-controller halt", "NVIDIA: reset the GPU"),
    64: ("ECC page retirement or row remapping failure", "failing memory; NVIDIA: reset the GPU, RMA on recurrence"),
    74: ("NVLink error", "NVIDIA: reset the GPU (link hardware)"),
    79: ("GPU has fallen off the bus", "unreachable on PCIe; NVIDIA: reboot the node, RMA on recurrence"),
    94: ("contained ECC error", "the GPU contained an uncorrectable error in a VM's memory; NVIDIA: restart it"),
    95: ("uncontained ECC error", "NVIDIA: reset the GPU"),
    119: ("GSP RPC timeout", "the GPU System Processor stopped answering; NVIDIA: reset the GPU"),
    120: ("GSP error", "NVIDIA: reset the GPU"),
    140: ("unrecovered ECC error", "NVIDIA: reset the GPU"),
    154: ("GPU recovery action changed", "the driver asks for a GPU reset or node reboot"),
}


def is_unhealthy_errno(err: "Optional[int]") -> bool:
    """Does this errno from a device write or read mean the GPU failed (EIO, ENODEV)?"""
    return err in UNHEALTHY_ERRNOS


def write_failure(err: "Optional[int]", nvml_name: "Optional[str]") -> "Optional[str]":
    """The :class:`Source` when a failed device write means the GPU itself failed, else None (the write
    was refused for the request): a kernel write's errno (``err``) in :data:`UNHEALTHY_ERRNOS`
    (:func:`is_unhealthy_errno`) is ``io``; an NVML call's error name (``nvml_name``, e.g.
    ``NVMLError_GpuIsLost``) :data:`GPU_IS_LOST` is ``nvml``."""
    if nvml_name is not None:
        return Source.NVML if nvml_name == GPU_IS_LOST else None
    return Source.IO if is_unhealthy_errno(err) else None


def errno_reason(err: int, gpu: PciAddress, what: str) -> str:
    """The health row's reason for ``what`` (``creating A40-8Q``) failing with ``err`` on ``gpu``."""
    return f"{what} on {gpu} failed: {errno.errorcode.get(err, str(err))}"


def xid_reason(xid: int) -> str:
    """``Xid 79 (GPU has fallen off the bus)``; an Xid not in :data:`CRITICAL_XIDS` is named by number."""
    name = CRITICAL_XIDS.get(xid, ("critical Xid", ""))[0]
    return f"Xid {xid} ({name})"


def is_critical_xid(xid: int) -> bool:
    return xid in CRITICAL_XIDS


LOST_REASON = "NVML: GPU_IS_LOST (the GPU fell off the bus or became inaccessible)"
GONE_REASON = "gone from the PCI tree"

#: at most this many characters of a cordon's ``--reason`` (one line of printable text)
REASON_MAX = 512


def reason_problem(reason: str) -> "Optional[str]":
    """Why ``reason`` (a cordon's ``--reason``, already stripped) is refused, None when it is one line of
    printable text of at most :data:`REASON_MAX` characters (a newline, tab, escape or bidi override:
    anything ``str.isprintable`` refuses)."""
    if len(reason) > REASON_MAX:
        return f"--reason is over {REASON_MAX} characters ({len(reason)})"
    bad = next((i for i, ch in enumerate(reason) if not ch.isprintable()), None)
    if bad is not None:
        return f"--reason has a control character (U+{ord(reason[bad]):04X} at character {bad + 1})"
    return None
