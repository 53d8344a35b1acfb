"""Property tests of vGPU placement over random request sequences on a 4-GPU host.

Properties (issue 4): no placement ever violates a type's max instances,
equal-size mode or anti-affinity (nor one vGPU per VM per GPU), and every
strategy admits a request whenever some GPU could hold it — and then picks
the GPU its documented rule names.

Two ways of checking:

(a) the pure :func:`vgpuhost.placement.place` against a small capacity model
    kept here, written from docs/reference/hardware.md#vgpu-types (equal-size mode: one framebuffer
    size per GPU, up to that type's max; mixed-size mode: each type up to its
    mixed-size max while framebuffer remains), on two A40s and two A100s, one
    A100 in mixed-size mode.  The model is also compared with the
    simulator's own capacity rules (:mod:`vgpuhost.sim.capacity`).
(b) fewer, slower examples through the real ``create``/``remove`` on a
    simulated host of 4 A40s on the classic mdev path (one in mixed-size
    mode): what the model says could fit is computed from the tree and the
    state store before each request; the invariants are read back from the
    tree afterwards.
"""

from __future__ import annotations

import collections
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from vgpuhost.model.errors import RefusedError
from vgpuhost.observe.inventory import discover
from vgpuhost.policy.placement import MANUAL, RESERVE_EMPTY, RESERVING, STRATEGIES, GpuOffer, Request, place
from vgpuhost.sim.build import materialise
from vgpuhost.sim.capacity import gpu_available
from vgpuhost.sim.catalog import load_catalog
from vgpuhost.sim.spec import parse_spec
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress
from vgpuhost.ops.vgpu import create, remove

A = PciAddress.parse
OWNERS = [MANUAL, "00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000002",
          "00000000-0000-4000-8000-000000000003"]
KEYS = [None, "db", "web"]
CATALOG = load_catalog()


@dataclass(frozen=True)
class TypeDef:
    type_id: str
    name: str
    fb: int
    max: int
    max_mixed: int


def board_types(model: str) -> Dict[str, TypeDef]:
    """Time-sliced types of a catalog board, by name (MIG-backed ones need MIG mode: left out)."""
    g = CATALOG.gpus[model]
    return {t.name: TypeDef(f"nvidia-{t.type_id}", t.name, t.framebuffer_mib, t.max_instances,
                            t.max_instances_mixed)
            for t in g.vgpu_types if not t.gi_profile}


# --- the capacity model ---------------------------------------------------------

@dataclass
class ModelGpu:
    address: PciAddress
    numa: int
    model: str
    mixed: bool
    types: Dict[str, TypeDef]
    framebuffer: int
    present: List[Tuple[str, str, Optional[str]]] = field(default_factory=list)   # (type name, owner, key)
    #: mixed-size mode on a real tree: the ``(placement id, size GB)`` of the vGPUs present (their
    #: ``nvidia/placement_id``); a type then fits only at a free id (model/mixedsize's rule), not wherever
    #: framebuffer remains.  None: framebuffer alone (the pure model of (a))
    taken: Optional[List[Tuple[int, int]]] = None

    def available(self, name: str) -> int:
        """Free instances of ``name`` here by docs/reference/hardware.md#vgpu-types (0 when not offered)."""
        t = self.types.get(name)
        if t is None:
            return 0
        counts = collections.Counter(n for n, _, _ in self.present)
        if self.mixed:
            used = sum(self.types[n].fb for n, _, _ in self.present)
            n = max(0, min(t.max_mixed - counts[name], (self.framebuffer - used) // t.fb))
            if self.taken is not None and n:
                from vgpuhost.model.mixedsize import fits_count
                n = min(n, fits_count(self.framebuffer // 1024, t.fb // 1024, t.max_mixed, self.taken,
                                      counts[name]))
            return n
        sizes = {self.types[n].fb for n, _, _ in self.present}
        if sizes and t.fb not in sizes:
            return 0
        return max(0, t.max - sum(c for n, c in counts.items() if self.types[n].fb == t.fb))

    def could_hold(self, req: Request) -> bool:
        owners = {o for _, o, _ in self.present}
        keys = {k for _, _, k in self.present if k}
        return (self.available(req.profile) > 0
                and (req.owner == MANUAL or req.owner not in owners)
                and (req.anti_affinity is None or req.anti_affinity not in keys)
                and (req.gpu is None or req.gpu == self.address))

    def offer(self, name: str) -> GpuOffer:
        t = self.types.get(name)
        n = self.available(name)
        return GpuOffer(self.address, self.numa, t.type_id if t else None, name if t else None, n,
                        (self.address,) if n else (), frozenset(o for _, o, _ in self.present),
                        frozenset(k for _, _, k in self.present if k), len(self.present))

    def violations(self) -> List[str]:
        bad = []
        counts = collections.Counter(n for n, _, _ in self.present)
        for n, c in counts.items():
            limit = self.types[n].max_mixed if self.mixed else self.types[n].max
            if c > limit:
                bad.append(f"{self.address}: {c} x {n}, max {limit}")
        if self.mixed:
            if sum(self.types[n].fb for n in counts.elements()) > self.framebuffer:
                bad.append(f"{self.address}: framebuffer over-committed")
        else:
            sizes = {self.types[n].fb for n in counts}
            if len(sizes) > 1:
                bad.append(f"{self.address}: sizes {sorted(sizes)} in equal-size mode")
            elif sizes and sum(counts.values()) > max(self.types[n].max for n in counts):
                bad.append(f"{self.address}: {sum(counts.values())} vGPUs of one size")
        owners = collections.Counter(o for _, o, _ in self.present if o != MANUAL)
        keys = collections.Counter(k for _, _, k in self.present if k)
        bad += [f"{self.address}: owner {o} x{c}" for o, c in owners.items() if c > 1]
        bad += [f"{self.address}: anti-affinity key {k} x{c}" for k, c in keys.items() if c > 1]
        return bad

    def sim_dict(self) -> dict:
        """This GPU as the simulator's capacity rules take it."""
        return {"types": {t.type_id: {"fb_mib": t.fb, "max": t.max, "max_mixed": t.max_mixed, "gi_profile": None}
                          for t in self.types.values()},
                "mixed_size": self.mixed, "mig_mode": False, "framebuffer_mib": self.framebuffer}


def expected_choice(gpus: List[ModelGpu], req: Request) -> Optional[PciAddress]:
    """The GPU the strategy's documented rule names (placement.py docstring), or None."""
    fits = [g for g in gpus if g.could_hold(req)]
    if not fits:
        return None
    if req.numa_node is not None and any(g.numa == req.numa_node for g in fits):
        fits = [g for g in fits if g.numa == req.numa_node]
    if req.strategy == "first-fit":
        key = lambda g: g.address                                                # noqa: E731
    elif req.strategy == "best-fit":
        key = lambda g: (g.available(req.profile), g.address)                   # noqa: E731
    else:
        key = lambda g: (-g.available(req.profile), len(g.present), g.address)  # noqa: E731
    return min(fits, key=key).address


# --- (a) the pure function --------------------------------------------------------

PURE_GPUS = [("0000:01:00.0", 0, "A40", False), ("0000:02:00.0", 0, "A100-PCIE-40GB", True),
             ("0000:81:00.0", 1, "A40", False), ("0000:82:00.0", 1, "A100-PCIE-40GB", False)]
PURE_PROFILES = ["A40-4Q", "A40-8Q", "A40-8C", "A40-16Q", "A40-48Q",
                 "A100-4C", "A100-5C", "A100-8C", "A100-10C", "A100-20C"]


def pure_host() -> List[ModelGpu]:
    return [ModelGpu(A(bdf), numa, model, mixed, board_types(model), CATALOG.gpus[model].framebuffer_mib)
            for bdf, numa, model, mixed in PURE_GPUS]


requests = st.builds(
    Request,
    profile=st.sampled_from(PURE_PROFILES),
    owner=st.sampled_from(OWNERS),
    strategy=st.sampled_from(STRATEGIES),
    numa_node=st.sampled_from([None, None, 0, 1]),
    anti_affinity=st.sampled_from(KEYS),
    gpu=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([A(b) for b, *_ in PURE_GPUS])),
)
_place = st.tuples(st.just("place"), requests)
ops = st.lists(st.one_of(_place, _place, _place, st.tuples(st.just("release"), st.integers(0, 10_000))),
               min_size=20, max_size=80)    # three placements to a release: GPUs fill up


@settings(max_examples=400, deadline=None)
@given(ops)
def test_pure_place_respects_capacity_rules_and_admits_whatever_fits(sequence):
    gpus = pure_host()
    by_addr = {g.address: g for g in gpus}
    for op, arg in sequence:
        if op == "release":
            held = [(g, i) for g in gpus for i in range(len(g.present))]
            if held:
                g, i = held[arg % len(held)]
                g.present.pop(i)
            continue
        req: Request = arg
        for g in gpus:      # the model and the simulator's rules agree on what is free
            sim = gpu_available(g.sim_dict(), [g.types[n].type_id for n, _, _ in g.present])
            assert {t.name: sim[t.type_id] for t in g.types.values()} == \
                {n: g.available(n) for n in g.types}, f"{g.address}: model and simulator disagree"
        offers = [g.offer(req.profile) for g in gpus]
        d = place(offers, req)
        want = expected_choice(gpus, req)
        could = [g.address for g in gpus if g.could_hold(req)]
        assert d.admitted == bool(could), f"{req}: admitted={d.admitted} but could fit on {could}: {d.reason}"
        event("pure: admitted" if d.admitted else "pure: refused")
        if not any(g.available(req.profile) for g in gpus):
            event("pure: no GPU has a free instance of the type")
        if not d.admitted:
            pool = [g for g in gpus if req.gpu is None or g.address == req.gpu]
            assert len(d.rejected) == len(pool) and d.reason, d
            continue
        assert d.gpu in could and d.parent == d.gpu
        assert d.type_id == by_addr[d.gpu].types[req.profile].type_id
        assert d.gpu == want, f"{req.strategy} chose {d.gpu}, its rule names {want}: {d.reason}"
        by_addr[d.gpu].present.append((req.profile, req.owner, req.anti_affinity))
        bad = [v for g in gpus for v in g.violations()]
        assert not bad, bad


def test_pure_place_best_fit_lands_on_the_other_gpu_and_says_why():
    """Fill a GPU with 4C, ask for 8C: refused with the reason there; best-fit puts it on the other."""
    gpus = pure_host()
    a100, other = gpus[3], gpus[1]
    for _ in range(10):
        a100.present.append(("A100-4C", MANUAL, None))
    d = place([g.offer("A100-8C") for g in gpus], Request("A100-8C", gpu=a100.address))
    assert not d.admitted and "A100-8C" in d.reason and str(a100.address) in d.reason
    d = place([g.offer("A100-8C") for g in gpus], Request("A100-8C", strategy="best-fit"))
    assert d.gpu == other.address, d.reason


# --- (b) real create/remove on a simulated 4 x A40 host ------------------------------

A40_GPUS = [("0000:41:00.0", "0000:40:01.0", 0, False), ("0000:42:00.0", "0000:40:02.0", 0, False),
            ("0000:c1:00.0", "0000:c0:01.0", 1, False), ("0000:c2:00.0", "0000:c0:02.0", 1, True)]
A40_PROFILES = ["A40-8Q", "A40-8C", "A40-16Q", "A40-24Q", "A40-12C", "A40-48Q"]
A40_WEIGHTED = A40_PROFILES + ["A40-24Q", "A40-48Q", "A40-48Q"]   # large ones fill 4 GPUs in few steps


def a40_spec() -> str:
    lines = ["version: 1", "name: four-a40", "summary: 4 x A40 on classic mdev, one in mixed-size mode",
             "host:", "  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]",
             "devices:"]
    for bdf, port, numa, mixed in A40_GPUS:
        lines.append(f'  - {{bdf: "{port}", model: intel-root-port, numa_node: {numa}}}')
        lines.append(f'  - {{bdf: "{bdf}", model: A40, upstream: "{port}", numa_node: {numa}, '
                     f"vgpu: {{backend: mdev, mixed_size: {str(mixed).lower()}}}}}")
    return "\n".join(lines) + "\n"


A40_SPEC = parse_spec(a40_spec())
A40_TYPES = board_types("A40")


def model_of_host(host, store) -> List[ModelGpu]:
    """The model's view built from the tree (vGPUs per GPU) and the records (owners, keys)."""
    inv = discover(Sysfs(host))
    recs = {r.id: r for r in store.vgpu_records()}
    by_id = {t.type_id: t for t in A40_TYPES.values()}
    gpus = []
    for bdf, _, numa, mixed in A40_GPUS:
        g = ModelGpu(A(bdf), numa, "A40", mixed, A40_TYPES, CATALOG.gpus["A40"].framebuffer_mib,
                     taken=[] if mixed else None)
        for m in inv.mdevs:
            if m.parent == g.address:
                r = recs.get(m.uuid)
                assert r is not None and r.type_id == m.type_id, f"tree and records disagree on {m.uuid}"
                g.present.append((by_id[m.type_id].name, r.owner, r.anti_affinity))
                if mixed:       # where the driver put it (the simulator places each at a free id)
                    pid = (host.mdev_devices / m.uuid / "nvidia" / "placement_id").read_text().strip()
                    g.taken.append((int(pid), by_id[m.type_id].fb // 1024))
        gpus.append(g)
    assert sum(len(g.present) for g in gpus) == len(recs), "a record without its mdev"
    return gpus


a40_requests = st.builds(
    Request,
    profile=st.sampled_from(A40_WEIGHTED),
    owner=st.sampled_from(OWNERS),
    strategy=st.sampled_from(STRATEGIES),
    numa_node=st.sampled_from([None, None, 0, 1]),
    anti_affinity=st.sampled_from(KEYS),
    gpu=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([A(b) for b, *_ in A40_GPUS])),
)
_create = st.tuples(st.just("create"), a40_requests)
a40_ops = st.lists(st.one_of(_create, _create, _create, st.tuples(st.just("remove"), st.integers(0, 10_000))),
                   min_size=6, max_size=20)


# no shrinking: each step is a real create on a real tree, and shrinking a failure would take
# minutes; (a) checks the same properties and shrinks fast
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(a40_ops)
def test_real_create_and_remove_respect_capacity_rules_and_admit_whatever_fits(sequence):
    with tempfile.TemporaryDirectory(prefix="vgpuhost-prop-") as tmp:
        host = materialise(A40_SPEC, Path(tmp) / "host")
        store = StateStore(host.state_dir)
        for op, arg in sequence:
            gpus = model_of_host(host, store)
            if op == "remove":
                recs = store.vgpu_records()
                if recs:
                    remove(host, store, recs[arg % len(recs)].id)
                continue
            req: Request = arg
            want = expected_choice(gpus, req)
            if not any(g.available(req.profile) for g in gpus):
                event("real: no GPU has a free instance of the type")
            try:
                out = create(host, store, profile=req.profile, owner=req.owner, strategy=req.strategy,
                             numa_node=req.numa_node, anti_affinity=req.anti_affinity, gpu=req.gpu)
            except RefusedError as e:
                assert want is None, f"{req}: refused, but {want} could hold it: {e.message}"
                event("real: refused")
                continue
            event("real: admitted")
            assert want is not None, f"{req}: admitted on {out.gpu}, but no GPU could hold it"
            assert out.gpu == str(want), f"{req.strategy} chose {out.gpu}, its rule names {want}: {out.reason}"
            after = model_of_host(host, store)
            bad = [v for g in after for v in g.violations()]
            assert not bad, bad
            assert sum(len(g.present) for g in after) == sum(len(g.present) for g in gpus) + 1
        for g in model_of_host(host, store):
            assert not g.violations()
        store.close()


@pytest.mark.parametrize("strategy", ["first-fit", "best-fit", "worst-fit"])
def test_real_best_fit_fills_then_refuses_with_reason(tmp_path, strategy):
    """A fixed sequence through the real path: 6 x 8Q fill some GPU; 16Q is refused there with the reason."""
    host = materialise(A40_SPEC, tmp_path / "host")
    store = StateStore(host.state_dir)
    gpu = A(A40_GPUS[0][0])
    for _ in range(6):
        create(host, store, profile="A40-8Q", gpu=gpu, strategy=strategy)
    with pytest.raises(RefusedError) as ei:
        create(host, store, profile="A40-16Q", gpu=gpu, strategy=strategy)
    assert str(gpu) in ei.value.message and "A40-16Q" in ei.value.message
    out = create(host, store, profile="A40-16Q", strategy=strategy)
    assert out.gpu != str(gpu)


# --- vendor-specific VFIO: free instances, not free VFs ---------------------------------------

TWO_L40S = """
version: 1
name: two-l40s-uneven
summary: two L40S on vendor-specific VFIO, 16 and 8 VFs enabled
host:
  modules: [vfio_pci, vfio_pci_core, vfio_iommu_type1, vfio, nvidia, nvidia_vgpu_vfio]
devices:
  - {bdf: "0000:20:01.1", model: amd-root-port, numa_node: 0}
  - {bdf: "0000:21:00.0", model: L40S, upstream: "0000:20:01.1", numa_node: 0,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 16}}
  - {bdf: "0000:a0:01.1", model: amd-root-port, numa_node: 0}
  - {bdf: "0000:a1:00.0", model: L40S, upstream: "0000:a0:01.1", numa_node: 0,
     vgpu: {backend: vendor-vfio, sriov_numvfs: 8}}
"""


def test_vendor_vfio_best_fit_ranks_by_free_instances(make_host):
    """GPU 21 (16 VFs) holds 3 x L40S-8Q: 3 more fit.  GPU a1 (8 VFs) is empty: 6 fit.
    Best-fit must take 21 (fewest free instances that still fits), not a1 (fewest free VFs).
    Regression: every free VF reports 1, and offers() used to sum them."""
    host = make_host(yaml_text=TWO_L40S)
    store = StateStore(host.state_dir)
    for _ in range(3):
        create(host, store, profile="L40S-8Q", gpu=A("0000:21:00.0"))
    out = create(host, store, profile="L40S-8Q", strategy="best-fit")
    assert out.gpu == "0000:21:00.0", out.reason
    assert "3 L40S-8Q free" in out.reason, out.reason


# --- the reserving strategy (opt-in: it may refuse what fits) ----------------------

reserve_requests = st.builds(
    Request,
    profile=st.sampled_from(PURE_PROFILES + ["A40-48Q", "A40-48Q", "A40-24Q"]),
    owner=st.sampled_from(OWNERS),
    strategy=st.just("reserve"),
    numa_node=st.sampled_from([None, None, 0, 1]),
    anti_affinity=st.sampled_from(KEYS),
    gpu=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([A(b) for b, *_ in PURE_GPUS])),
)
_reserve_place = st.tuples(st.just("place"), reserve_requests)
reserve_ops = st.lists(st.one_of(_reserve_place, _reserve_place, _reserve_place,
                                 st.tuples(st.just("release"), st.integers(0, 10_000))),
                       min_size=20, max_size=80)


@settings(max_examples=400, deadline=None)
@given(reserve_ops)
def test_pure_place_reserve_keeps_the_rules_and_refuses_only_by_its_reservation(sequence):
    """``reserve`` never breaks a placement rule; it decides as best-fit does, except that a
    whole-GPU request not pinned to a GPU is refused when best-fit would give it one of the last
    RESERVE_EMPTY empty GPUs, and the reason says so."""
    assert "reserve" in RESERVING and "reserve" not in STRATEGIES
    gpus = pure_host()
    by_addr = {g.address: g for g in gpus}
    for op, arg in sequence:
        if op == "release":
            held = [(g, i) for g in gpus for i in range(len(g.present))]
            if held:
                g, i = held[arg % len(held)]
                g.present.pop(i)
            continue
        req: Request = arg
        offers = [g.offer(req.profile) for g in gpus]
        d = place(offers, req)
        best = expected_choice(gpus, Request(req.profile, req.owner, "best-fit", req.numa_node,
                                             req.anti_affinity, req.gpu))
        pool = [g for g in gpus if req.gpu is None or g.address == req.gpu]
        empty = sum(1 for g in pool if not g.present)
        reserved = (best is not None and req.gpu is None and not by_addr[best].present
                    and by_addr[best].available(req.profile) == 1 and empty <= RESERVE_EMPTY)
        if reserved:
            event("reserve: refused by the reservation")
            assert not d.admitted and d.gpu is None and d.parent is None, d
            assert "reserve" in d.reason and f"only {empty} of {len(pool)} GPUs are empty" in d.reason, d.reason
            continue
        assert d.gpu == best, f"reserve chose {d.gpu}, best-fit's rule names {best}: {d.reason}"
        if not d.admitted:
            assert best is None and len(d.rejected) == len(pool) and d.reason, d
            event("reserve: refused, nothing fits")
            continue
        event("reserve: admitted")
        assert d.parent == d.gpu and d.type_id == by_addr[d.gpu].types[req.profile].type_id
        by_addr[d.gpu].present.append((req.profile, req.owner, req.anti_affinity))
        bad = [v for g in gpus for v in g.violations()]
        assert not bad, bad


def test_pure_place_reserve_keeps_the_last_empty_gpus_from_a_whole_gpu_type():
    """Four A40s, two holding a 4Q each: a 48Q is refused (two empty left), pinned it is placed;
    with three empty the 48Q lands on one; a 4Q goes where best-fit puts it."""
    a40s = [ModelGpu(A(f"0000:{i + 1:02x}:00.0"), 0, "A40", False, board_types("A40"),
                     CATALOG.gpus["A40"].framebuffer_mib) for i in range(4)]
    a40s[0].present.append(("A40-4Q", MANUAL, None))
    a40s[1].present.append(("A40-4Q", MANUAL, None))
    d = place([g.offer("A40-48Q") for g in a40s], Request("A40-48Q", strategy="reserve"))
    assert not d.admitted and "only 2 of 4 GPUs are empty" in d.reason, d.reason
    d = place([g.offer("A40-48Q") for g in a40s], Request("A40-48Q", strategy="reserve", gpu=a40s[3].address))
    assert d.gpu == a40s[3].address, d.reason
    d = place([g.offer("A40-4Q") for g in a40s], Request("A40-4Q", strategy="reserve"))
    assert d.gpu == a40s[0].address, d.reason
    a40s[1].present.clear()
    d = place([g.offer("A40-48Q") for g in a40s], Request("A40-48Q", strategy="reserve"))
    assert d.gpu == a40s[1].address, d.reason


# --- headroom: best-fit with admission control by the framebuffer in use (opt-in, offered) -----

def fb_offer(g: ModelGpu, name: str) -> GpuOffer:
    """``g.offer(name)`` with the framebuffer figures ``headroom`` reads (as policy.offers fills them)."""
    from vgpuhost.model.values import replace
    return replace(g.offer(name), framebuffer_mib=g.framebuffer,
                   used_mib=sum(g.types[n].fb for n, _, _ in g.present))


headroom_requests = st.builds(
    Request,
    profile=st.sampled_from(PURE_PROFILES + ["A40-48Q", "A40-48Q", "A40-24Q", "A40-24Q"]),
    owner=st.sampled_from(OWNERS),
    strategy=st.just("headroom"),
    numa_node=st.sampled_from([None, None, 0, 1]),
    anti_affinity=st.sampled_from(KEYS),
    gpu=st.one_of(st.none(), st.none(), st.none(), st.sampled_from([A(b) for b, *_ in PURE_GPUS])),
)
_headroom_place = st.tuples(st.just("place"), headroom_requests)
headroom_ops = st.lists(st.one_of(_headroom_place, _headroom_place, _headroom_place,
                                  st.tuples(st.just("release"), st.integers(0, 10_000))),
                        min_size=20, max_size=80)


@settings(max_examples=400, deadline=None)
@given(headroom_ops)
def test_pure_place_headroom_keeps_the_rules_and_refuses_only_by_its_headroom(sequence):
    """``headroom`` never breaks a placement rule (max instances, equal-size and mixed-size
    capacity, one vGPU per VM per GPU, anti-affinity, the pinned GPU); it decides as best-fit
    does, except that an unpinned request whose best-fit GPU is empty and holds the type once or
    twice is refused when the framebuffer then in use passes HEADROOM of the pool's, and the
    reason says it was refused although it fits."""
    from vgpuhost.policy.placement import HEADROOM, OFFERED
    assert "headroom" in RESERVING and "headroom" not in STRATEGIES and "headroom" in OFFERED
    gpus = pure_host()
    by_addr = {g.address: g for g in gpus}
    for op, arg in sequence:
        if op == "release":
            held = [(g, i) for g in gpus for i in range(len(g.present))]
            if held:
                g, i = held[arg % len(held)]
                g.present.pop(i)
            continue
        req: Request = arg
        d = place([fb_offer(g, req.profile) for g in gpus], req)
        best = expected_choice(gpus, Request(req.profile, req.owner, "best-fit", req.numa_node,
                                             req.anti_affinity, req.gpu))
        refused_by_rule = False
        if best is not None and req.gpu is None and not by_addr[best].present:
            m = by_addr[best].available(req.profile)
            total = sum(g.framebuffer for g in gpus)
            used = sum(g.types[n].fb for g in gpus for n, _, _ in g.present) + by_addr[best].framebuffer // m
            refused_by_rule = m in HEADROOM and used > HEADROOM[m] * total
        if refused_by_rule:
            event("headroom: refused by its headroom")
            assert not d.admitted and d.gpu is None and d.parent is None, d
            assert d.reason.startswith(f"headroom: {req.profile} fits on the empty GPU {best}, but refused"), d.reason
            assert f"over the {HEADROOM[m]:.0%} allowed" in d.reason, d.reason
            continue
        assert d.gpu == best, f"headroom chose {d.gpu}, best-fit's rule names {best}: {d.reason}"
        if not d.admitted:
            assert best is None and d.reason, d
            event("headroom: refused, nothing fits")
            continue
        event("headroom: admitted")
        assert d.parent == d.gpu and d.type_id == by_addr[d.gpu].types[req.profile].type_id
        by_addr[d.gpu].present.append((req.profile, req.owner, req.anti_affinity))
        bad = [v for g in gpus for v in g.violations()]
        assert not bad, bad


def test_pure_place_headroom_without_framebuffer_figures_is_best_fit():
    """Offers without framebuffer figures (a board vgpuhost does not know): never refused by headroom."""
    a40s = [ModelGpu(A(f"0000:{i + 1:02x}:00.0"), 0, "A40", False, board_types("A40"),
                     CATALOG.gpus["A40"].framebuffer_mib) for i in range(2)]
    a40s[0].present += [("A40-24Q", MANUAL, None), ("A40-24Q", MANUAL, None)]
    with_fb = place([fb_offer(g, "A40-48Q") for g in a40s], Request("A40-48Q", strategy="headroom"))
    assert not with_fb.admitted and "100% of the 2 GPUs' framebuffer" in with_fb.reason, with_fb.reason
    without = place([g.offer("A40-48Q") for g in a40s], Request("A40-48Q", strategy="headroom"))
    assert without.gpu == a40s[1].address, without.reason


def test_real_create_headroom_refuses_a_whole_gpu_type_that_fits_and_says_so(make_host, capsys):
    """Through the CLI on one A40: a 4Q (twelve share a GPU) is never refused; a 48Q would fill the
    host (100% > 70%): exit 2, one line saying it fits and was refused, nothing created; pinned to
    the GPU it is made."""
    from vgpuhost.cli.main import main
    host = make_host("a40-mdev")
    base = ["--root", str(host.root), "--local", "--json"]

    def mdevs():
        return discover(Sysfs(host), with_types=False).mdevs

    assert main(base + ["vgpu", "create", "--profile", "A40-4Q", "--strategy", "headroom"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["reason"].startswith("headroom: 0000:81:00.0 is the GPU with the fewest free instances")
    assert main(base + ["vgpu", "remove", made["id"]]) == 0 and mdevs() == ()
    capsys.readouterr()
    assert main(base + ["vgpu", "create", "--profile", "A40-48Q", "--strategy", "headroom"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1
    assert "headroom: A40-48Q fits on the empty GPU 0000:81:00.0, but refused" in err, err
    assert mdevs() == ()
    assert main(base + ["vgpu", "create", "--profile", "A40-48Q", "--strategy", "headroom",
                        "--gpu", "0000:81:00.0"]) == 0
    assert json.loads(capsys.readouterr().out)["type_name"] == "A40-48Q" and len(mdevs()) == 1
