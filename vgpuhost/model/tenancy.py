"""Tenants, quotas, QoS classes and isolation levels as values.

Owns: the vocabulary of multi-tenant sharing (issue 13) and parsing it from
operator input: :class:`Tenant` (name, default QoS class, isolation level,
labels for affinity and anti-affinity), :class:`Quota` (a guaranteed and an
optional burst :class:`Limits` per dimension, plus the allowed vGPU
series), and the parse helpers the CLI uses.  Must not: touch files or the
state store, or decide admission (:mod:`vgpuhost.policy.admission` does).

Quota dimensions (:data:`DIMENSIONS`), each an int or None (no limit):

- ``vgpus``: vGPUs held (time-sliced and MIG-backed);
- ``framebuffer_mib``: framebuffer of those vGPUs, MiB (a passthrough GPU
  is counted in ``passthrough_gpus``, not here);
- ``mig_slices``: compute slices of the GPU instances behind MIG-backed
  vGPUs (the ``1`` of ``H200X-1-18C``);
- ``passthrough_gpus``: whole GPUs passed through.

Use up to the guaranteed limit is *guaranteed*; use above it, up to the
burst limit, is admitted only from free capacity and marked *burst*.  A
dimension with no burst limit allows no burst.
"""

from __future__ import annotations


from .errors import InputError
from .kinds import Isolation, QosClass, SchedulerPolicy
from .values import field, is_digits, is_name, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, FrozenSet, Iterable, Mapping, Optional, Tuple

# model/kinds' plain copies of vgpuhost.model.concepts.QosClass and Isolation (the qemu hook does not
# import enum); tests/test_concepts.py asserts they equal the enums' values.
#: QoS classes, strongest first
GUARANTEED, BURSTABLE, BEST_EFFORT = QosClass.GUARANTEED, QosClass.BURSTABLE, QosClass.BEST_EFFORT
QOS_CLASSES = QosClass.ALL
#: isolation levels, weakest first
SHARED, EXCLUSIVE, HARDWARE = Isolation.SHARED, Isolation.EXCLUSIVE, Isolation.HARDWARE
ISOLATIONS = Isolation.ALL
#: scheduler policies (as ``vgpuhost scheduler set --policy`` spells them) and the QoS class each serves best
POLICY_CLASS = {SchedulerPolicy.FIXED_SHARE: GUARANTEED, SchedulerPolicy.EQUAL_SHARE: BURSTABLE,
                SchedulerPolicy.BEST_EFFORT: BEST_EFFORT}

DIMENSIONS = ("vgpus", "framebuffer_mib", "mig_slices", "passthrough_gpus")
DIMENSION_TEXT = {"vgpus": "vGPUs", "framebuffer_mib": "framebuffer MiB", "mig_slices": "MIG compute slices",
                  "passthrough_gpus": "passthrough GPUs"}
SERIES = ("A", "B", "C", "Q")

DEFAULT_QOS = BURSTABLE
DEFAULT_ISOLATION = SHARED
#: the class of a domain that names no tenant
UNTENANTED_QOS = BEST_EFFORT
#: how text tables name the use of devices with no tenant (manual and layout vGPUs, domains naming none);
#: it cannot be a tenant name.  JSON documents carry null there (``vgpuhost.usage/v1`` keeps ``(none)``),
#: Prometheus labels ``tenant=""``.
NO_TENANT = "(no tenant)"

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}\Z"     # as domain metadata's tenant= (libvirt/domxml)
_NAME_EXTRA = frozenset("_.:+-")
_LABEL_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,31}=[A-Za-z0-9_.:-]{1,63}$"


@record(frozen=True)
class Limits:
    """One limit per quota dimension; None = no limit."""

    vgpus: Optional[int] = None
    framebuffer_mib: Optional[int] = None
    mig_slices: Optional[int] = None
    passthrough_gpus: Optional[int] = None

    def get(self, dim: str) -> Optional[int]:
        return getattr(self, dim)

    @property
    def empty(self) -> bool:
        return all(self.get(d) is None for d in DIMENSIONS)


@record(frozen=True)
class Quota:
    """``guaranteed`` and ``burst`` limits per dimension and the allowed series.

    ``burst.get(d)``, when set, is at least ``guaranteed.get(d)`` (checked by
    :meth:`validate`).  ``series``: allowed vGPU series letters (``C``,
    ``Q``, ...); empty = every series.
    """

    guaranteed: Limits = field(default_factory=Limits)
    burst: Limits = field(default_factory=Limits)
    series: FrozenSet[str] = frozenset()

    def ceiling(self, dim: str) -> Optional[int]:
        """The most the tenant may hold in ``dim`` (burst limit, else guaranteed; None = unlimited)."""
        g, b = self.guaranteed.get(dim), self.burst.get(dim)
        if g is None:
            return None
        return b if b is not None else g

    def validate(self) -> "Quota":
        """Returns self; raises InputError for a negative limit, a burst below its guarantee or
        without one, or an unknown series."""
        for d in DIMENSIONS:
            g, b = self.guaranteed.get(d), self.burst.get(d)
            for v in (g, b):
                if v is not None and (not isinstance(v, int) or v < 0):
                    raise InputError(f"quota {DIMENSION_TEXT[d]}: {v!r} is not a count >= 0")
            if b is not None and g is None:
                raise InputError(f"quota {DIMENSION_TEXT[d]}: a burst limit ({b}) needs a guaranteed limit",
                                 hint="give both as GUARANTEED:BURST, e.g. 4:6")
            if b is not None and b < g:
                raise InputError(f"quota {DIMENSION_TEXT[d]}: burst limit {b} is below the guaranteed {g}",
                                 hint="the burst limit is the most the tenant may hold, guaranteed included")
        for s in self.series:
            if s not in SERIES:
                raise InputError(f"unknown vGPU series {s!r}", hint="one or more of " + ", ".join(SERIES))
        return self

    def text(self, dim: str) -> str:
        """``4``, ``4:6`` (guaranteed:burst) or ``-`` (no limit)."""
        return limit_text(self.guaranteed.get(dim), self.burst.get(dim))


def limit_text(guaranteed: Optional[int], burst: Optional[int]) -> str:
    """A quota dimension as operators type it: ``4``, ``4:6`` (guaranteed:burst), ``0``, or ``-`` (no limit)."""
    if guaranteed is None:
        return "-"
    return f"{guaranteed}:{burst}" if burst is not None and burst != guaranteed else str(guaranteed)


def usage_text(used: int, burst: int, guaranteed: Optional[int], limit: Optional[int]) -> str:
    """One dimension of ``tenant usage``: ``USED/QUOTA`` with notes in brackets.

    ``used``: what the tenant holds; ``burst``: the part of it above the
    guaranteed limit now (:func:`vgpuhost.policy.admission.usage` with the quota); ``guaranteed``/``limit``: the guaranteed limit and the ceiling
    (burst limit, else the guaranteed one), None for no limit.  QUOTA is
    written as in ``tenant list`` (``1:2``, ``0``).  Without a limit there is
    nothing to burst above or exceed, so only ``used`` is written.  With one,
    the notes are the burst part (``1 burst``) and, where use passes the
    ceiling (a quota lowered below what running domains hold; vgpuhost never
    stops a VM), ``N over quota``: ``2/1:2 (1 burst)``, ``2/0 (2 over quota)``.
    """
    if guaranteed is None or limit is None:
        return str(used)
    notes = []
    if burst:
        notes.append(f"{burst} burst")
    if used > limit:
        notes.append(f"{used - limit} over quota")
    text = f"{used}/{limit_text(guaranteed, limit)}"
    return text + (f" ({', '.join(notes)})" if notes else "")


@record(frozen=True)
class Tenant:
    """A tenant: who shares the host, on what terms.

    ``qos``: default QoS class of its domains (a domain's metadata may
    override it); ``isolation``: :data:`ISOLATIONS`; ``labels``:
    ``key=value`` strings describing it (``env=prod``); ``avoid``: labels
    whose holders must never share a time-sliced GPU with this tenant
    (anti-affinity, enforced both ways); ``prefer``: labels whose holders'
    GPUs it prefers (affinity, a preference only).
    """

    name: str
    qos: str = DEFAULT_QOS
    isolation: str = DEFAULT_ISOLATION
    quota: Quota = field(default_factory=Quota)
    labels: FrozenSet[str] = frozenset()
    avoid: FrozenSet[str] = frozenset()
    prefer: FrozenSet[str] = frozenset()

    def validate(self) -> "Tenant":
        """Returns self; raises InputError naming the bad field."""
        check_name(self.name)
        check_choice("QoS class", self.qos, QOS_CLASSES)
        check_choice("isolation", self.isolation, ISOLATIONS)
        self.quota.validate()
        for lab in (*self.labels, *self.avoid, *self.prefer):
            check_label(lab)
        return self

    def conflicts(self, other: "Optional[Tenant]") -> Optional[str]:
        """Why this tenant's time-sliced vGPUs may not share a GPU with ``other``'s (None: they may).

        ``other`` None is a domain with no tenant.  Same tenant: never a conflict.
        """
        if other is not None and other.name == self.name:
            return None
        if self.isolation == EXCLUSIVE:
            return f"tenant {self.name!r} is exclusive: its time-sliced GPUs hold no vGPUs of " + (
                f"tenant {other.name!r}" if other is not None else
                "no tenant (the layout's free vGPUs, vGPUs made by hand, those of domains naming no tenant)")
        who = f"tenant {other.name!r}" if other is not None else "no tenant"
        if other is None:
            return None
        if other.isolation == EXCLUSIVE:
            return f"{who} is exclusive: its time-sliced GPUs hold no other tenant's vGPUs"
        hit = sorted(self.avoid & other.labels)
        if hit:
            return f"tenant {self.name!r} avoids {hit[0]} ({who} has it)"
        hit = sorted(other.avoid & self.labels)
        if hit:
            return f"{who} avoids {hit[0]} (tenant {self.name!r} has it)"
        return None


def tenant_named(tenants: "Mapping[str, Tenant]", name: Optional[str]) -> Optional[Tenant]:
    """The tenant called ``name`` in ``tenants`` (by name), None for None or an unknown name; names match
    case-insensitively, as the state store matches them (tenant names are ASCII)."""
    if name is None:
        return None
    t = tenants.get(name)
    if t is None:
        low = name.lower()
        t = next((v for k, v in tenants.items() if k.lower() == low), None)
    return t


# ---------------------------------------------------------------------------
# parsing operator input

def check_name(name: str) -> str:
    if not is_name(name, _NAME_EXTRA):         # _NAME_PATTERN, checked by hand (the qemu hook imports no re)
        raise InputError(f"invalid tenant name {str(name)[:80]!r}",
                         hint="letters, digits and _.:+- only, at most 64 characters")
    return name


def check_label(label: str) -> str:
    import re
    if not isinstance(label, str) or not re.match(_LABEL_PATTERN, label):
        raise InputError(f"invalid label {str(label)[:80]!r}",
                         hint="key=value: a lower-case key (a-z0-9_.-) and a value (A-Za-z0-9_.:-), e.g. env=prod")
    return label


def check_choice(what: str, value: str, choices: Iterable[str]) -> str:
    if value not in choices:
        raise InputError(f"unknown {what} {str(value)[:80]!r}", hint="one of " + ", ".join(choices))
    return value


def parse_count(text: str, what: str, *, mib: bool = False) -> int:
    """A count ``>= 0``; with ``mib`` also ``24G``/``24GiB``/``512M``/``512MiB`` (plain numbers are MiB)."""
    raw = text.strip()
    scale = 1
    if mib:
        import re
        m = re.match(r"^([0-9]+)\s*(G|GiB|GB|M|MiB|MB)?$", raw, re.IGNORECASE | re.ASCII)
        if m:
            raw = m.group(1)
            scale = 1024 if (m.group(2) or "M").upper().startswith("G") else 1
    if is_digits(raw) and len(raw) > 9:
        raise InputError(f"{what}: {text[:40]!r} is too large (at most 999999999)",
                         hint="GUARANTEED or GUARANTEED:BURST, e.g. 4 or 4:6; 'none' for no limit")
    if not is_digits(raw):          # ASCII digits only: not ² (int refuses it), not ٣
        unit = " (MiB, or with a G/M suffix)" if mib else ""
        raise InputError(f"{what}: {text[:40]!r} is not a count{unit}",
                         hint="GUARANTEED or GUARANTEED:BURST, e.g. 4 or 4:6; 'none' for no limit")
    return int(raw) * scale


def parse_limit(text: str, what: str, *, mib: bool = False) -> Tuple[Optional[int], Optional[int]]:
    """``4`` -> (4, None); ``4:6`` -> (4, 6); ``none`` -> (None, None)."""
    raw = text.strip()
    if raw.lower() in ("none", "-", ""):
        return None, None
    g, sep, b = raw.partition(":")
    if ":" in b:
        raise InputError(f"{what}: {text[:40]!r} is not a limit",
                         hint="GUARANTEED or GUARANTEED:BURST, e.g. 4 or 4:6; 'none' for no limit")
    return parse_count(g, what, mib=mib), (parse_count(b, what, mib=mib) if sep else None)


def parse_series(text: str) -> FrozenSet[str]:
    """``C`` / ``C,Q`` / ``all`` -> the series letters (empty = every series)."""
    raw = text.strip()
    if raw.lower() in ("all", "any", "none", ""):
        return frozenset()
    import re
    out = set()
    for part in re.split(r"[,\s]+", raw):
        if part:
            out.add(check_choice("vGPU series", part.upper(), SERIES))
    return frozenset(out)


def with_limits(quota: Quota, changes: Dict[str, Tuple[Optional[int], Optional[int]]]) -> Quota:
    """``quota`` with the dimensions in ``changes`` (dim -> (guaranteed, burst)) replaced."""
    from .values import replace
    g = replace(quota.guaranteed, **{d: v[0] for d, v in changes.items()})
    b = replace(quota.burst, **{d: v[1] for d, v in changes.items()})
    return replace(quota, guaranteed=g, burst=b)


def labels_text(labels: Iterable[str]) -> str:
    return ",".join(sorted(labels))


def parse_labels(text: Optional[str]) -> FrozenSet[str]:
    """``a=b,c=d`` (as stored) -> the labels."""
    return frozenset(x for x in (text or "").split(",") if x)
