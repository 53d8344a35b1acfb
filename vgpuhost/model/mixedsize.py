"""Mixed-size mode's placement grid: which placement ids a time-sliced vGPU type may take on one GPU.

Owns: the pure model of NVIDIA's vGPU placements in mixed-size (heterogeneous)
mode, from a board's catalog facts (framebuffer GB and mixed-size maxima,
``vgpuhost/data/catalog.yaml``): :func:`grid`, :func:`placement_ids`,
:func:`free_ids` and :func:`best_id`.  The simulated kernel uses it to place
and count vGPUs, admission and the bench to count what still fits.
Must not: read anything; decide which GPU (``vgpuhost.policy.placement`` does).

The model (docs/reference/hardware.md#vgpu-types, "Mixed-size mode"): a GPU's
framebuffer is a row of placement units, one per GB of its largest
time-sliced type (A40: 48, L4: 24).  A type of F GB with mixed-size max M
occupies F units (its placement size) starting at one of its placement ids
``0, S, 2S, ...`` with spacing ``S = units // M`` (at least F), so at most M
of it fit: NVIDIA's own example, L4-6Q, has size 6 and ids 0 6 12 18.  Two
vGPUs never overlap, so a GPU can hold free framebuffer no valid id reaches:
that is the fragmentation ``capacity`` reports.  On a real host the driver
lists the ids (``nvmlDeviceGetVgpuTypeSupportedPlacements``); the spacing
rule is vgpuhost's reading of NVIDIA's tables, *unconfirmed* beyond the L4
example.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple


def grid(types: "Iterable[Tuple[int, int]]") -> int:
    """Placement units of a GPU: the framebuffer GB of its largest time-sliced type.

    ``types``: ``(framebuffer GB, mixed-size max)`` per time-sliced type the GPU offers.
    Returns 0 when it offers none (no grid: nothing fits in mixed-size mode).
    """
    return max((gb for gb, mx in types if mx > 0 and gb > 0), default=0)


def placement_ids(units: int, size_gb: int, max_mixed: int) -> "List[int]":
    """The placement ids of a type of ``size_gb`` GB (its placement size, in units) with mixed-size
    max ``max_mixed`` on a grid of ``units``: ``[0, S, 2S, ...]``, at most ``max_mixed`` of them, each
    with ``id + size_gb <= units``.  Empty for a type that does not fit the grid."""
    if units <= 0 or size_gb <= 0 or max_mixed <= 0 or size_gb > units:
        return []
    spacing = max(size_gb, units // max_mixed)
    return [i * spacing for i in range(max_mixed) if i * spacing + size_gb <= units]


def _overlaps(start: int, size: int, taken: "Sequence[Tuple[int, int]]") -> bool:
    return any(start < s + z and s < start + size for s, z in taken)


def free_ids(units: int, size_gb: int, max_mixed: int, taken: "Sequence[Tuple[int, int]]") -> "List[int]":
    """The placement ids of the type still free: those whose range overlaps none of ``taken``
    (``(placement id, placement size)`` of the vGPUs present, units)."""
    return [p for p in placement_ids(units, size_gb, max_mixed) if not _overlaps(p, size_gb, taken)]


def fits_count(units: int, size_gb: int, max_mixed: int, taken: "Sequence[Tuple[int, int]]",
               present_of_type: int = 0) -> int:
    """How many more of the type fit, one after another, each at a free id (greedy, lowest first),
    capped by its mixed-size max less ``present_of_type``."""
    left = max_mixed - present_of_type
    placed = list(taken)
    n = 0
    for p in placement_ids(units, size_gb, max_mixed):
        if n >= left:
            break
        if not _overlaps(p, size_gb, placed):
            placed.append((p, size_gb))
            n += 1
    return n


def best_id(units: int, size_gb: int, max_mixed: int, taken: "Sequence[Tuple[int, int]]") -> "Optional[int]":
    """The best-fit free placement id: the one in the smallest free gap (the run of units no vGPU
    holds around it), lowest id on a tie, so large runs stay whole for large types.  None: none free."""
    free = free_ids(units, size_gb, max_mixed, taken)
    if not free:
        return None

    def gap(p: int) -> int:
        lo = max([s + z for s, z in taken if s + z <= p], default=0)
        hi = min([s for s, _ in taken if s >= p + size_gb], default=units)
        return hi - lo

    return min(free, key=lambda p: (gap(p), p))
