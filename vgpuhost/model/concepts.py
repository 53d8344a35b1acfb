"""The concepts every layer names, as ``str``-valued enums: one spelling each, defined here only.

Owns: the vocabularies that used to travel as bare strings (vGPU backend,
placement strategy, scheduler policy, QoS class, isolation level, owner kind,
plan line kind).  Each member *is* its spelling: ``Backend.MDEV == "mdev"``,
``str()``, ``format()`` and ``json.dumps`` give the value and SQLite stores it
as TEXT, so records, SQLite rows, JSON and tables stay byte-identical to the
strings they replace.  Parse outside input with ``Enum(value)`` (``ValueError``
on an unknown spelling) or :func:`parse`, which raises the project's
:class:`~vgpuhost.model.errors.InputError` naming the choices.

Click choices, the OpenAPI enums and the JSON schema documents are generated
from these enums or tested against them (tests/test_concepts.py); the
architecture test rejects their literals anywhere outside ``model/``
(tests/test_architecture.py).

Copies: the qemu hook's modules (:data:`vgpuhost.io.modbundle.MODULES`) do
not import ``enum``, so they compare with plain-``str`` copies of these
vocabularies: :mod:`vgpuhost.model.kinds` (``Backend``, ``Owner``,
``PlacementStrategy``, ``SchedulerPolicy``, ``QosClass``, ``Isolation``),
which :mod:`vgpuhost.model.tenancy` re-exports (``QOS_CLASSES``,
``ISOLATIONS``; ``POLICY_CLASS`` maps each policy to a class).  tests/test_concepts.py asserts each equals its enum, so
a new member is added here and in its copy, and nowhere else.

Must not: import anything but the standard library and ``model.errors`` (the
qemu hook imports it).
"""

from __future__ import annotations

import enum

from .errors import InputError


class StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value (``enum.StrEnum`` of 3.11, for 3.9+)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls):
        """Every spelling, in definition order (a tuple of ``str``)."""
        return tuple(m.value for m in cls)


class Backend(StrEnum):
    """How a GPU serves vGPUs: classic ``mdev`` or NVIDIA's vendor-specific VFIO (a VF per vGPU; vGPU 17+).

    Source: docs/reference/hardware.md#mdev and #vendor-vfio.
    """

    MDEV = "mdev"
    VENDOR_VFIO = "vendor-vfio"


class DeviceKind(StrEnum):
    """The kind of a device a domain is given, as domain metadata and ``attach`` output name it."""

    MDEV = "mdev"
    VENDOR_VFIO = "vendor-vfio"
    PASSTHROUGH = "passthrough"


class PlacementStrategy(StrEnum):
    """How placement picks a GPU for a request (vgpuhost.policy.placement).

    ``reserve`` and ``headroom`` may refuse a request that fits (opt-in).
    """

    FIRST_FIT = "first-fit"
    BEST_FIT = "best-fit"
    WORST_FIT = "worst-fit"
    SPREAD = "spread"
    RESERVE = "reserve"
    HEADROOM = "headroom"


class SchedulerPolicy(StrEnum):
    """The vGPU time-slice scheduler policy, as ``vgpuhost scheduler set --policy`` spells it.

    Source: NVIDIA vGPU user guide, "Scheduling policies" (docs/reference/hardware.md#vgpu-scheduling).
    """

    BEST_EFFORT = "best-effort"
    EQUAL_SHARE = "equal-share"
    FIXED_SHARE = "fixed-share"


class QosClass(StrEnum):
    """A tenant's or domain's QoS class, strongest first."""

    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BEST_EFFORT = "best-effort"


class Isolation(StrEnum):
    """A tenant's isolation level, weakest first."""

    SHARED = "shared"
    EXCLUSIVE = "exclusive"
    HARDWARE = "hardware"


class OwnerKind(StrEnum):
    """Who holds a device: a domain (by UUID), a manual command, or the declarative layout.

    ``manual`` and ``layout`` are the *pool* owners; a domain owner is recorded as the domain's UUID, so
    :attr:`DOMAIN` names the kind only and never appears in a record.
    """

    DOMAIN = "domain"
    MANUAL = "manual"
    LAYOUT = "layout"


class PlanKind(StrEnum):
    """What a line of a layout plan changes (its ``kind``), in the order docs/guide/layouts.md lists."""

    KERNEL_PARAM = "kernel-param"
    MODULE = "module"
    SRIOV = "sriov"
    MIG_MODE = "mig-mode"
    GPU_INSTANCE = "gpu-instance"
    MIXED_SIZE = "mixed-size"
    SCHEDULER = "scheduler"
    VGPU = "vgpu"
    PASSTHROUGH = "passthrough"


def parse(cls, value, what: str):
    """``cls(value)``, or :class:`InputError` ``"<what> 'x' is not one of a, b, c"`` (exit 2)."""
    try:
        return cls(value)
    except ValueError:
        raise InputError(f"{what} {str(value)[:40]!r} is not one of {', '.join(cls.values())}",
                         hint=f"use one of: {', '.join(cls.values())}") from None


#: every concept enum, for the architecture test and the schema checks
ALL = (Backend, DeviceKind, PlacementStrategy, SchedulerPolicy, QosClass, Isolation, OwnerKind, PlanKind)
