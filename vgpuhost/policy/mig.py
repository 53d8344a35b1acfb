"""MIG layouts, decided: parsing, naming, fitting and placing GPU instances (pure).

Owns: parsing a wanted layout (``3g.71gb=1,2g.35gb=1,1g.18gb=1``), resolving
its profile names against what the device reports (``1g.5gb`` on an A100-40GB
is profile id 19, on an H200 that id is ``1g.18gb``: names are resolved per
device, from the device, never from a table), the device's slices, why a
layout does not fit (:func:`why_not`) and choosing placements (:func:`place`:
a backtracking search, larger profiles first).  Must not: call NVML, read
files or build steps (:mod:`vgpuhost.plan.mig` plans, :mod:`vgpuhost.ops.mig`
runs).

Facts (the project's docs reference, sections 3 and 5): placements are
``(start, size)`` over the device's memory slices (8); compute slices are
bounded by the largest profile's (7 on A100/H100/H200, 4 on A30).  On the
vendor-specific VFIO path the order is :data:`ORDER` (``sriov-manage -e``
destroys GPU instances).
"""

from __future__ import annotations

import difflib
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..model.nvml import GiProfile, GpuInstance
from ..model.errors import InputError

ORDER = "MIG mode -> SR-IOV -> GPU instances -> mixed-size mode -> vGPUs"
MAX_COUNT = 64


_ENTRY_RE = re.compile(r"^\s*(?P<name>[0-9]+g\.[0-9]+gb(?:\+me)?)\s*(?:=\s*(?P<n>[0-9]{1,3})\s*)?$", re.I)


def parse_layout(text: str) -> Dict[str, int]:
    """``"3g.71gb=1,2g.35gb=1,1g.18gb"`` -> ``{"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 1}``.

    ``none`` is the empty layout (no GPU instances); an empty or blank text
    is refused (an unset shell variable must not destroy every instance).
    A bare profile means count 1; entries with count 0 are dropped.  Raises
    InputError for malformed text or a profile named twice.
    """
    text = (text or "").strip()
    if not text:
        raise InputError("empty MIG layout", hint="give PROFILE=COUNT pairs (3g.71gb=1,1g.18gb=2), "
                                                   "or 'none' to remove every GPU instance")
    if text.lower() == "none":
        return {}
    out: Dict[str, int] = {}
    seen = set()
    for part in text.split(","):
        m = _ENTRY_RE.match(part)
        if not m:
            raise InputError(f"invalid MIG layout entry {part.strip()[:60]!r}",
                             hint="give PROFILE=COUNT pairs separated by commas, e.g. 3g.71gb=1,1g.18gb=2")
        name = m["name"].lower()
        if name in seen:
            raise InputError(f"MIG layout names {name} twice")
        seen.add(name)
        n = int(m["n"]) if m["n"] is not None else 1
        if n > MAX_COUNT:
            raise InputError(f"MIG layout asks for {n} {name}; at most {MAX_COUNT}")
        if n:
            out[name] = n
    return out


def layout_text(counts: Mapping[str, int]) -> str:
    """``{"7g.141gb": 1, "1g.18gb": 7}`` -> ``7x1g.18gb + 1x7g.141gb`` (smaller first); ``none``."""
    parts = [f"{n}x{name}" for name, n in sorted(counts.items(), key=lambda kv: name_key(kv[0])) if n]
    return " + ".join(parts) if parts else "none"


def name_key(name: str) -> tuple:
    m = re.match(r"^(\d+)g\.(\d+)gb", name)
    return (int(m[1]), int(m[2]), name) if m else (999, 999, name)


def resolve_layout(profiles: Sequence[GiProfile], layout: Mapping[str, int], *,
                   where: str = "this GPU") -> Dict[int, int]:
    """Profile id -> count for ``layout`` (names as the device reports them, case-insensitive).

    Raises InputError naming near matches and the device's profiles when a
    name is not one of the device's.
    """
    by_name = {p.name.lower(): p for p in profiles}
    out: Dict[int, int] = {}
    for name, n in layout.items():
        p = by_name.get(name.lower())
        if p is None:
            names = [q.name for q in profiles]
            near = difflib.get_close_matches(name.lower(), names, n=4, cutoff=0.6)
            hint = (f"near matches: {', '.join(near)}; " if near else "") + \
                f"{where} offers: {', '.join(names) or 'no GPU-instance profiles'}"
            raise InputError(f"unknown GPU-instance profile {name!r} on {where}", hint=hint)
        out[p.profile_id] = out.get(p.profile_id, 0) + n
    return out


def memory_slices(profiles: Sequence[GiProfile]) -> int:
    return max((s + z for p in profiles for s, z in p.placements), default=0)


def compute_slices(profiles: Sequence[GiProfile]) -> int:
    return max((p.slices for p in profiles), default=0)


def names(profiles: Sequence[GiProfile], wanted: Mapping[int, int]) -> Dict[str, int]:
    by_id = {p.profile_id: p for p in profiles}
    return {by_id[i].name if i in by_id else f"profile {i}": n for i, n in wanted.items() if n}


def why_not(profiles: Sequence[GiProfile], wanted: Mapping[int, int]) -> Optional[str]:
    """None when ``wanted`` (profile id -> count) fits an empty GPU, else the reason, e.g.
    ``7x1g.18gb + 1x7g.141gb needs 15 of 8 memory slices``."""
    by_id = {p.profile_id: p for p in profiles}
    text = layout_text(names(profiles, wanted))
    for pid, n in sorted(wanted.items()):
        p = by_id[pid]
        if n > p.max_count:
            return f"{text}: {n}x{p.name} exceeds the device's maximum of {p.max_count} {p.name}"
    mem = sum(by_id[pid].placements[0][1] * n for pid, n in wanted.items() if by_id[pid].placements)
    if mem > memory_slices(profiles):
        return f"{text} needs {mem} of {memory_slices(profiles)} memory slices"
    comp = sum(by_id[pid].slices * n for pid, n in wanted.items())
    if comp > compute_slices(profiles):
        return f"{text} needs {comp} of {compute_slices(profiles)} compute slices"
    if place(profiles, wanted) is None:
        return (f"{text} has no placement: " + ", ".join(
            f"{p.name} starts at {'/'.join(str(s) for s, _ in p.placements)}"
            for p in profiles if wanted.get(p.profile_id)))
    return None


def _size_order(p: GiProfile) -> tuple:
    size = p.placements[0][1] if p.placements else 0
    return (-size, -p.slices, len(p.placements), p.profile_id)


def place(profiles: Sequence[GiProfile], wanted: Mapping[int, int],
          occupied: Sequence[GpuInstance] = ()) -> Optional[List[Tuple[GiProfile, int]]]:
    """Placements ``[(profile, start)]`` for ``wanted`` beside ``occupied``, or None.

    Larger profiles first; a backtracking search over the device's placements
    so that each choice leaves room for the rest; respects max counts
    (counting ``occupied``) and the compute slices.
    """
    by_id = {p.profile_id: p for p in profiles}
    occ = 0
    used = 0
    have: Dict[int, int] = {}
    for g in occupied:
        occ |= ((1 << g.size) - 1) << g.start
        used += by_id[g.profile_id].slices if g.profile_id in by_id else 0
        have[g.profile_id] = have.get(g.profile_id, 0) + 1
    for pid, n in wanted.items():
        if pid not in by_id or have.get(pid, 0) + n > by_id[pid].max_count:
            return None
    items = [by_id[pid] for pid in sorted(wanted, key=lambda i: _size_order(by_id[i])) for _ in range(wanted[pid])]
    # try first the placements that overlap the fewest of the device's placements: a lone 3g
    # goes to slices 4-7 and 1g from the top, leaving room for what comes later
    every = [pl for p in profiles for pl in p.placements]

    def blocks(start: int, size: int) -> int:
        return sum(1 for s, z in every if start < s + z and s < start + size)

    tries = {p.profile_id: sorted(p.placements, key=lambda pl: (blocks(*pl), pl[0])) for p in profiles}
    left = compute_slices(profiles) - used
    out: List[Tuple[GiProfile, int]] = []

    def search(i: int, occ: int, left: int, prev: int) -> bool:
        if i == len(items):
            return True
        p = items[i]
        if p.slices > left:
            return False
        same = i > 0 and items[i - 1].profile_id == p.profile_id
        for k, (start, size) in enumerate(tries[p.profile_id]):
            if same and k <= prev:
                continue                      # identical GPU instances: one order only
            mask = ((1 << size) - 1) << start
            if occ & mask:
                continue
            out.append((p, start))
            if search(i + 1, occ | mask, left - p.slices, k):
                return True
            out.pop()
        return False

    return out if search(0, occ, left, -1) else None



def counts(profiles: Sequence[GiProfile], gis: Sequence[GpuInstance]) -> Dict[str, int]:
    by_id = {p.profile_id: p for p in profiles}
    out: Dict[str, int] = {}
    for g in gis:
        n = profile_name(by_id, g.profile_id)
        out[n] = out.get(n, 0) + 1
    return out



def profile_name(by_id: Mapping[int, GiProfile], pid: int) -> str:
    return by_id[pid].name if pid in by_id else f"profile {pid}"


__all__ = ["ORDER", "MAX_COUNT", "parse_layout", "layout_text", "name_key", "resolve_layout", "memory_slices",
           "compute_slices", "names", "why_not", "place", "counts", "profile_name"]
