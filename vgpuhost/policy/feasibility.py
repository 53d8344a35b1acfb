"""Can every tenant's unused guarantee be served together on this host?  A pure, bounded exact search.

Owns: the per-GPU facts the question needs (:class:`HostGpu`), a tenant's
unused guarantee (:class:`Need`, :func:`needs`), the search
(:func:`search`), the set of tenants whose guarantees cannot all be kept
(:func:`at_risk`), and the reserve check admission asks for use no
guarantee covers (:class:`Reserve`).  Must not: read the host or the state
store; callers (:mod:`vgpuhost.ops.tenancy`, :mod:`vgpuhost.policy.admission`)
build the inputs.

The rule (docs/guide/tenancy.md, "Guarantees reserve room"): a tenant's
unused guarantee (guaranteed limit less its use now, per dimension) can be
served when a way exists to give every such tenant, at once and on top of
what is held now:

- its unused passthrough GPUs: GPUs holding nothing;
- its unused vGPUs and framebuffer: time-sliced vGPUs on GPUs that offer a
  type of its series, whose pool serves its QoS class, that its isolation
  allows (``hardware``: none; ``exclusive``: a GPU holding no other
  tenant's vGPU, and no other tenant joins it; ``avoid`` labels, both ways)
  and that hold one vGPU size (equal-size mode): a GPU holding vGPUs takes
  only their size, an empty GPU takes the size of the first vGPU given to
  it; or MIG-backed vGPUs on GPUs in MIG mode (pools and neighbours do not
  matter there).  A tenant holding time-sliced vGPUs is served in the types
  it holds (the sizes it uses); one holding none may use any type of its
  series.  Each vGPU counts 1 vGPU and its framebuffer;
- its unused MIG compute slices: MIG-backed vGPUs, slices counted per GPU.

Two readings of a tenant holding no vGPU yet: ``any_size`` (it may join a
GPU already holding another tenant's size) and, with ``any_size`` False, the
guarantee is held at the size it will ask, so it needs a GPU it sizes
itself (an empty one).  Admission's reserve keeps both; ``tenant add|set``
checks the first (a promise that some choice of sizes keeps).

The search assigns, GPU by GPU, what each GPU gives to whom (memoised on
the demand left, each GPU's capacity given out fully to the tenants it
serves); it stops after :data:`NODE_LIMIT` steps and answers "unknown"
(``Verdict.ok`` None) rather than take longer: host scale is up to ~16 GPUs
and a handful of guaranteed tenants.
"""

from __future__ import annotations

from ..model.tenancy import DIMENSIONS, EXCLUSIVE, HARDWARE, SHARED, Tenant, tenant_named
from ..model.values import VgpuProfile, record
from .demand import PASSTHROUGH, VGPU, Allocation

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

#: a GPU whose vGPU types are not known serves a tenant holding no vGPU in vGPUs of this size (MiB): the
#: smallest vGPU types are 1 GiB (A40-1Q, L40S-1Q; docs/reference/hardware.md#vgpu-types)
MIN_VGPU_MIB = 1024
#: search steps (GPUs tried and shares of a GPU weighed) before the answer is "unknown": about 0.1 s
NODE_LIMIT = 20000


@record(frozen=True)
class HostGpu:
    """One GPU as the guarantees see it.  ``framebuffer_mib``: its framebuffer (MiB); ``types``: the vGPU
    types it offers, ``(type name, framebuffer MiB, GPU-instance compute slices (0: time-sliced))``, None
    when not known (then any size fits); ``mig_slices``: compute slices in MIG mode (0: not in MIG mode);
    ``max_instances``: the driver's most vGPUs of a size (``A40-1Q``: 32, fewer than 48 GiB / 1 GiB);
    ``compute_room``: GPU time left under its pool's compute ceiling (a share of the GPU; None: not
    limited), in which a time-sliced vGPU of ``s`` MiB costs its fixed share ``s / framebuffer_mib``."""

    gpu: str
    framebuffer_mib: int
    types: Optional[Tuple[Tuple[str, int, int], ...]] = None
    mig_slices: int = 0
    max_instances: Tuple[Tuple[int, int], ...] = ()      # (time-sliced size MiB, most vGPUs of it), where known
    compute_room: Optional[float] = None

    def most(self, size: int) -> Optional[int]:
        """The most time-sliced vGPUs of ``size`` MiB it holds (equal-size mode; None: not known)."""
        found = [n for s, n in self.max_instances if s == size and n]
        return max(found) if found else None


@record(frozen=True)
class Need:
    """A tenant's unused guarantee: guaranteed limit less use now, per dimension (0: nothing unused)."""

    tenant: str
    vgpus: int = 0
    framebuffer_mib: int = 0
    mig_slices: int = 0
    passthrough_gpus: int = 0

    def text(self) -> str:
        """``tenant 'a': 2 vGPU(s) of 8192 MiB, 1 passthrough GPU(s)`` (sizes: ``sizes`` below)."""
        return f"tenant {self.tenant!r}: " + self.what()

    def what(self, size: Optional[int] = None) -> str:
        parts = []
        if self.vgpus:
            parts.append(f"{self.vgpus} vGPU(s)" + (f" of {size} MiB" if size else ""))
        if self.framebuffer_mib and not (size and self.vgpus and self.vgpus * size >= self.framebuffer_mib):
            parts.append(f"{self.framebuffer_mib} MiB framebuffer")
        if self.mig_slices:
            parts.append(f"{self.mig_slices} MIG compute slice(s)")
        if self.passthrough_gpus:
            parts.append(f"{self.passthrough_gpus} passthrough GPU(s)")
        return ", ".join(parts)


@record(frozen=True)
class Verdict:
    """``ok``: True (served together), False (not), None (unknown: the search hit :data:`NODE_LIMIT`)."""

    ok: Optional[bool]
    reason: str = ""


def needs(tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
          exclude: Optional[str] = None) -> List[Need]:
    """Every tenant's unused guarantee (those with one), by name; ``exclude``: a tenant left out."""
    out = []
    for name in sorted(tenants):
        if exclude is not None and name.lower() == exclude.lower():
            continue
        q = tenants[name].quota
        used = {d: 0 for d in DIMENSIONS}
        for a in allocations:
            if a.tenant is not None and a.tenant.lower() == name.lower():
                for d in DIMENSIONS:
                    used[d] += a.demand.amount(d)
        left = {d: max(0, (q.guaranteed.get(d) or 0) - used[d]) for d in DIMENSIONS}
        if any(left.values()):
            out.append(Need(name, **left))
    return out


class _Unknown(Exception):
    pass


class _Tenant:
    """A tenant's static facts for the search."""

    def __init__(self, t: Tenant, allocations: Sequence[Allocation]):
        self.t = t
        low = t.name.lower()
        mine = [a for a in allocations if a.tenant is not None and a.tenant.lower() == low and a.kind == VGPU]
        self.sliced = {a.profile.lower(): a.framebuffer_mib for a in mine if not a.mig_slices}
        self.mig = {a.profile.lower(): (a.framebuffer_mib, a.mig_slices) for a in mine if a.mig_slices}

    def allows(self, name: str) -> bool:
        series = self.t.quota.series
        if not series:
            return True
        p = VgpuProfile.try_parse(name)
        return p is None or p.series in series

    def sliced_sizes(self, g: HostGpu, own: bool) -> Set[int]:
        """Sizes (MiB) of the time-sliced types it may use on ``g``; ``own``: only those it holds."""
        if self.t.isolation == HARDWARE:
            return set()
        if g.types is None:
            return set(self.sliced.values()) or {MIN_VGPU_MIB}
        out = set()
        for name, fb, sl in g.types:
            if sl or not fb or not self.allows(name):
                continue
            if self.sliced and name.lower() not in self.sliced:
                continue
            out.add(fb)
        return out

    def mig_units(self, g: HostGpu) -> List[Tuple[int, int]]:
        """``(framebuffer MiB, slices)`` of the MIG-backed types it may use on ``g``, fewest slices first."""
        if g.types is None:
            return sorted(set(self.mig.values())) or [(g.framebuffer_mib // max(1, g.mig_slices), 1)]
        out = set()
        for name, fb, sl in g.types:
            if not sl or not self.allows(name):
                continue
            if self.mig and name.lower() not in self.mig:
                continue
            out.add((fb, sl))
        return sorted(out, key=lambda u: (u[1], -u[0]))


def _ceil(a: int, b: int) -> int:
    return -(-a // b) if b else 0


def search(wanted: Sequence[Need], *, tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
           gpus: Sequence[HostGpu], serves: Callable[[str, str], bool], any_size: bool = True,
           limit: int = NODE_LIMIT) -> Verdict:
    """Can every :class:`Need` of ``wanted`` be served at once on top of ``allocations``?

    ``gpus``: the host's GPUs (:class:`HostGpu`); ``serves(gpu, qos)``: whether the pool of ``gpu``
    serves QoS class ``qos`` (time-sliced vGPUs only); ``any_size``: module docstring.  The reason of a
    False verdict names the guarantees.  Never raises.
    """
    wanted = [n for n in wanted if n.vgpus or n.framebuffer_mib or n.mig_slices or n.passthrough_gpus]
    if not wanted:
        return Verdict(True)
    ts = [_Tenant(tenant_named(tenants, n.tenant) or Tenant(n.tenant), allocations) for n in wanted]
    nt = len(ts)

    def clash(a: Tenant, b: Optional[Tenant]) -> bool:
        return bool(a.conflicts(b) or (b is not None and b.conflicts(a)))
    pair = [[j != k and clash(ts[k].t, ts[j].t) for j in range(nt)] for k in range(nt)]
    # each GPU now, and what each tenant may have of it: (GPU, empty, free MiB or slices, size, MIG, per
    # tenant: time-sliced sizes (MiB) or MIG units ((MiB, slices), fewest slices first))
    state = []
    for g in sorted(gpus, key=lambda x: x.gpu):
        here = [a for a in allocations if a.gpu == g.gpu]
        dead = any(a.kind == PASSTHROUGH for a in here)
        sliced = [a for a in here if a.kind == VGPU and not a.mig_slices]
        size = sliced[0].framebuffer_mib if sliced else None
        present = {a.tenant for a in sliced}
        others = [(tenant_named(tenants, n) or Tenant(n)) if n else None for n in present]
        if g.mig_slices:
            free = 0 if dead else g.mig_slices - sum(a.mig_slices for a in here)
            per = [t.mig_units(g) for t in ts]
        else:
            free = 0 if dead else max(0, g.framebuffer_mib - sum(a.framebuffer_mib for a in sliced))
            if g.compute_room is not None:      # GPU time left, in MiB of fixed share
                free = min(free, int(g.compute_room * g.framebuffer_mib + 0.5))     # to the MiB: float sums
            per = []
            for k, t in enumerate(ts):
                if not serves(g.gpu, t.t.qos) or any(
                        not (o is not None and o.name.lower() == t.t.name.lower()) and clash(t.t, o) for o in others):
                    per.append(set())
                    continue
                sizes = t.sliced_sizes(g, False)
                if size is not None:
                    sizes = sizes & {size} if (t.sliced or any_size) else set()
                per.append(sizes)
            if size is None:
                # a tenant holding no vGPU opens an empty GPU at its smallest size (as many MiB fit, and more
                # vGPUs), or joins a size a tenant holding vGPUs gives it
                known = {sz for k, t in enumerate(ts) if t.sliced for sz in per[k]}
                per = [sizes if t.sliced or not sizes else {min(sizes)} | (sizes & known if any_size else set())
                       for t, sizes in zip(ts, per)]
        state.append((g, not here, free, size, bool(g.mig_slices), per, len(sliced)))
    start = tuple((n.vgpus, n.framebuffer_mib, n.mig_slices) for n in wanted)
    pt = sum(n.passthrough_gpus for n in wanted)
    steps = [0]
    failed: Set[tuple] = set()

    def tick() -> None:
        steps[0] += 1
        if steps[0] > limit:
            raise _Unknown()

    def options(i: int, rem: tuple, p: int):
        """What GPU ``i`` may give, lazily, the most first: ``(demand left, passthrough left)``."""
        g, empty, free, size, mig, per, count = state[i]
        if empty and p:
            yield rem, p - 1
        if free <= 0:
            return
        if mig:
            def share(k: int, left: int, r: list):
                tick()
                if k == nt:
                    yield tuple(r), p
                    return
                n, f, sl_need = r[k]
                for fb, sl in (per[k] if (n or f or sl_need) else ()):
                    most = min(max(n, _ceil(f, fb), _ceil(sl_need, sl)), left // sl)
                    if most > 0:
                        r2 = list(r)
                        r2[k] = (max(0, n - most), max(0, f - most * fb), max(0, sl_need - most * sl))
                        yield from share(k + 1, left - most * sl, r2)
                yield from share(k + 1, left, r)
            yield from share(0, free, list(rem))
            return
        sizes: Dict[int, List[int]] = {}
        for k in range(nt):
            if rem[k][0] or rem[k][1]:
                for sz in per[k]:
                    sizes.setdefault(sz, []).append(k)
        for sz, who in sorted(sizes.items()):

            def give(idx: int, left: int, r: list, joined: List[int]):
                tick()
                if idx == len(who):
                    if joined:
                        yield tuple(r), p
                    return
                k = who[idx]
                n, f, _ = r[k]
                need = max(n, _ceil(f, sz))
                opens = not ts[k].sliced and not any_size
                if left and need and not (opens and (joined or size is not None)) \
                        and not any(pair[k][j] for j in joined):
                    take = min(need, left)
                    # every split that gives it all it can after the tenants before it (the rest: those after)
                    low = take if idx == len(who) - 1 else 1
                    for m in range(take, low - 1, -1):
                        r2 = list(r)
                        r2[k] = (max(0, n - m), max(0, f - m * sz), r[k][2])
                        yield from give(idx + 1, left - m, r2, joined + [k])
                yield from give(idx + 1, left, r, joined)
            top = g.most(sz)
            yield from give(0, free // sz if top is None else max(0, min(free // sz, top - count)), list(rem), [])

    # bounds: what the GPUs from i on could give each tenant at most (vGPUs, MiB, slices), and empty GPUs
    most = [[(0, 0, 0)] * nt for _ in range(len(state) + 1)]
    empties = [0] * (len(state) + 1)
    mib = [0] * (len(state) + 1)                    # MiB any tenant could have
    settled = [[False] * nt for _ in range(len(state) + 1)]   # a GPU from i on, not empty, serves it
    # exclusive tenants no MIG GPU serves (MIG-backed vGPUs share a GPU with anyone)
    alone = [ts[k].t.isolation == EXCLUSIVE and not any(st[4] and st[5][k] for st in state) for k in range(nt)]
    for i in range(len(state) - 1, -1, -1):
        g, empty, free, size, mig, per, _ = state[i]
        empties[i] = empties[i + 1] + empty
        mib[i] = mib[i + 1] + (max([max((free // x[1]) * x[0] for x in pk) for pk in per if pk] or [0]) if mig
                               else (free if any(per) else 0))
        settled[i] = [settled[i + 1][k] or (not empty and free > 0 and bool(per[k])) for k in range(nt)]
        row = []
        for k in range(nt):
            u, m, sl = most[i + 1][k]
            if free > 0 and per[k]:
                if mig:
                    u += max(free // x[1] for x in per[k])
                    m += max((free // x[1]) * x[0] for x in per[k])
                    sl += free
                else:
                    u += free // min(per[k])
                    m += free
            row.append((u, m, sl))
        most[i] = row

    def go(i: int, rem: tuple, p: int) -> bool:
        if p == 0 and all(not any(x) for x in rem):
            return True
        if i == len(state):
            return False
        key = (i, rem, p)
        if key in failed:
            return False
        tick()
        # exclusive tenants with no GPU of their own left take an empty GPU each, as passthrough does
        fresh = sum(1 for k in range(nt) if alone[k] and (rem[k][0] or rem[k][1]) and not settled[i][k])
        if p + fresh > empties[i] or sum(r[1] for r in rem) > mib[i] \
                or any(n > u or f > m or sl > c for (n, f, sl), (u, m, c) in zip(rem, most[i])):
            failed.add(key)
            return False
        seen = set()
        for r2, p2 in _then(options(i, rem, p), (rem, p)):
            if (r2, p2) in seen:
                continue
            seen.add((r2, p2))
            if go(i + 1, r2, p2):
                return True
        failed.add(key)
        return False

    try:
        ok = go(0, start, pt)
    except _Unknown:
        return Verdict(None, f"could not be decided within {limit} search steps")
    if ok:
        return Verdict(True)
    return Verdict(False, "; ".join(_need_text(n, t) for n, t in zip(wanted, ts)))


def _then(first, last):
    """``first``'s items, then ``last`` (itertools.chain without the import: the qemu hook's path)."""
    yield from first
    yield last


def _need_text(n: Need, t: _Tenant) -> str:
    sizes = sorted(set(t.sliced.values()))
    return n.text() if len(sizes) != 1 else f"tenant {n.tenant!r}: " + n.what(sizes[0])


def need_text(n: Need, tenants: Mapping[str, Tenant], allocations: Sequence[Allocation]) -> str:
    """``tenant 'a': 1 vGPU(s) of 8192 MiB`` (the size it uses, where it uses one)."""
    return _need_text(n, _Tenant(tenant_named(tenants, n.tenant) or Tenant(n.tenant), allocations))


def at_risk(tenants: Mapping[str, Tenant], allocations: Sequence[Allocation], gpus: Sequence[HostGpu],
            serves: Callable[[str, str], bool], order: Sequence[str] = ()) -> Tuple[List[str], bool]:
    """``(tenants whose unused guarantee cannot be served beside the others', decided)``.

    Tenants are taken in ``order`` (names; the rest by name after them): each joins the set kept when
    the set and it can still be served together (:func:`search`, ``any_size``), else it is at risk.
    ``decided`` False when a search could not decide (its tenant is not called at risk).
    """
    every = needs(tenants, allocations)
    rank = {n.lower(): i for i, n in enumerate(order)}
    every.sort(key=lambda n: (rank.get(n.tenant.lower(), len(rank)), n.tenant))
    kept: List[Need] = []
    out: List[str] = []
    decided = True
    for n in every:
        v = search(kept + [n], tenants=tenants, allocations=allocations, gpus=gpus, serves=serves)
        if v.ok is False:
            out.append(n.tenant)
        else:
            decided = decided and v.ok is not None
            kept.append(n)
    return out, decided


@record(frozen=True)
class Risk:
    """The guarantees that cannot all be kept: ``tenants`` at risk (names), ``decided`` False where a
    search was left undecided, ``text``: one line naming what cannot be served beside what."""

    tenants: Tuple[str, ...] = ()
    decided: bool = True
    text: str = ""
    reasons: Tuple[Tuple[str, str], ...] = ()       # (tenant, its unused guarantee: "1 passthrough GPU(s)")


def risk(tenants: Mapping[str, Tenant], allocations: Sequence[Allocation], gpus: Sequence[HostGpu],
         serves: Callable[[str, str], bool], order: Sequence[str] = ()) -> Risk:
    """:func:`at_risk` with the words: ``tenant 'p': 1 passthrough GPU(s) cannot be served beside the
    unused guarantees of tenant 'x' (exclusive)`` (``cannot be served on this host`` when alone)."""
    names, decided = at_risk(tenants, allocations, gpus, serves, order)
    if not names:
        return Risk((), decided)
    every = {n.tenant: n for n in needs(tenants, allocations)}
    low = {n.lower() for n in names}
    kept = [t for t in every if t.lower() not in low]
    texts = {n: need_text(every[n], tenants, allocations) for n in names}
    reasons = tuple((n, texts[n].split(": ", 1)[1]) for n in names)

    def who(name: str) -> str:
        t = tenant_named(tenants, name)
        return f"tenant {name!r}" + (f" ({t.isolation})" if t is not None and t.isolation != SHARED else "")
    where = (f"beside the unused guarantees of {', '.join(who(k) for k in kept)}" if kept else "on this host")
    return Risk(tuple(names), decided, "; ".join(texts[n] for n in names) + f" cannot be served {where}", reasons)


class Reserve:
    """The room other tenants' unused guarantees hold, for use no guarantee covers (admission's reserve).

    ``Reserve(me, ...)``: every tenant's but ``me``'s unused guarantee, as
    :func:`needs` finds it.  :meth:`breaks` says which of them one more
    device would leave unservable.  Both readings of an unknown size are
    kept (module docstring); where the guarantees cannot all be served now
    (oversubscribed), each tenant's that can be served alone must stay so.
    """

    def __init__(self, me: Optional[str], *, tenants: Mapping[str, Tenant], allocations: Sequence[Allocation],
                 gpus: Sequence[HostGpu], serves: Callable[[str, str], bool]):
        self.tenants, self.allocations, self.gpus, self.serves = tenants, list(allocations), list(gpus), serves
        self.wanted = needs(tenants, allocations, exclude=me)
        self._before: Dict[bool, Tuple[bool, List[Need]]] = {}

    def _run(self, wanted: Sequence[Need], allocations: Sequence[Allocation], any_size: bool) -> Verdict:
        return search(wanted, tenants=self.tenants, allocations=allocations, gpus=self.gpus, serves=self.serves,
                      any_size=any_size)

    def _kept(self, any_size: bool) -> Tuple[bool, List[Need]]:
        """``(all together, the needs to keep servable)`` before the request."""
        if any_size not in self._before:
            v = self._run(self.wanted, self.allocations, any_size)
            if v.ok is not False:
                self._before[any_size] = (True, self.wanted if v.ok else [])
            else:
                self._before[any_size] = (False, [n for n in self.wanted
                                                  if self._run([n], self.allocations, any_size).ok is True])
        return self._before[any_size]

    def breaks(self, extra: Allocation) -> Tuple[List[Need], bool]:
        """``(the needs ``extra`` would leave unservable, only at the size a tenant holding no vGPU asks)``;
        empty when it leaves them all as servable as before (an undecided search does not refuse)."""
        if not self.wanted:
            return [], False
        after = [*self.allocations, extra]
        for any_size in (True, False):
            together, kept = self._kept(any_size)
            if not kept:
                continue
            if together:
                if self._run(kept, after, any_size).ok is False:
                    bad = [n for n in kept if self._run([n], after, any_size).ok is False] or kept
                    return bad, not any_size
            else:
                bad = [n for n in kept if self._run([n], after, any_size).ok is False]
                if bad:
                    return bad, not any_size
        return [], False

    def other_size(self, n: Need, framebuffer_mib: int) -> bool:
        """Does ``n``'s tenant use time-sliced vGPUs, none of ``framebuffer_mib`` MiB, and share GPUs
        (not ``exclusive``)?  Then a first vGPU of that size on an empty GPU keeps it out by its size."""
        t = _Tenant(tenant_named(self.tenants, n.tenant) or Tenant(n.tenant), self.allocations)
        return bool(t.sliced) and framebuffer_mib not in t.sliced.values() and t.t.isolation != EXCLUSIVE

    def text(self, bad: Sequence[Need]) -> str:
        return "; ".join(need_text(n, self.tenants, self.allocations) for n in bad)
