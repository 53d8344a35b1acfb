"""Usage reports and right-sizing advice from metering rollups (pure functions).

Owns: :func:`aggregate` (chargeback totals per tenant, domain or profile
over hourly rollup rows) and :func:`advise` (which VMs fit a smaller
profile, which guaranteed vGPUs sit idle, and how many more VMs those
changes would admit).  Must not: read the store, sysfs or NVML: callers pass
rows (:class:`~vgpuhost.model.usage.UsageRow`, or tuples in its field order)
and the profiles a host offers.

Units: seconds, bytes; ``sm_share`` is busy seconds / allocated seconds, the
average fraction of a GPU's SM time the device used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..model.concepts import DeviceKind, QosClass
from ..model.usage import UsageRow
from ..model.values import VgpuProfile
from .when import parse_when  # noqa: F401  (re-exported: the one parser of points in time)

BY = ("tenant", "domain", "profile", "hour")
#: advice keeps this much framebuffer headroom over the observed peak
FB_HEADROOM = 1.25
#: a guaranteed vGPU below this average SM share over the window is idle
IDLE_SM_SHARE = 0.01
MIB = 1024 * 1024
#: the key of rows with no tenant in ``--by tenant`` totals (``vgpuhost.usage/v1`` JSON and CSV carry it;
#: tables print :data:`vgpuhost.model.tenancy.NO_TENANT`); it cannot be a tenant name
NONE_KEY = "(none)"
#: the key of ``--by tenant`` totals of devices no domain held (a layout's idle pool vGPUs, a GPU only prepared
#: for passthrough): the operator's idle capacity, apart from the use of domains naming no tenant
IDLE_KEY = "(idle)"


@dataclass(frozen=True)
class UsageTotal:
    """One line of a usage report (seconds; ``gpu_hours`` = allocated seconds / 3600)."""

    key: str
    alloc_s: float
    sm_busy_s: float
    enc_busy_s: float
    dec_busy_s: float
    fb_peak_bytes: int
    devices: int
    hours: int
    #: ``by="domain"``: the domain's UUID ("": a device no domain held) and the tenant its rows were billed to
    domain_uuid: str = ""
    tenant: str = ""

    @property
    def gpu_hours(self) -> float:
        return self.alloc_s / 3600.0


def _domain(row: UsageRow) -> str:
    """The domain a report names: its name, or its UUID when the row has no name."""
    return row.domain or row.domain_uuid


def aggregate(rows: Iterable[Sequence], by: str) -> List[UsageTotal]:
    """Totals per ``by`` (``tenant``, ``domain`` or ``profile``: largest allocation first; ``hour``: the
    UTC hour, ``2026-11-29T10:00:00Z``, in time order).

    An empty tenant is reported as :data:`NONE_KEY`; ``by="tenant"`` reports the rows of devices no
    domain held (an empty ``domain_uuid``) as :data:`IDLE_KEY`.  ``by="domain"`` keeps one total per domain
    UUID and tenant (two domains of one name, or a domain that passed to another tenant, are
    separate totals), ``key`` the domain's newest name (its UUID where it has none; :data:`IDLE_KEY`
    for devices no domain held, as ``by="tenant"`` names them), with ``domain_uuid`` and ``tenant``.  Raises ValueError for
    another ``by``.
    """
    if by not in BY:
        raise ValueError(f"by must be one of {BY}")
    acc: Dict[object, list] = {}
    devs: Dict[object, set] = {}
    hours: Dict[object, set] = {}
    names: Dict[object, Tuple[str, str]] = {}
    for raw in rows:
        r = UsageRow._make(raw)
        if by == "domain":
            key: object = (r.domain_uuid, r.tenant)
            if key not in names or r.hour >= names[key][0]:
                names[key] = (r.hour, (_domain(r) or NONE_KEY) if r.domain_uuid else IDLE_KEY)
        else:
            key = {"tenant": r.tenant if r.domain_uuid else IDLE_KEY, "profile": r.profile,
                   "hour": r.hour}[by] or NONE_KEY
        a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0])
        a[0] += r.alloc_s
        a[1] += r.sm_busy_s
        a[2] += r.enc_busy_s
        a[3] += r.dec_busy_s
        a[4] = max(a[4], int(r.fb_peak_bytes))
        devs.setdefault(key, set()).add((r.device, r.domain_uuid))
        hours.setdefault(key, set()).add(r.hour)
    out = [UsageTotal(names[k][1] if by == "domain" else k, a[0], a[1], a[2], a[3], a[4], len(devs[k]),
                      len(hours[k]), *(k if by == "domain" else ("", ""))) for k, a in acc.items()]
    if by == "hour":
        return sorted(out, key=lambda t: t.key)
    return sorted(out, key=lambda t: (-t.alloc_s, t.key, t.domain_uuid, t.tenant))


@dataclass(frozen=True)
class Offer:
    """A profile a host offers: name, framebuffer (MiB), max instances per GPU (None: unknown)."""

    name: str
    framebuffer_mib: int
    max_instances: Optional[int]


@dataclass
class _Use:
    """One (device, domain)'s use over the window: the labels of its newest row, seconds summed,
    the framebuffer peak (bytes) and its newest known framebuffer size (bytes)."""

    newest: UsageRow
    alloc_s: float = 0.0
    sm_busy_s: float = 0.0
    fb_peak_bytes: int = 0
    fb_total_bytes: int = 0

    def add(self, row: UsageRow) -> None:
        self.newest = row
        self.alloc_s += row.alloc_s
        self.sm_busy_s += row.sm_busy_s
        self.fb_peak_bytes = max(self.fb_peak_bytes, int(row.fb_peak_bytes))
        self.fb_total_bytes = row.fb_total_bytes or self.fb_total_bytes


@dataclass(frozen=True)
class Advice:
    """Right-sizing of one (device, domain) over the window.

    ``action``: ``downsize`` (``to`` names the smaller profile), ``idle``
    (a guaranteed vGPU that was not used) or ``keep``.
    """

    device: str
    domain: str
    tenant: str
    gpu: str
    profile: str
    action: str
    to: Optional[str]
    fb_peak_bytes: int
    fb_total_bytes: int
    sm_share: float
    reason: str


def advise(rows: Iterable[Sequence], offers: Sequence[Offer], *, min_alloc_s: float = 3600.0,
           admits: Optional[Callable[[str, str, int, Optional[str]], int]] = None
           ) -> Tuple[List[Advice], Dict[str, int]]:
    """Advice per (device, domain) allocated at least ``min_alloc_s`` in the rows.

    A vGPU fits a smaller profile of the same board and series when its
    framebuffer peak x :data:`FB_HEADROOM` fits the smaller framebuffer and
    its average SM share is at most the smaller profile's equal share
    (1 / max instances).  A ``guaranteed`` vGPU whose SM share is below
    :data:`IDLE_SM_SHARE` is ``idle``.  Passthrough GPUs get no advice
    (the host cannot see their use).

    Returns ``(advice, more)``: ``more`` is ``{profile: n}``, how many more
    VMs of that profile the framebuffer freed would hold, per GPU; with
    ``admits`` (tenancy in use), per GPU only as many as
    ``admits(gpu, profile, n, tenant)`` says admission would admit there
    once the advice is followed (``tenant``: whose devices freed the room,
    None for none; the caller may ask for another tenant instead).
    """
    per: Dict[Tuple[str, str], _Use] = {}
    for raw in rows:
        r = UsageRow._make(raw)
        if r.kind == DeviceKind.PASSTHROUGH:
            continue
        per.setdefault((r.device, r.domain_uuid), _Use(r, fb_total_bytes=r.fb_total_bytes)).add(r)
    by_name = {o.name.upper(): o for o in offers}
    out: List[Advice] = []
    freed: Dict[Tuple[str, str, str], int] = {}     # (gpu, profile to fill, tenant) -> MiB freed
    for (device, _u), use in sorted(per.items(), key=lambda item: item[0]):
        if use.alloc_s < min_alloc_s:
            continue
        last = use.newest
        share = use.sm_busy_s / use.alloc_s if use.alloc_s else 0.0
        prof = VgpuProfile.try_parse(last.profile)
        cur = by_name.get(last.profile.upper())
        cur_mib = cur.framebuffer_mib if cur else (use.fb_total_bytes // MIB)
        base = dict(device=device, domain=_domain(last), tenant=last.tenant, gpu=last.gpu, profile=last.profile,
                    fb_peak_bytes=use.fb_peak_bytes, fb_total_bytes=use.fb_total_bytes, sm_share=share)
        if last.qos == QosClass.GUARANTEED and share < IDLE_SM_SHARE:
            out.append(Advice(**base, action="idle", to=None,
                              reason=f"guaranteed vGPU used {share:.1%} of SM time over "
                                     f"{use.alloc_s / 3600:.1f} h: release it or move it to best-effort"))
            key = (last.gpu, last.profile, last.tenant or "")
            freed[key] = freed.get(key, 0) + cur_mib
            continue
        best: Optional[Offer] = None
        if prof is not None:
            for o in offers:
                p = VgpuProfile.try_parse(o.name)
                if (p is None or p.board != prof.board or p.series != prof.series
                        or p.gi_slices != prof.gi_slices or o.framebuffer_mib >= cur_mib):
                    continue
                if use.fb_peak_bytes * FB_HEADROOM > o.framebuffer_mib * MIB:
                    continue
                if o.max_instances and share > 1.0 / o.max_instances:
                    continue
                if best is None or o.framebuffer_mib < best.framebuffer_mib:
                    best = o
        if best is None:
            out.append(Advice(**base, action="keep", to=None, reason="no smaller profile fits its peak and SM use"))
            continue
        out.append(Advice(**base, action="downsize", to=best.name,
                          reason=f"framebuffer peak {use.fb_peak_bytes / MIB:.0f} MiB and SM share {share:.1%} fit "
                                 f"{best.name} ({best.framebuffer_mib} MiB)"))
        key = (last.gpu, best.name, last.tenant or "")
        freed[key] = freed.get(key, 0) + cur_mib - best.framebuffer_mib
    more: Dict[str, int] = {}
    for (gpu, name, tenant), mib in sorted(freed.items()):
        o = by_name.get(name.upper())
        if o and o.framebuffer_mib:
            n = mib // o.framebuffer_mib
            if n and admits is not None:
                n = min(n, admits(gpu, o.name, n, tenant or None))
            if n:
                more[o.name] = more.get(o.name, 0) + n
    return out, more
