"""Capacity that follows demand: which empty GPUs move to which pool, and the demand that says so.

Owns: the reconciler's settings and operator bounds (:class:`Bounds`, read from the rebalance
config by :func:`parse_bounds`, strict: one :class:`~vgpuhost.model.errors.InputError` line naming
the field), the refusals it weighs (:func:`refusal_of`: what admission stored for a start it refused,
in its own columns -> :class:`Refusal`; :func:`distinct_starts`: one per domain and profile), the facts it decides on (:class:`GpuFacts`, :class:`Trend`), the
forecast of each pool's need (:func:`pool_history`, :func:`growth`, :class:`Outlook`), and the
decision itself (:func:`decide` -> :class:`Decision` of :class:`Move` values).  Must not: read the
host, the state store or the clock; callers (:mod:`vgpuhost.ops.rebalance`) build the inputs and
run the moves as a plan through the Executor.

The rule (docs/guide/rebalance.md):

- **Demand** is what admission refused for want of room (codes ``capacity`` and ``gpu-time``,
  and ``pool`` where no pool serving the class has a GPU offering the profile) within the last
  ``window_min`` minutes, grouped by profile and QoS class, less those a move already answered
  (:func:`pending`: refused before the last move that named their group) and those a pool serving
  them has an empty GPU for now, plus a pool that is *pressed*: every
  GPU of it holds something and its metered allocated time rose over the last ``trend_hours``
  (:class:`Trend`).
- **Only empty GPUs move**: a GPU holding a vGPU (any owner, made or recorded), an allocation, a
  passthrough binding, in MIG mode or out of service is never a candidate (:attr:`GpuFacts.busy`).
- **Need**: each pool's GPUs holding something plus the GPUs its pending refused starts would take
  (:class:`Outlook` ``now``), and that times the growth the metered history forecasts over
  ``horizon_h`` hours (:func:`growth`: the same hours of the previous days, else the trend;
  ``ahead``).  A pool whose need ahead passes its GPUs gets empty GPUs before its starts are refused.
- **A donor** is a pool above its ``min`` (a declared pool keeps at least one GPU: its GPUs are
  what declares it) that keeps its need after the move, and whose allocated time is not rising
  unless it keeps another empty GPU; a GPU a move of the window put in that pool is held there
  (``moved``: the hold-down, no ping-pong).  A pool that would drop below its need, or was itself
  refused a start its empty GPU would serve, gives it only for refused starts that GPU admits more
  of than its own (starts per GPU, by framebuffer and expected GPU time), and never while its own
  need is forecast to rise.  **A recipient** serves the refused class and is below its ``max``.
  The moved GPU must offer the refused profile, and a GPU in mixed-size mode never goes to a
  fixed-share pool.
- **Guarantees stay feasible**: a move is made only when, on the pools after it, the exact
  search of :mod:`vgpuhost.policy.feasibility` finds no tenant at risk that was not at risk before
  (and decides; an undecided search is no move).
- **Bounds**: no move in quiet hours; at most ``changes_per_hour`` moves in any hour (the moves
  already made in the last hour count).

Kinds of move: ``pool`` (an empty GPU to another pool: its scheduler policy set to the new
pool's, then its pool recorded), for refused starts, for a forecast need, or for a pressed pool.
Mixed-size mode switches and MIG re-slicing are other features' moves (:data:`KINDS` lists the
names they will take); this module never produces them (docs/guide/rebalance.md, "Not done here").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..model.concepts import QosClass, SchedulerPolicy
from ..model.errors import InputError
from ..model.tenancy import Tenant
from ..model.values import VgpuProfile
from .admission import DEFAULT_POOL, Pool, gpu_time_room, pool_of, pool_problems, serves_of
from . import compute
from .feasibility import HostGpu, at_risk

#: the move this module decides; the other names are reserved for the mixed-size and MIG-on-demand features
KIND_POOL = "pool"
KINDS = (KIND_POOL, "mixed-size", "mig-reslice")
#: admission refusal codes that are demand for room (policy.demand.ROOM_CODES less quota and burst)
DEMAND_CODES = ("capacity", "gpu-time", "pool")
#: a pool's allocated time is *rising* when the last trend window holds this much more than the one before
RISING = 1.25

@dataclass(frozen=True)
class Refusal:
    """One start admission refused for want of room: ``at`` (ISO 8601 UTC, the audit row's time),
    ``profile`` (vGPU type name), ``tenant`` (None: a domain without one), ``qos`` (the class asked
    for: the tenant's, best-effort without a tenant), ``code`` (:data:`DEMAND_CODES`), ``domain`` (the
    domain's UUID; "": not known, each such refusal counts apart)."""

    at: str
    profile: str
    tenant: Optional[str]
    qos: str
    code: str
    domain: str = ""


#: what a recorded profile name may hold (a vGPU type name: ``A40-8Q``, ``H200X-1-18C``; "": passthrough)
_PROFILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$|^$")


def refusal_of(at: str, code: str, profile: str, qos: str, tenant: Optional[str], qos_of: Mapping[str, str],
               domain: str = "") -> Optional[Refusal]:
    """The :class:`Refusal` of one start admission refused, from what admission decided and stored in
    its own columns (``StateStore.refusal_records``: ``code``, ``profile``, ``qos``, ``tenant``, the
    ``domain``'s UUID), never from an audit row's value (it echoes tenant-written text: trial 10 F4).
    None when it was refused for something moving capacity cannot fix (quota, isolation, QoS class, a
    GPU in drift: a code not in :data:`DEMAND_CODES`), or when a field is not one admission could have
    written: a class that is no QoS class, a tenant not in ``qos_of`` (each tenant's QoS class, by
    lower-case name), a profile that is no type name.  ``qos`` empty: the tenant's class (none:
    best-effort)."""
    if code not in DEMAND_CODES or not _PROFILE.match(profile or ""):
        return None
    tenant = tenant or None
    if tenant is not None and tenant.lower() not in qos_of:
        return None
    if not qos:
        qos = qos_of.get(tenant.lower(), QosClass.BEST_EFFORT) if tenant else QosClass.BEST_EFFORT
    if str(qos) not in {str(c) for c in QosClass}:
        return None
    return Refusal(at, profile, tenant, str(qos), code, domain)


def distinct_starts(refusals: Sequence[Refusal]) -> List[Refusal]:
    """``refusals`` (oldest first) with one per start: a domain's refusals of one profile (lower case)
    count once, as its newest (a start retried ten times is one start's demand: trial 10 F5); those
    with no ``domain`` each count.  In the order of each kept one's time."""
    newest: Dict[Tuple[str, str], Refusal] = {}
    out: List[Refusal] = []
    for r in refusals:
        if not r.domain:
            out.append(r)
        else:
            key = (r.domain.lower(), r.profile.lower())
            newest.pop(key, None)
            newest[key] = r
    return sorted(out + list(newest.values()), key=lambda r: r.at)


_SERVED = re.compile(r"(?P<n>\d+) start\(s\) of (?P<profile>\S+) \((?P<qos>[a-z-]+);")


def served_by(value: str) -> Optional[Tuple[str, str]]:
    """``(profile lower case, QoS class)`` of the refused starts a move's audit row says it served (the
    reason :func:`decide` wrote: ``N start(s) of A40-8Q (burstable; web) refused ...``), or None (a move
    for a rising pool, or not a move)."""
    m = _SERVED.search(value)
    return (m.group("profile").lower(), m.group("qos")) if m else None


_MOVED = re.compile(r"^GPU (?P<gpu>\S+): pool \S+ -> (?P<to>[^:\s]+):")


def moved_to(value: str) -> Optional[Tuple[str, str]]:
    """``(GPU BDF, pool name lower case)`` a move's audit row (its value ``GPU BDF: pool A -> B: ...``)
    moved a GPU to, or None (not a move row)."""
    m = _MOVED.match(value)
    return (m.group("gpu"), m.group("to").lower()) if m else None


def pending(refusals: Sequence[Refusal], served: Mapping[Tuple[str, str], str]) -> List[Refusal]:
    """``refusals`` less those a move already answered: of a ``(profile lower case, class)`` a move
    served (``served``: that group -> the time of the last such move, ISO 8601 UTC), those refused at
    or before that move.  So one refused start never moves two GPUs, pass after pass."""
    return [r for r in refusals if r.at > served.get((r.profile.lower(), r.qos), "")]


@dataclass(frozen=True)
class PoolBound:
    """An operator bound on one pool: ``min`` / ``max`` GPUs (None: no maximum)."""

    min: int = 0
    max: Optional[int] = None


@dataclass(frozen=True)
class Bounds:
    """The reconciler's settings: ``enabled`` (the agent runs it every ``interval_s`` seconds),
    ``window_min`` (minutes of refusals weighed), ``trend_hours`` (hours of metered use in each of the
    two windows compared), ``changes_per_hour`` (moves in any hour), ``quiet`` (``(start, end)``
    minutes after midnight UTC with no move; end before start wraps midnight; None: none),
    ``pools`` (``{pool name, lower case: PoolBound}``), ``horizon_h`` (hours ahead the forecast looks:
    a pool is given GPUs it is forecast to need that far ahead), ``history_days`` (days of metered
    history the forecast reads the same hours of)."""

    enabled: bool = False
    interval_s: float = 300.0
    window_min: int = 60
    trend_hours: int = 6
    changes_per_hour: int = 4
    quiet: Optional[Tuple[int, int]] = None
    pools: Mapping[str, PoolBound] = field(default_factory=dict)
    horizon_h: int = 1
    history_days: int = 7

    def bound(self, pool: str) -> PoolBound:
        return self.pools.get(pool.lower(), PoolBound())

    def quiet_text(self) -> str:
        if self.quiet is None:
            return ""
        a, b = self.quiet
        return f"{a // 60:02d}:{a % 60:02d}-{b // 60:02d}:{b % 60:02d}"

    def in_quiet(self, minute_of_day: int) -> bool:
        """Whether ``minute_of_day`` (0..1439, UTC) falls in the quiet hours."""
        if self.quiet is None:
            return False
        a, b = self.quiet
        return a <= minute_of_day < b if a <= b else (minute_of_day >= a or minute_of_day < b)

    def as_dict(self) -> Dict[str, Any]:
        return {"enabled": self.enabled, "interval_s": self.interval_s, "window_min": self.window_min,
                "trend_hours": self.trend_hours, "changes_per_hour": self.changes_per_hour,
                "quiet_hours": self.quiet_text() or None, "horizon_h": self.horizon_h,
                "history_days": self.history_days,
                "pools": {n: {"min": b.min, "max": b.max} for n, b in sorted(self.pools.items())}}


_TOP = ("version", "agent", "window_min", "trend_hours", "changes_per_hour", "quiet_hours", "pools", "horizon_h",
        "history_days")
_HHMM = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


def _int(source: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InputError(f"{source}: {name} must be a whole number from {low} to {high}, not {value!r}",
                         hint="docs/guide/rebalance.md lists the settings")
    return value


def parse_bounds(doc: Any, source: str = "rebalance.yaml") -> Bounds:
    """The :class:`Bounds` a loaded rebalance config holds (``doc``: the YAML document; None or empty:
    the defaults, reconciler off in the agent).  Raises InputError, one line ``SOURCE: FIELD ...``, for
    an unknown key, a wrong type or a value out of range (``min`` above ``max``, a quiet-hours range
    that is not ``HH:MM-HH:MM`` or is empty)."""
    if doc is None:
        return Bounds()
    if not isinstance(doc, dict):
        raise InputError(f"{source}: the document must be a mapping, not {type(doc).__name__}",
                         hint="docs/guide/rebalance.md shows the format")
    unknown = sorted(str(k) for k in doc if k not in _TOP)
    if unknown:
        raise InputError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(_TOP)})",
                         hint="docs/guide/rebalance.md lists the settings")
    if doc.get("version", 1) != 1:
        raise InputError(f"{source}: version must be 1, not {doc.get('version')!r}", hint="write 'version: 1'")
    out: Dict[str, Any] = {}
    agent = doc.get("agent") or {}
    if not isinstance(agent, dict) or sorted(set(agent) - {"enabled", "interval_s"}):
        raise InputError(f"{source}: agent must be a mapping of enabled and interval_s, not {agent!r}",
                         hint="agent: {enabled: true, interval_s: 300}")
    if "enabled" in agent:
        if not isinstance(agent["enabled"], bool):
            raise InputError(f"{source}: agent.enabled must be true or false, not {agent['enabled']!r}",
                             hint="agent: {enabled: true}")
        out["enabled"] = agent["enabled"]
    if "interval_s" in agent:
        out["interval_s"] = float(_int(source, "agent.interval_s", agent["interval_s"], 10, 86400))
    for key, low, high in (("window_min", 1, 7 * 24 * 60), ("trend_hours", 1, 24 * 14),
                           ("changes_per_hour", 0, 60), ("horizon_h", 0, 12), ("history_days", 0, 28)):
        if key in doc:
            out[key] = _int(source, key, doc[key], low, high)
    q = doc.get("quiet_hours")
    if q is not None:
        parts = str(q).split("-") if isinstance(q, str) else []
        ms = [_HHMM.match(p.strip()) for p in parts]
        if len(parts) != 2 or not all(ms):
            raise InputError(f"{source}: quiet_hours must be HH:MM-HH:MM (UTC), not {q!r}",
                             hint="quiet_hours: '22:00-06:00'")
        a, b = (int(m.group(1)) * 60 + int(m.group(2)) for m in ms)
        if a == b:
            raise InputError(f"{source}: quiet_hours {q!r} is empty: its start and end are the same",
                             hint="quiet_hours: '22:00-06:00', or leave it out")
        out["quiet"] = (a, b)
    pools = doc.get("pools") or {}
    if not isinstance(pools, dict):
        raise InputError(f"{source}: pools must map pool names to {{min, max}}, not {pools!r}",
                         hint="pools: {gold: {min: 1, max: 4}}")
    bounds: Dict[str, PoolBound] = {}
    for name, b in pools.items():
        where = f"pools.{name}"
        if not isinstance(b, dict) or sorted(set(b) - {"min", "max"}):
            raise InputError(f"{source}: {where} must be a mapping of min and max, not {b!r}",
                             hint="pools: {gold: {min: 1, max: 4}}")
        lo = _int(source, where + ".min", b.get("min", 0), 0, 4096)
        hi = _int(source, where + ".max", b["max"], 0, 4096) if b.get("max") is not None else None
        if hi is not None and lo > hi:
            raise InputError(f"{source}: {where}.min {lo} is above its max {hi}", hint="min <= max")
        if str(name).lower() in bounds:
            raise InputError(f"{source}: pool {name!r} is given twice (names compare without case)",
                             hint="one entry a pool")
        bounds[str(name).lower()] = PoolBound(lo, hi)
    out["pools"] = bounds
    return Bounds(**out)


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the reconciler sees it: ``gpu`` (BDF), ``busy`` (why it may not move: ``holds 1
    vGPU(s)``, ``passed through``, ``in MIG mode``, ``out of service``; empty: it holds nothing),
    ``offers`` (vGPU type names it offers, lower case), ``framebuffer_mib``, ``mixed_size`` (NVML says it
    runs mixed-size mode, where there is no fixed share: it may not join a fixed-share pool)."""

    gpu: str
    busy: str = ""
    offers: Tuple[str, ...] = ()
    framebuffer_mib: int = 0
    mixed_size: bool = False


@dataclass(frozen=True)
class Trend:
    """A pool's metered allocated time (seconds, summed over its GPUs' vGPUs): ``recent`` over the last
    ``trend_hours``, ``before`` over the same span before that."""

    recent: float = 0.0
    before: float = 0.0

    @property
    def rising(self) -> bool:
        return self.recent > self.before * RISING and self.recent > 0


#: the most a forecast scales a pool's need now by, either way (a history with a near-empty hour
#: would otherwise forecast a pool many times its size)
MAX_RATIO = 2.0
#: hours in the period the forecast reads the same hours of (a day: desktops by day, compute by night)
PERIOD_H = 24


def growth(history: Sequence[float], horizon_h: int, days: int) -> Tuple[float, str]:
    """``(ratio, basis)``: how much a pool's demand is forecast to change between now and ``horizon_h``
    hours ahead, from ``history``, its metered demand per hour (any unit proportional to demand, e.g.
    mean vGPUs held; oldest first, the last value the last whole hour before now).

    - **The same hours of the previous days** (a day/night load is periodic): for each of the last
      ``days`` days whose history covers both and metered something in either, the hour ``24 * d``
      hours before now and the hour ``horizon_h`` after it; the ratio is the sum of the later hours
      over the sum of the earlier.
    - Without a whole day of history, **the trend**: the mean of the last ``horizon_h`` hours over
      the mean of the ``horizon_h`` before them.
    - Otherwise (or nothing metered in the earlier hours): 1.0, ``no history``.

    The ratio is kept within 1/:data:`MAX_RATIO` .. :data:`MAX_RATIO`.  ``basis``: one phrase saying
    which estimator gave it (the move's reason quotes it)."""
    n = len(history)
    if horizon_h <= 0:
        return 1.0, "no forecast (horizon 0 h)"
    before = after = 0.0
    used = 0
    for d in range(1, days + 1):
        i = n - PERIOD_H * d                # the hour now, d days ago
        j = i + horizon_h
        if i < 0 or j > n - 1 or not (history[i] or history[j]):
            continue                        # not in the history, or nothing metered then
        before += history[i]
        after += history[j]
        used += 1
    if used and before > 0:
        ratio, basis = after / before, f"the same hours of the last {used} day(s)"
    elif n >= 2 * horizon_h and sum(history[n - 2 * horizon_h:n - horizon_h]) > 0:
        ratio = sum(history[n - horizon_h:]) / sum(history[n - 2 * horizon_h:n - horizon_h])
        basis = f"the trend of the last {2 * horizon_h} h"
    else:
        return 1.0, "no history"
    return min(MAX_RATIO, max(1 / MAX_RATIO, ratio)), basis


def pool_history(by_class: Mapping[str, Sequence[float]], pools: Sequence[Pool], names: Sequence[str]
                 ) -> Dict[str, List[float]]:
    """Each pool's metered demand per hour (``{pool name lower case: [value per hour]}``) from each QoS
    class's (``by_class``: ``{class: [mean vGPUs of that class held, per hour]}``, oldest first, all of
    one length): the classes it serves, each shared evenly among the pools serving it.  ``names``: the
    pools to give a history (the declared ones and :data:`DEFAULT_POOL` where GPUs are in none)."""
    n = max((len(v) for v in by_class.values()), default=0)
    out: Dict[str, List[float]] = {}
    for name in names:
        p = next((p for p in pools if p.name.lower() == name.lower()), pool_of((), ""))
        row = [0.0] * n
        for qos, ys in by_class.items():
            if not p.serves(qos):
                continue
            sharing = sum(1 for m in names if next((x for x in pools if x.name.lower() == m.lower()),
                                                   pool_of((), "")).serves(qos))
            for i, y in enumerate(ys[-n:] if n else ()):
                row[n - len(ys) + i] += y / max(1, sharing)
        out[name.lower()] = row
    return out


@dataclass(frozen=True)
class Outlook:
    """A pool's need for GPUs: ``now`` (GPUs holding something, plus the GPUs its pending refused starts
    would take: each refused start 1 / the number of its profile an empty GPU of the pool takes, by
    framebuffer and expected GPU time), ``ahead`` (``now`` times the forecast :func:`growth` over the
    horizon), ``basis`` (the estimator, one phrase)."""

    now: float = 0.0
    ahead: float = 0.0
    basis: str = "no history"

    @property
    def need(self) -> int:
        """GPUs the pool keeps: its need now or ahead, whichever is more, rounded up."""
        return _ceil(max(self.now, self.ahead))


def _ceil(x: float) -> int:
    """``x`` rounded up, a hair of float error forgiven (2.0000000001 GPUs is 2)."""
    return max(0, int(math.ceil(x - 1e-6)))


@dataclass(frozen=True)
class Move:
    """One change: ``kind`` (:data:`KIND_POOL`), ``gpu`` (BDF), ``from_pool``/``to_pool`` (names;
    :data:`~vgpuhost.policy.admission.DEFAULT_POOL` for no declared pool), ``policy`` (the scheduler
    policy the GPU takes; "" in the default pool: left as it runs), ``reason`` (the demand that drove
    it, one line), ``serves`` (how many refused starts it serves, by its room for the profile)."""

    kind: str
    gpu: str
    from_pool: str
    to_pool: str
    policy: str
    reason: str
    serves: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "gpu": self.gpu, "from_pool": self.from_pool, "to_pool": self.to_pool,
                "policy": self.policy or None, "reason": self.reason, "serves": self.serves}


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` found: ``moves`` in order, ``held`` (one line per demand left unserved and why),
    ``demand`` (per pool: refusals it could serve, GPUs, empty GPUs, trend)."""

    moves: Tuple[Move, ...] = ()
    held: Tuple[str, ...] = ()
    demand: Tuple[Tuple[str, Dict[str, Any]], ...] = ()


def with_move(pools: Sequence[Pool], gpu: str, to: str) -> List[Pool]:
    """``pools`` with ``gpu`` taken from its pool and put in pool ``to`` (:data:`DEFAULT_POOL`: in none)."""
    out = [replace(p, gpus=tuple(g for g in p.gpus if g != gpu)) for p in pools]
    return [replace(p, gpus=tuple(sorted(p.gpus + (gpu,)))) if p.name.lower() == to.lower() else p for p in out]


def _room(g: GpuFacts, host: Optional[HostGpu], profile: str) -> int:
    """How many vGPUs of ``profile`` the empty GPU ``g`` takes (at least 1 when it offers it)."""
    p = VgpuProfile.try_parse(profile)
    size = next((fb for name, fb, _ in (host.types or ()) if name.lower() == profile.lower()), 0) if host else 0
    size = size or (p.framebuffer_gb * 1024 if p else 0)
    most = host.most(size) if host is not None and size else None
    if most:
        return most
    return max(1, (g.framebuffer_mib // size) if size and g.framebuffer_mib else 1)


def _use_of(held: Sequence[Any], profile: str, tenant: Optional[str]) -> Optional[float]:
    """The expected GPU time of a start of ``profile`` (lower case) by ``tenant``: the mean expected use
    of the held vGPUs of that profile and tenant, else of that profile; None: none held (the profile's
    fixed share then)."""
    mine = [a.use.share for a in held if getattr(a, "use", None) is not None
            and (a.profile or "").lower() == profile and a.tenant == tenant]
    if not mine:
        mine = [a.use.share for a in held if getattr(a, "use", None) is not None
                and (a.profile or "").lower() == profile]
    return sum(mine) / len(mine) if mine else None


def _starts_per_gpu(g: GpuFacts, host: Optional[HostGpu], profile: str, use: Optional[float],
                    ceiling: float) -> int:
    """How many starts of ``profile`` the empty GPU ``g`` admits in a pool of compute ceiling
    ``ceiling``: its room by framebuffer (:func:`_room`), and by expected GPU time ``use`` (None: no
    limit beyond the framebuffer); at least 1."""
    most = _room(g, host, profile)
    if use and use > 0:
        most = min(most, max(1, int(ceiling / use + 1e-9)))
    return max(1, most)


def decide(*, pools: Sequence[Pool], gpus: Sequence[GpuFacts], refusals: Sequence[Refusal],
           tenants: Mapping[str, Tenant], held: Sequence[Any], host_gpus: Sequence[HostGpu], bounds: Bounds,
           minute_of_day: int, moves_last_hour: int, trends: Optional[Mapping[str, Trend]] = None,
           moved: Optional[Mapping[str, Tuple[str, str]]] = None,
           history: Optional[Mapping[str, Sequence[float]]] = None) -> Decision:
    """The moves that bring empty capacity to where starts were refused, or are forecast (module
    docstring).

    ``pools``: the declared pools as recorded; ``gpus``: every GPU (:class:`GpuFacts`); ``refusals``:
    those of the window (:func:`refusal_of`); ``tenants``/``held``: for the guarantee check
    (``held``: :class:`~vgpuhost.policy.demand.Allocation` with expected use); ``host_gpus``: the
    GPUs as the guarantees see them, without room (:func:`vgpuhost.ops.tenancy.host_gpus`);
    ``minute_of_day``: now (UTC); ``moves_last_hour``: moves made in the last hour; ``trends``: per
    pool name (lower case); ``moved``: the GPUs a move of the window put where they are, ``{BDF: (time
    ISO 8601 UTC, pool lower case)}``: such a GPU, still in that pool, is no donor until the window
    has passed (a hold-down: the start it was moved for retries first, so it does not ping-pong);
    ``history``: per pool name (lower case), its metered demand per hour, oldest first, ending with
    the last whole hour (:func:`growth`; missing: no forecast, the need now stands for the need ahead).
    Never raises for a move it cannot make: that is a ``held`` line.
    """
    trends = trends or {}
    moved = moved or {}
    history = history or {}
    facts = {g.gpu: g for g in gpus}
    hosts = {h.gpu: h for h in host_gpus}
    current = list(pools)
    names = [p.name for p in current] + ([DEFAULT_POOL] if any(pool_of(current, g.gpu).name == DEFAULT_POOL
                                                                for g in gpus) else [])

    def members(name: str, ps: Sequence[Pool]) -> List[str]:
        return sorted(g.gpu for g in gpus if pool_of(ps, g.gpu).name.lower() == name.lower())

    def pool_named(name: str, ps: Sequence[Pool]) -> Pool:
        return next((p for p in ps if p.name.lower() == name.lower()), pool_of((), ""))

    def serves(name: str, qos: str, ps: Sequence[Pool]) -> bool:
        return pool_named(name, ps).serves(qos)

    def per_gpu(name: str, gpu: str, profile: str, tenant: Optional[str]) -> int:
        """Starts of ``profile`` the empty ``gpu`` admits in pool ``name``."""
        return _starts_per_gpu(facts[gpu], hosts.get(gpu), profile, _use_of(held, profile, tenant),
                               compute.ceiling_of(pool_named(name, current)))

    # demand per (profile, class): the refusals, and which pools they count against
    groups: Dict[Tuple[str, str], List[Refusal]] = {}
    for r in refusals:
        groups.setdefault((r.profile.lower(), r.qos), []).append(r)
    refused_in = {n.lower(): sum(len(rs) for (_, q), rs in groups.items() if serves(n, q, current)) for n in names}

    # each pool's need for GPUs, now and at the horizon (Outlook)
    occupied = {n.lower(): sum(1 for g in members(n, current) if facts[g].busy) for n in names}
    outlook: Dict[str, Outlook] = {}
    for n in names:
        now = float(occupied[n.lower()])
        for (prof, q), rs in groups.items():
            serving = [m for m in names if serves(m, q, current)]
            if n not in serving:
                continue
            sample = next((g for g in members(n, current) if prof in facts[g].offers), None)
            room = per_gpu(n, sample, prof, rs[0].tenant) if sample else 1
            now += len(rs) / room / len(serving)
        ratio, basis = growth(history[n.lower()], bounds.horizon_h, bounds.history_days) \
            if n.lower() in history else (1.0, "no history")
        outlook[n.lower()] = Outlook(round(now, 3), round(now * ratio, 3), basis)

    def own_starts(name: str, gpu: str) -> int:
        """Starts a GPU admits in pool ``name`` for its own demand: the most of its refused groups that
        ``gpu`` offers, else the vGPUs it holds per GPU holding something (1 at least)."""
        best = [per_gpu(name, gpu, prof, rs[0].tenant) for (prof, q), rs in groups.items()
                if serves(name, q, current) and prof in facts[gpu].offers]
        busy = occupied[name.lower()]
        mine = set(members(name, current))
        count = sum(1 for a in held if getattr(a, "gpu", None) in mine)
        return max(best + [max(1, round(count / busy)) if busy else 1])

    demand = tuple((n, {"gpus": len(members(n, current)),
                        "empty": sum(1 for g in members(n, current) if not facts[g].busy),
                        "refused": refused_in.get(n.lower(), 0),
                        "need_now": outlook[n.lower()].now, "need_ahead": outlook[n.lower()].ahead,
                        "forecast": outlook[n.lower()].basis,
                        "trend": {"recent_s": round(trends.get(n.lower(), Trend()).recent, 1),
                                  "before_s": round(trends.get(n.lower(), Trend()).before, 1),
                                  "rising": trends.get(n.lower(), Trend()).rising}}) for n in names)
    held_lines: List[str] = []
    ahead_short = [n for n in names if _ceil(outlook[n.lower()].ahead) > len(members(n, current))]
    if bounds.in_quiet(minute_of_day) and (groups or any(t.rising for t in trends.values()) or ahead_short):
        return Decision((), (f"quiet hours {bounds.quiet_text()} (UTC): no change now",), demand)
    budget = bounds.changes_per_hour - moves_last_hour
    serves_now = serves_of(current)
    before, decided_before = at_risk(tenants, held, gpu_time_room(host_gpus, held, current), serves_now)
    moves: List[Move] = []

    def wanted_by(name: str, gpu: str) -> bool:
        """Whether pool ``name`` itself refused, in the window, a start its empty GPU ``gpu`` would serve."""
        return any(serves(name, q, current) and prof in facts[gpu].offers for (prof, q) in groups)

    def donor(recipient: str, profile: Optional[str], spare: bool, starts: int = 0) -> Tuple[Optional[str], str]:
        """The GPU to take for ``recipient`` (None, why not).  ``starts``: how many of the refused starts
        one GPU admits in the recipient (0: a forecast or pressed move, which only a pool with a GPU
        beyond its need gives)."""
        why = ""
        to = next((p for p in current if p.name.lower() == recipient.lower()), None)
        to_policy = to.policy if to is not None else ""
        options = []
        for name in names:
            if name.lower() == recipient.lower():
                continue
            mine = members(name, current)
            empty = [g for g in mine if not facts[g].busy and (profile is None or profile in facts[g].offers)]
            if not empty:
                continue
            floor = max(bounds.bound(name).min, 1 if name != DEFAULT_POOL else 0)
            if len(mine) - 1 < floor:
                why = why or f"pool {name} is at its minimum of {floor} GPU(s)"
                continue
            look = outlook[name.lower()]
            short = len(mine) - 1 < look.need
            if short or any(wanted_by(name, g) for g in empty):
                # the donor needs its GPUs too: the GPU goes where it admits more starts, and never
                # from a pool whose own demand is forecast to rise
                gain = [g for g in empty if starts and look.ahead <= look.now and own_starts(name, g) < starts]
                if not gain:
                    why = why or (f"pool {name} refused starts its empty GPUs would serve" if not short else
                                  f"pool {name} needs its {len(mine)} GPU(s): {look.now:.1f} now, "
                                  f"{look.ahead:.1f} in {bounds.horizon_h} h ({look.basis})")
                    continue
                empty = gain
            settled = [g for g in empty if moved.get(g, ("", ""))[1] != name.lower()]
            if not settled:
                g = empty[0]
                why = why or (f"GPU {g} was moved to pool {name} at {moved[g][0][:19]} for demand of the last "
                              f"{bounds.window_min} min: it stays there for that long, so the starts it was "
                              "moved for retry first")
                continue
            empty = settled
            if to_policy == SchedulerPolicy.FIXED_SHARE:
                fits = [g for g in empty if not facts[g].mixed_size]
                if not fits:
                    why = why or (f"GPU {empty[0]} is in mixed-size mode, and pool {recipient} is fixed-share "
                                  "(NVIDIA has no fixed share in mixed-size mode): 'vgpuhost vgpu mode --gpu "
                                  f"{empty[0]} --mixed-size off' lets it move")
                    continue
                empty = fits
            all_empty = [g for g in mine if not facts[g].busy]
            t = trends.get(name.lower(), Trend())
            if (t.rising or spare) and len(all_empty) < 2:
                why = why or f"pool {name}'s use is rising and it has one empty GPU"
                continue
            options.append((int(short), -(len(mine) - look.need), -len(all_empty), t.recent, name, empty[0]))
        if not options:
            return None, why or "no other pool has an empty GPU" + (f" offering {profile}" if profile else "")
        options.sort()
        return options[0][-1], ""

    def feasible(new: Sequence[Pool]) -> str:
        problems = pool_problems(new)
        if problems:
            return "; ".join(problems)
        after, decided = at_risk(tenants, held, gpu_time_room(host_gpus, held, new), serves_of(new))
        fresh = [t for t in after if t.lower() not in {b.lower() for b in before}]
        if fresh:
            return f"it would leave the guarantee of tenant {fresh[0]!r} unservable"
        if not decided and decided_before:
            return "the guarantee check could not decide on the pools after it"
        return ""

    def try_move(recipient: str, profile: Optional[str], spare: bool, reason: str, starts: int = 0
                 ) -> Optional[Move]:
        nonlocal current
        bound = bounds.bound(recipient)
        if bound.max is not None and len(members(recipient, current)) >= bound.max:
            held_lines.append(f"{reason}: pool {recipient} is at its maximum of {bound.max} GPU(s)")
            return None
        tried: List[str] = []
        while True:
            gpu, why = donor(recipient, profile, spare, starts)
            if gpu is None:
                held_lines.append(f"{reason}: " + ("; ".join(tried) if tried else why))
                return None
            new = with_move(current, gpu, recipient)
            bad = feasible(new)
            if not bad:
                src = pool_of(current, gpu).name
                to = next((p for p in current if p.name.lower() == recipient.lower()), None)
                current = new
                return Move(KIND_POOL, gpu, src, recipient, to.policy if to is not None else "", reason,
                            _room(facts[gpu], hosts.get(gpu), profile) if profile else 0)
            tried.append(f"GPU {gpu} may not move: {bad}")
            facts[gpu] = replace(facts[gpu], busy="kept for a guarantee")    # not tried again

    # 1. refused starts, the largest groups first
    for (profile, qos), rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        left = len(rs)
        tenants_named = sorted({r.tenant or "(no tenant)" for r in rs})
        if any(not g.busy and profile in g.offers and serves(pool_of(current, g.gpu).name, qos, current)
               for g in facts.values()):
            continue        # room for them now (something ended since): nothing to move
        while left > 0:
            recipients = sorted((n for n in names if serves(n, qos, current)),
                                key=lambda n: (-int(trends.get(n.lower(), Trend()).rising),
                                               len(members(n, current)), n))
            reason = (f"{len(rs)} start(s) of {rs[0].profile} ({qos}; {', '.join(tenants_named)}) refused "
                      f"for room in the last {bounds.window_min} min ({', '.join(sorted({r.code for r in rs}))})")
            if not recipients:
                held_lines.append(f"{reason}: no pool serves {qos}")
                break
            if budget <= 0:
                held_lines.append(f"{reason}: changes per hour: {moves_last_hour + len(moves)} made in the "
                                  f"last hour, at most {bounds.changes_per_hour}")
                break
            to = recipients[0]
            sample = next((g for g in facts if profile in facts[g].offers), None)
            starts = per_gpu(to, sample, profile, rs[0].tenant) if sample else 1
            m = try_move(to, profile, False, reason + f"; pool {to} serves them", starts)
            if m is None:
                break
            moves.append(m)
            budget -= 1
            left -= max(1, min(m.serves, starts))
    # 2. forecast: a pool whose need at the horizon passes its GPUs gets GPUs beyond another's need
    for name in sorted(names, key=lambda n: (-(outlook[n.lower()].ahead - len(members(n, current))), n)):
        look = outlook[name.lower()]
        while _ceil(look.ahead) > len(members(name, current)) and look.ahead > look.now:
            reason = (f"pool {name} is forecast to need {look.ahead:.1f} GPU(s) in {bounds.horizon_h} h "
                      f"({look.basis}; {look.now:.1f} now) and has {len(members(name, current))}")
            if budget <= 0:
                held_lines.append(f"{reason}: changes per hour: at most {bounds.changes_per_hour}")
                break
            m = try_move(name, None, False, reason)
            if m is None:
                break
            moves.append(m)
            budget -= 1
    # 3. pressed pools: every GPU holds something and the metered use rose
    for name in names:
        t = trends.get(name.lower(), Trend())
        mine = members(name, current)
        if not t.rising or any(not facts[g].busy for g in mine) or refused_in.get(name.lower(), 0):
            continue
        reason = (f"pool {name} has no empty GPU and its allocated time rose from {t.before / 3600:.1f} h to "
                  f"{t.recent / 3600:.1f} h over the last {bounds.trend_hours} h")
        if budget <= 0:
            held_lines.append(f"{reason}: changes per hour: at most {bounds.changes_per_hour}")
            continue
        m = try_move(name, None, True, reason)
        if m is not None:
            moves.append(m)
            budget -= 1
    return Decision(tuple(moves), tuple(held_lines), demand)


__all__ = ["KIND_POOL", "KINDS", "DEMAND_CODES", "Refusal", "refusal_of", "distinct_starts", "served_by", "moved_to", "pending", "PoolBound", "Bounds", "parse_bounds",
           "GpuFacts", "Trend", "Move", "Decision", "with_move", "decide", "growth", "Outlook",
           "pool_history"]
