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
framebuffer size) admits only the size it holds, and a GPU in mixed-size mode
only what free placement ids take (:mod:`vgpuhost.model.mixedsize`).  ``blocked`` is the difference.  MIG-backed profiles are counted as
the kernel offers them (free GPU instances), without a framebuffer sum.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple


def summarise(gpus: Sequence[dict],
              per_type: Sequence[Tuple[str, int, bool, Sequence[Tuple[str, int, Optional[int]]]]],
              admitted: Optional[Mapping[str, Tuple[int, str, str]]] = None) -> dict:
    """The capacity document.

    ``gpus``: ``{"gpu", "pool", "framebuffer_mib", "free_mib", "exclusive"}`` per
    vGPU-capable GPU (MiB; None when unknown; ``exclusive``: the exclusive
    tenant whose vGPUs hold it, whose free framebuffer is then no one
    else's); ``per_type``: ``(profile,
    framebuffer MiB, MIG-backed?, [(gpu, instances free now, instances the GPU could still hold or
    None)])``; ``admitted`` (a tenant's capacity): per profile ``(how many admission would admit
    in all, why not one more, the refusal's code)``, which is then ``fits`` and ``why_not``, ``by_gpu``
    what each GPU alone would take and ``by_pool`` its sum per pool, at most ``fits``
    (fragmentation is named only where placement, not another rule, refused).  Returns
    ``{"gpus": [...], "profiles": [{"profile", "framebuffer_mib",
    "mig_backed", "fits", "by_gpu": {gpu: n}, "by_pool": {pool: n},
    "framebuffer_would_allow", "blocked", "note"[, "why_not"]}]}``.
    """
    pool_of = {g["gpu"]: g["pool"] for g in gpus}
    ex = {g["gpu"]: g.get("exclusive") for g in gpus}
    dr = {g["gpu"]: g.get("drift") for g in gpus}
    free_of: Dict[str, Optional[int]] = {g["gpu"]: g["free_mib"] for g in gpus}
    profiles: List[dict] = []
    for name, fb, mig, offers in per_type:
        by_gpu = {g: n for g, n, _ in offers}
        by_pool: dict = {}
        for g, n, _ in offers:
            p = pool_of.get(g, "default")
            by_pool[p] = by_pool.get(p, 0) + n
        fits = sum(by_gpu.values())
        why_not = code = None
        if admitted is not None:
            fits, why_not, code = admitted.get(name, (0, "", "capacity"))
            by_pool = {p: min(n, fits) for p, n in by_pool.items()}     # each GPU's count is what it alone takes
        # the free framebuffer of a GPU no one may join (an exclusive tenant's, when it takes nothing
        # here) is no room for this request
        frees_of = {g: (0 if n == 0 and (ex.get(g) or dr.get(g)) else free_of.get(g)) for g, n, _ in offers}
        would: Optional[int] = None
        blocked = 0
        note = ""
        if not mig and fb and code in (None, "capacity"):
            frees = [frees_of.get(g) for g, _, _ in offers]
            if all(f is not None for f in frees):
                would = sum(frees) // fb
                caps = [c for _, _, c in offers]
                if all(c is not None for c in caps):
                    would = min(would, sum(caps))
                blocked = max(0, would - fits)
                if blocked:
                    largest = max(((frees_of[g] or 0, g) for g, _, _ in offers), default=(0, ""))
                    note = (f"fragmentation: {sum(frees)} MiB free in all would hold {would} more, "
                            f"placement finds {fits} (largest free on one GPU: {largest[0]} MiB on {largest[1]}; "
                            f"a GPU in equal-size mode holding another vGPU size admits only that size; one in "
                            f"mixed-size mode only free placement ids)")
        doc = {"profile": name, "framebuffer_mib": fb, "mig_backed": mig, "fits": fits,
               "by_gpu": by_gpu, "by_pool": by_pool, "framebuffer_would_allow": would,
               "blocked": blocked, "note": note}
        if admitted is not None:
            doc["why_not"] = why_not or ""
        profiles.append(doc)
    return {"gpus": list(gpus), "profiles": profiles}
