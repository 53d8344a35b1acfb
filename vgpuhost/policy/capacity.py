"""Capacity: what more fits now, per vGPU profile, pool and GPU, and what fragmentation keeps out.  Pure.

Owns: :func:`summarise`, the body of ``vgpuhost capacity``.  Must not: read
the host or the store (``vgpuhost.ops.tenancy.capacity`` gathers the
inputs).

Fragmentation: for a time-sliced profile of ``F`` MiB, the free framebuffer
summed over the GPUs that offer it would allow ``sum(free) // F`` more
(capped by the instances the GPUs could still hold: free VFs, or the
type's max instances less the vGPUs present);
placement can use only what one GPU holds, and a GPU in equal-size mode
(NVIDIA vGPU user guide: without mixed-size mode one GPU holds vGPUs of one
framebuffer size) admits only the size it holds.  ``blocked`` is the difference.  MIG-backed profiles are counted as
the kernel offers them (free GPU instances), without a framebuffer sum.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def summarise(gpus: Sequence[dict],
              per_type: Sequence[Tuple[str, int, bool, Sequence[Tuple[str, int, Optional[int]]]]]) -> dict:
    """The capacity document.

    ``gpus``: ``{"gpu", "pool", "framebuffer_mib", "free_mib"}`` per
    vGPU-capable GPU (MiB; None when unknown); ``per_type``: ``(profile,
    framebuffer MiB, MIG-backed?, [(gpu, instances free now, instances the GPU could still hold or
    None)])``.  Returns
    ``{"gpus": [...], "profiles": [{"profile", "framebuffer_mib",
    "mig_backed", "fits", "by_gpu": {gpu: n}, "by_pool": {pool: n},
    "framebuffer_would_allow", "blocked", "note"}]}``.
    """
    pool_of = {g["gpu"]: g["pool"] for g in gpus}
    free_of = {g["gpu"]: g["free_mib"] for g in gpus}
    profiles: List[dict] = []
    for name, fb, mig, offers in per_type:
        by_gpu = {g: n for g, n, _ in offers}
        by_pool: dict = {}
        for g, n, _ in offers:
            p = pool_of.get(g, "default")
            by_pool[p] = by_pool.get(p, 0) + n
        fits = sum(by_gpu.values())
        would: Optional[int] = None
        blocked = 0
        note = ""
        if not mig and fb:
            frees = [free_of.get(g) for g, _, _ in offers]
            if all(f is not None for f in frees):
                would = sum(frees) // fb
                caps = [c for _, _, c in offers]
                if all(c is not None for c in caps):
                    would = min(would, sum(caps))
                blocked = max(0, would - fits)
                if blocked:
                    largest = max(((free_of[g], g) for g, _, _ in offers), default=(0, ""))
                    note = (f"fragmentation: {sum(frees)} MiB free in all would hold {would} more, "
                            f"placement finds {fits} (largest free on one GPU: {largest[0]} MiB on {largest[1]}; "
                            f"a GPU holding another vGPU size admits only that size)")
        profiles.append({"profile": name, "framebuffer_mib": fb, "mig_backed": mig, "fits": fits,
                         "by_gpu": by_gpu, "by_pool": by_pool, "framebuffer_would_allow": would,
                         "blocked": blocked, "note": note})
    return {"gpus": list(gpus), "profiles": profiles}
