"""The small vocabularies every layer shares, as plain string constants for the qemu hook's modules.

Owns: the plain-``str`` copies of the concepts of :mod:`vgpuhost.model.concepts`
(who owns a device, which vGPU backend, placement strategy, scheduler
policy, QoS class, isolation level) and a vGPU's state, as the state store records them and every
output (tables, ``--json``, audit rows, domain metadata) prints them.
The enums are the definition; these copies exist because the hook's
modules (:data:`vgpuhost.io.modbundle.MODULES`) must not pay for importing
``enum`` (about 1 ms a hook start), and tests/test_concepts.py asserts each
copy equals its enum's values, so they cannot drift.  Code outside the
hook's closure uses the enums.  Must not: import anything (the qemu hook
uses them).
"""

from __future__ import annotations


class Owner:
    """Who holds a device: a domain (its UUID, lower case), a manual command, or the declarative layout
    (:class:`vgpuhost.model.concepts.OwnerKind`).

    ``manual`` and ``layout`` are the *pool* owners: the operator made the
    device for guests, so a domain uses it as it is and never releases it.
    """

    DOMAIN = "domain"       # the kind only: a domain owner is recorded as the domain's UUID
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
    """How a GPU serves vGPUs: classic ``mdev`` or NVIDIA's vendor-specific VFIO (``vendor-vfio``, a VF per vGPU)
    (:class:`vgpuhost.model.concepts.Backend`).

    The same words name the kind of a vGPU device in domain metadata and
    ``attach`` output (with ``passthrough`` for a whole GPU).
    """

    MDEV = "mdev"
    VENDOR_VFIO = "vendor-vfio"
    ALL = (MDEV, VENDOR_VFIO)


class PlacementStrategy:
    """How placement picks a GPU (:class:`vgpuhost.model.concepts.PlacementStrategy`; vgpuhost.policy.placement).

    :data:`FITTING` place any request that fits; :data:`RESERVING` may
    refuse one that fits (opt-in).  :data:`OFFERED`: what the CLI's
    ``--strategy``, the agent and domain metadata accept (``reserve`` stays
    API-only: see docs/performance.md).
    """

    FIRST_FIT = "first-fit"
    BEST_FIT = "best-fit"
    WORST_FIT = "worst-fit"
    SPREAD = "spread"
    RESERVE = "reserve"
    HEADROOM = "headroom"
    ALL = (FIRST_FIT, BEST_FIT, WORST_FIT, SPREAD, RESERVE, HEADROOM)
    FITTING = (FIRST_FIT, BEST_FIT, WORST_FIT, SPREAD)
    RESERVING = (RESERVE, HEADROOM)
    OFFERED = FITTING + (HEADROOM,)
    DEFAULT = FIRST_FIT


class SchedulerPolicy:
    """The vGPU time-slice scheduler policy (:class:`vgpuhost.model.concepts.SchedulerPolicy`)."""

    BEST_EFFORT = "best-effort"
    EQUAL_SHARE = "equal-share"
    FIXED_SHARE = "fixed-share"
    ALL = (BEST_EFFORT, EQUAL_SHARE, FIXED_SHARE)


class QosClass:
    """A tenant's or domain's QoS class, strongest first (:class:`vgpuhost.model.concepts.QosClass`).

    Here, not only in :mod:`vgpuhost.model.tenancy`, because domain metadata (libvirt/domxml.py) checks
    it on every hook start, where tenancy is imported only on a host with tenants.
    """

    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BEST_EFFORT = "best-effort"
    ALL = (GUARANTEED, BURSTABLE, BEST_EFFORT)


class Isolation:
    """A tenant's isolation level, weakest first (:class:`vgpuhost.model.concepts.Isolation`)."""

    SHARED = "shared"
    EXCLUSIVE = "exclusive"
    HARDWARE = "hardware"
    ALL = (SHARED, EXCLUSIVE, HARDWARE)


class VgpuState:
    """A vGPU as ``vgpuhost vgpu list`` sees it, host against records.

    ``active``: recorded and present with its type; ``mismatched``: present
    with another type; ``foreign``: present, not made by vgpuhost; ``missing``:
    recorded, gone from the host; ``removing``: recorded, its removal pending
    (an open journal entry: its write blocked by a holder, or its writer
    ended unanswered), present or not: ``vgpuhost reconcile`` finishes it.
    """

    ACTIVE = "active"
    MISMATCHED = "mismatched"
    FOREIGN = "foreign"
    MISSING = "missing"
    REMOVING = "removing"
