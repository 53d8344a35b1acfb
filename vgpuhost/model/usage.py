"""One hourly usage rollup row: what the metering sampler bills for a device, a domain and a tenant in one UTC hour.

Owns: :class:`UsageRow`, the named record of a ``usage_hourly`` row of the
state store (:func:`vgpuhost.io.state.usage_rows` returns them,
:func:`vgpuhost.io.state.add_usage` adds them), and :data:`USAGE_COLUMNS`,
its fields, which are the table's columns in order.  A ``UsageRow`` is a
tuple, so SQLite takes it as the row's parameters unchanged and code that
indexes a row still reads the same value.  Must not: touch the store; be
imported on the qemu hook's path (``typing``).

Units: seconds (``alloc_s`` and the busy seconds), bytes (framebuffer), a
count (``samples``).
"""

from __future__ import annotations

from typing import NamedTuple


class UsageRow(NamedTuple):
    """One (hour, device, domain, tenant) rollup; an empty ``tenant`` or ``qos``: none."""

    hour: str               # the UTC hour, "2026-12-01T14:00:00Z"
    device: str             # mdev UUID, VF BDF or (passthrough) GPU BDF
    domain_uuid: str
    kind: str               # "vgpu", "mig-vgpu" or "passthrough"
    gpu: str                # the GPU's PCI address
    profile: str            # the vGPU type name
    domain: str             # the domain's name ("": not known; reports show the UUID)
    tenant: str
    qos: str
    alloc_s: float          # seconds allocated to the domain in the hour
    sm_busy_s: float        # seconds of SM time, encoder and decoder time it used
    enc_busy_s: float
    dec_busy_s: float
    fb_peak_bytes: int      # framebuffer peak in the hour (0 but in the last hour of a sample's span)
    fb_total_bytes: int     # the device's framebuffer
    samples: int            # sampler readings that went into the row


#: what a metered device is (``UsageRow.kind``): a time-sliced vGPU, a MIG-backed vGPU, a passed-through GPU
METERED_KINDS = ("vgpu", "mig-vgpu", "passthrough")

#: the ``usage_hourly`` columns, in table order
USAGE_COLUMNS = UsageRow._fields
