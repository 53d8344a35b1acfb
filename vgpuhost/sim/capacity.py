"""How many vGPUs of each type a simulated GPU can still take.

Owns: the simulator's model of the NVIDIA vGPU manager's capacity rules,
as pure functions over plain data.  Must not: read or write files.

Rules (docs/reference/hardware.md#mdev, #vgpu-types):
- equal-size mode (default): every time-sliced vGPU on a GPU has the same
  framebuffer size; once one exists only types of that size report free
  instances, up to that type's max instances minus those present;
- mixed-size mode: each type up to its mixed-size max, each vGPU at a
  free placement id (:mod:`vgpuhost.model.mixedsize`: a vGPU's range of
  placement units overlaps no other's, so free framebuffer that no valid id
  reaches is fragmentation, not room);
- MIG-backed types need MIG mode and a free GPU instance of their profile:
  each GPU instance holds one MIG-backed vGPU, so the free count of profile
  P is the GPU instances of P (``gpu_instances``, kept by the simulated
  NVML, plus any seeded ``free_gpu_instances[P]``) less the MIG-backed vGPUs
  present of types on P; time-sliced types are unavailable in MIG mode;
- on SR-IOV GPUs each VF holds at most one vGPU, so a VF reports 0 or 1.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..model import mixedsize


def grid_units(gpu: Mapping) -> int:
    """The GPU's mixed-size placement units (:func:`vgpuhost.model.mixedsize.grid`)."""
    return mixedsize.grid((t["fb_mib"] // 1024, t.get("max_mixed", 0)) for t in gpu["types"].values()
                          if not t.get("gi_profile"))


def taken_of(gpu: Mapping, placed: Iterable[Tuple[str, Optional[int]]]) -> List[Tuple[int, int]]:
    """``(placement id, placement size)`` of the time-sliced vGPUs present that have a placement id
    (``placed``: ``(type id, placement id or None)`` per vGPU)."""
    types = gpu["types"]
    return [(pid, types[t]["fb_mib"] // 1024) for t, pid in placed
            if pid is not None and t in types and not types[t].get("gi_profile")]


def gpu_available(gpu: Mapping, instances: Iterable[str],
                  placements: Optional[Sequence[Optional[int]]] = None) -> Dict[str, int]:
    """Free instances per type id on one physical GPU.

    ``gpu`` is the GPU's entry in the simulator's ``host.json``: ``types``
    maps type id -> ``{fb_mib, max, max_mixed, gi_profile}``; plus
    ``mixed_size``, ``mig_mode``, ``framebuffer_mib``, ``gpu_instances``
    (``[{profile, ...}]``) and ``free_gpu_instances`` (profile name -> count
    of GPU instances not listed in ``gpu_instances``, a seed).  ``instances``
    lists the type id of every vGPU present; ``placements`` (mixed-size mode) the placement id of
    each, in the same order (None: unknown).  Returns ``{type_id: n}`` with n >= 0.
    """
    types = gpu["types"]
    present: List[str] = list(instances)
    counts: Dict[str, int] = {}
    for t in present:
        counts[t] = counts.get(t, 0) + 1
    mig_mode = bool(gpu.get("mig_mode"))
    mixed = bool(gpu.get("mixed_size"))
    free_gi = dict(gpu.get("free_gpu_instances") or {})
    for gi in gpu.get("gpu_instances") or []:
        free_gi[gi["profile"]] = free_gi.get(gi["profile"], 0) + 1
    for t in present:
        gi_profile = types.get(t, {}).get("gi_profile")
        if gi_profile:
            free_gi[gi_profile] = free_gi.get(gi_profile, 0) - 1
    used_fb = sum(types[t]["fb_mib"] for t in present if t in types)
    sizes = {types[t]["fb_mib"] for t in present if t in types and not types[t].get("gi_profile")}
    out: Dict[str, int] = {}
    units = grid_units(gpu) if mixed else 0
    taken = taken_of(gpu, zip(present, placements or [None] * len(present))) if mixed else []
    for tid, t in types.items():
        if t.get("gi_profile"):
            out[tid] = max(0, free_gi.get(t["gi_profile"], 0)) if mig_mode else 0
            continue
        if mig_mode:
            out[tid] = 0
            continue
        if mixed:
            left = t["max_mixed"] - counts.get(tid, 0)
            by_fb = (gpu["framebuffer_mib"] - used_fb) // t["fb_mib"] if t["fb_mib"] else 0
            by_ids = mixedsize.fits_count(units, t["fb_mib"] // 1024, t["max_mixed"], taken, counts.get(tid, 0))
            out[tid] = max(0, min(left, by_fb, by_ids))
            continue
        if sizes and t["fb_mib"] not in sizes:
            out[tid] = 0
            continue
        same_size = sum(n for other, n in counts.items() if types.get(other, {}).get("fb_mib") == t["fb_mib"]
                        and not types[other].get("gi_profile"))
        out[tid] = max(0, t["max"] - same_size)
    return out
