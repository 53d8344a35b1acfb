"""Issue 26, "Must show": a property test (hypothesis) of admission against a reference model, agent up and down.

Random tenants (quota: guaranteed/burst vGPUs, optionally framebuffer; isolation shared, exclusive or
hardware; QoS class; the one A40 profile its domains ask), pools (none, or one or two declared with
``tenancy.set_pools``, each GPU's scheduler policy set to its pool's in the simulator, as ``apply``
leaves it), boards (two A40s, or two A40s and an L40S), starts and stops through the real qemu hook
handler, and ``tenant set --vgpus G:B`` between them (a guarantee raised or lowered: the devices held
fill it first); some starts run concurrently, as real forked processes released at once.  A tenant
whose guarantee ``tenant add`` refuses (it cannot be kept on this host) is added with none.  A share of the
examples runs with ``vgpuhost agent`` up on the simulated root (the hook hands ``prepare begin`` and
``release end`` to it), the rest with it down.

After every step:

- each decision equals the decision of the reference model below, written from docs/guide/tenancy.md
  (quota -> isolation -> QoS class -> pool -> placement capacity -> the reserve of other tenants'
  unused guarantees) and independent of vgpuhost.policy (admission, feasibility).  It is evaluated on
  the state read from the store before the step (a sequential start), or, for a concurrent batch, on
  the state the earlier rows of the batch produced, in the order of their ``(admission)`` audit rows
  (written under the host lock: the decision order).  Compared: admitted or refused, a refusal by the
  quota rule or by another, and, for an admitted vGPU, that the GPU it went to is one the model allows;
- the audit holds exactly one ``(admission)`` row per device per start, ``admitted`` iff exit 0;
- ``tenant usage --json``, ``vgpu list --json``, the allocation rows and the simulated sysfs tree agree
  (same devices, same owners, per-tenant device and domain counts).

What the model covers: vGPU and framebuffer quotas (guaranteed, burst ceiling, burst marking from the
tenant's use now); hardware isolation (no time-sliced vGPU); exclusive isolation both ways (domains with
no tenant count as someone else); pools serving QoS classes (declared pools, the implicit ``default``
serving burstable and best-effort); boards (A40 types only on A40s); equal-size mode and the number of
instances of a size per GPU; the reserve: use no guarantee covers (a burst, a domain with no tenant) is
admitted on a GPU only when every other tenant's unused guarantee stays servable at once, by a brute
force over what every GPU gives whom, in both readings of a tenant holding no vGPU yet (any size, or a
GPU it sizes itself), and, where the guarantees could not all be served before, each one servable alone
before stays so.

What it deliberately leaves out: MIG, passthrough, labels (``--avoid``/``--prefer``), series limits,
per-domain ``qos`` overrides, drift (policies are always the pool's), the placement strategies' choice
among allowed GPUs, and the search bound ("cannot decide: does not refuse"; never reached at this size).
A tenant holding no vGPU opens an empty GPU at 8 GiB in the model: with the needs generated here (at most
2 vGPUs and 16 GiB unused per tenant) one empty A40 or L40S at that size serves every such tenant at
once, so no other size can serve more (:data:`OPEN_SIZES`: a wider sweep with larger guarantees sets it to
every A40 size from 2 GiB up).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.ops import tenancy
from vgpuhost.sim.build import materialise
from vgpuhost.sim.nvml import SimNvml
from vgpuhost.sim.spec import parse_spec

from agentutil import AgentRun
from test_admission_once import _fork_starts
from test_hook import GPU_HI, GPU_LO, L40S, MIXED, bind_as_asked, mdevs, start, stop
from test_tenancy import tdom, uid

LO, HI, L4 = str(GPU_LO), str(GPU_HI), str(L40S)
MIB = {"A40-8Q": 8192, "A40-12Q": 12288, "A40-16Q": 16384, "A40-24Q": 24576}
A40_MIB = 49152
OPEN_MIB = 8192                      # the size a tenant holding no vGPU opens an empty GPU at (module docstring)
OPEN_SIZES = (OPEN_MIB,)
SERVES = {"fixed-share": ("guaranteed", "burstable", "best-effort"), "equal-share": ("burstable", "best-effort"),
          "best-effort": ("best-effort",)}
DEFAULT_SERVES = ("burstable", "best-effort")
UNTENANTED_QOS = "best-effort"

TWO_A40 = MIXED.replace("""  - {{bdf: "0000:a0:01.1", model: amd-root-port, numa_node: 1}}
  - {{bdf: "0000:a1:00.0", model: L40S, upstream: "0000:a0:01.1", numa_node: 1,
      vgpu: {{backend: vendor-vfio, sriov_numvfs: 8}}}}
""", "")
assert TWO_A40 != MIXED


# ---------------------------------------------------------------------------
# the reference model

class TenantSpec(NamedTuple):
    name: str
    vgpus: Tuple[int, int]                       # guaranteed, burst
    fb: Optional[Tuple[int, int]]                # MiB: guaranteed, burst; None: no limit
    isolation: str
    qos: str
    profile: str


class Held(NamedTuple):
    device: str
    tenant: Optional[str]
    gpu: str
    mib: int


class Host(NamedTuple):
    boards: Tuple[Tuple[str, str], ...]          # (GPU, "A40" | "L40S"), by address
    pools: Tuple[Tuple[str, Tuple[str, ...]], ...]   # (GPU, classes its pool serves): declared pools only

    def serves(self, gpu: str, qos: str) -> bool:
        declared = dict(self.pools)
        return qos in (declared[gpu] if gpu in declared else DEFAULT_SERVES)


def most(mib: int) -> int:
    """Time-sliced vGPUs of ``mib`` MiB one GPU holds (equal-size mode): 48 GiB on an A40; the L40S (48 GiB,
    8 VFs) alike for the only size the model gives it (:data:`OPEN_MIB`)."""
    return A40_MIB // mib


class Decision(NamedTuple):
    admitted: bool
    rule: str                                    # "quota", "isolation", "placement", "reserve", "" (admitted)
    gpus: FrozenSet[str]                         # where it may go


def _use(tenant: str, held) -> Tuple[int, int]:
    mine = [h for h in held if h.tenant == tenant]
    return len(mine), sum(h.mib for h in mine)


def unused(t: TenantSpec, held) -> Tuple[int, int]:
    """The tenant's unused guarantee now: (vGPUs, MiB)."""
    n, f = _use(t.name, held)
    return max(0, t.vgpus[0] - n), (max(0, t.fb[0] - f) if t.fb else 0)


def servable(wanted: Dict[str, Tuple[int, int]], tenants: Dict[str, TenantSpec], held, host: Host,
             own_size: bool) -> bool:
    """Brute force: can every tenant of ``wanted`` (name -> unused (vGPUs, MiB)) be given its unused
    guarantee at once on top of ``held``?  ``own_size``: a tenant holding no vGPU needs a GPU it sizes itself
    (an empty one, alone); else it may take any size (join a GPU at its vGPUs' size, or open an empty one)."""
    names = sorted(n for n, (a, b) in wanted.items() if a or b)
    if not names:
        return True
    sized = {n: {h.mib for h in held if h.tenant == n} for n in names}
    gpus = []
    for gpu, board in host.boards:
        here = [h for h in held if h.gpu == gpu]
        size = here[0].mib if here else None
        holders = {h.tenant for h in here}
        per = {}
        for n in names:
            t = tenants[n]
            if t.isolation == "hardware" or not host.serves(gpu, t.qos):
                continue
            if t.isolation == "exclusive" and holders - {n}:
                continue
            if any(h not in (None, n) and h in tenants and tenants[h].isolation == "exclusive" for h in holders):
                continue
            if sized[n]:
                if board != "A40":
                    continue              # it holds A40 types: another board offers none of them
                ok = sized[n] if size is None else sized[n] & {size}
            elif size is None:
                ok = {"open"}
            else:
                ok = set() if own_size else {size}
            if ok:
                per[n] = ok
        gpus.append((size, len(here), per))

    def need(rem, s):
        n, f = rem
        return max(n, -(-f // s))

    @lru_cache(maxsize=None)
    def go(i: int, rem: Tuple[Tuple[int, int], ...]) -> bool:
        if all(not a and not b for a, b in rem):
            return True
        if i == len(gpus):
            return False
        size, count, per = gpus[i]
        if go(i + 1, rem):
            return True
        sizes = set()
        for n, ok in per.items():
            sizes |= {s for s in ok if s != "open"}
        if size is None and any("open" in ok for ok in per.values()):
            sizes |= set(OPEN_SIZES)
        for s in sorted(sizes):
            cap = most(s) - count
            who = [(k, n) for k, n in enumerate(names)
                   if need(rem[k], s) and (s in per.get(n, ()) or "open" in per.get(n, ()))]
            # own_size: a tenant holding no vGPU opening an empty GPU is alone on it (_shares)
            for combo in _shares(who, rem, s, cap, tenants, sized, own_size):
                if go(i + 1, combo):
                    return True
        return False

    return go(0, tuple(wanted[n] for n in names))


def _shares(who, rem, s, cap, tenants, sized, own_size):
    """Every way to give the tenants in ``who`` vGPUs of ``s`` MiB within ``cap``: exclusive tenants, and
    (own_size) tenants holding no vGPU, alone; the demand left."""
    def need(r):
        return max(r[0], -(-r[1] // s))

    def take(r, k):
        return (max(0, r[0] - k), max(0, r[1] - k * s))

    alone = [(k, n) for k, n in who if tenants[n].isolation == "exclusive" or (own_size and not sized[n])]
    for k, n in alone:
        for m in range(1, min(need(rem[k]), cap) + 1):
            r = list(rem)
            r[k] = take(rem[k], m)
            yield tuple(r)
    shared = [(k, n) for k, n in who if (k, n) not in alone]

    def rec(idx, left, r, any_given):
        if idx == len(shared):
            if any_given:
                yield tuple(r)
            return
        k, _ = shared[idx]
        for m in range(min(need(r[k]), left), -1, -1):
            r2 = list(r)
            r2[k] = take(r[k], m)
            yield from rec(idx + 1, left - m, r2, any_given or m > 0)
    yield from rec(0, cap, list(rem), False)


def keeps_reserve(me: Optional[str], extra: Held, tenants: Dict[str, TenantSpec], held, host: Host) -> bool:
    """Does ``extra`` (use no guarantee covers) leave the other tenants' unused guarantees as servable as
    before, in both readings of a tenant holding no vGPU?"""
    wanted = {n: unused(t, held) for n, t in tenants.items() if n != me}
    wanted = {n: w for n, w in wanted.items() if any(w)}
    after = list(held) + [extra]
    for own_size in (False, True):
        if servable(wanted, tenants, held, host, own_size):
            if not servable(wanted, tenants, after, host, own_size):
                return False
        else:
            for n, w in wanted.items():
                if servable({n: w}, tenants, held, host, own_size) and \
                        not servable({n: w}, tenants, after, host, own_size):
                    return False
    return True


def decide(tenant: Optional[str], profile: str, tenants: Dict[str, TenantSpec], held, host: Host) -> Decision:
    """The documented rules, in order: quota, isolation, QoS class and pool, placement capacity, the reserve."""
    mib = MIB[profile]
    if not tenants and not host.pools:           # tenancy not in use: placement alone decides
        tenant, tenants = None, {}
        held = [h._replace(tenant=None) for h in held]
    elif tenant is not None and tenant not in tenants:
        if tenants:                              # once a tenant exists, an unknown one is refused
            return Decision(False, "unknown", frozenset())
        tenant = None                            # pools alone: the name is only recorded
    t = tenants.get(tenant) if tenant else None
    burst = False
    if t is not None:
        n, f = _use(t.name, held)
        if n + 1 > t.vgpus[1] or (t.fb is not None and f + mib > t.fb[1]):
            return Decision(False, "quota", frozenset())
        burst = n + 1 > t.vgpus[0] or (t.fb is not None and f + mib > t.fb[0])
        if t.isolation == "hardware":
            return Decision(False, "isolation", frozenset())
    qos = t.qos if t is not None else UNTENANTED_QOS
    allowed = set()
    for gpu, board in host.boards:
        if board != "A40" or not host.serves(gpu, qos):
            continue
        here = [h for h in held if h.gpu == gpu]
        if t is not None and t.isolation == "exclusive" and any(h.tenant != tenant for h in here):
            continue
        if any(h.tenant not in (None, tenant) and h.tenant in tenants and tenants[h.tenant].isolation == "exclusive"
               for h in here):
            continue
        if any(h.mib != mib for h in here) or len(here) >= most(mib):
            continue
        allowed.add(gpu)
    if not allowed:
        return Decision(False, "placement", frozenset())
    reserved = any(any(unused(u, held)) for n, u in tenants.items() if n != tenant)
    if reserved and (t is None or burst):
        allowed = {g for g in allowed if keeps_reserve(tenant, Held("?", tenant, g, mib), tenants, held, host)}
        if not allowed:
            return Decision(False, "reserve", frozenset())
    return Decision(True, "", frozenset(allowed))


# ---------------------------------------------------------------------------
# the system under test

def cli(host, *argv) -> Tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["--root", str(host.root), *argv])
    return code, out.getvalue(), err.getvalue()


def held_now(s: StateStore) -> List[Held]:
    return [Held(r[0], r[2], r[3], r[6]) for r in s.allocation_rows()]


def admission_rows(s: StateStore):
    return [r for r in s.audit_rows() if r.path == "(admission)"]


class Dom(NamedTuple):
    name: str
    uuid: str
    device: str
    tenant: Optional[str]
    profile: str
    xml: str


def dom(i: int, tenant: Optional[str], profile: str) -> Dom:
    name, u, d = f"m{i}", uid("7e7e7e7e", i), uid("8f8f8f8f", i)
    return Dom(name, u, d, tenant, profile, tdom(name, u, d, tenant=tenant, profile=profile))


def check_decision(want: Decision, admitted: bool, refusal: str, gpu: Optional[str], what: str) -> None:
    got = f"admitted on {gpu}" if admitted else refusal
    assert want.admitted == admitted, f"{what}: model {want}, vgpuhost {got}"
    if admitted:
        assert gpu in want.gpus, f"{what}: admitted on {gpu}, the model allows {sorted(want.gpus)}"
    else:
        for rule, line in (("quota", "quota "), ("unknown", "unknown tenant ")):
            assert (want.rule == rule) == refusal.startswith(line), f"{what}: model {want}, vgpuhost {refusal}"


def check_agreement(host, s: StateStore, running: Dict[str, Dom]) -> None:
    """tenant usage --json, vgpu list --json, allocation rows and sysfs: same devices, owners, counts."""
    present = set(mdevs(host))
    code, out, err = cli(host, "--json", "vgpu", "list")
    assert code == 0, err
    listed = {v["id"]: v for v in json.loads(out)["vgpus"]}
    allocs = {h.device: h for h in held_now(s)}
    want = {d.device: d for d in running.values()}
    assert present == set(listed) == set(allocs) == set(want), (present, set(listed), set(allocs), set(want))
    for dev, d in want.items():
        assert listed[dev]["owner"] == d.uuid and listed[dev]["type_name"] == d.profile
        assert allocs[dev].tenant == d.tenant and allocs[dev].gpu == listed[dev]["gpu"]
    code, out, err = cli(host, "--json", "tenant", "usage")
    assert code == 0, err
    usage = {u["tenant"]: u for u in json.loads(out)["tenants"]}
    for name in {d.tenant for d in want.values()} | {n for n in usage}:
        mine = [d for d in want.values() if d.tenant == name]
        u = usage.get(name)
        if not mine and (u is None or u["usage"]["vgpus"]["used"] == 0):
            continue
        assert u is not None, (name, usage)
        assert u["usage"]["vgpus"]["used"] == len(mine), (name, u)
        assert u["usage"]["framebuffer_mib"]["used"] == sum(MIB[d.profile] for d in mine), (name, u)
        assert u["domains"] == len(mine), (name, u)


def add_argv(t: TenantSpec) -> List[str]:
    argv = ["tenant", "add", t.name, "--vgpus", f"{t.vgpus[0]}:{t.vgpus[1]}", "--isolation", t.isolation,
            "--qos", t.qos]
    if t.fb is not None:
        argv += ["--framebuffer", f"{t.fb[0]}:{t.fb[1]}"]
    return argv


# ---------------------------------------------------------------------------
# the strategies

PROFILES = ("A40-12Q", "A40-12Q", "A40-12Q", "A40-24Q", "A40-8Q", "A40-16Q")   # one size most often: sharing
CLASSES = ("guaranteed", "burstable", "best-effort")


@st.composite
def tenant_specs(draw, name: str) -> TenantSpec:
    g = draw(st.sampled_from((0, 1, 1, 2, 2)))
    b = g + draw(st.integers(0, 2))
    fb = draw(st.one_of(st.none(), st.tuples(st.sampled_from((0, 8192, 16384)), st.sampled_from((0, 8192, 16384)))))
    if fb is not None:
        fb = (fb[0], fb[0] + fb[1])
    isolation = draw(st.sampled_from(("shared", "shared", "shared", "exclusive", "exclusive", "hardware")))
    return TenantSpec(name, (g, b), fb, isolation,
                      draw(st.sampled_from(("guaranteed", "burstable", "burstable", "best-effort"))),
                      draw(st.sampled_from(PROFILES)))


@st.composite
def pool_specs(draw):
    """[(name, policy, classes, GPUs)]: none, one pool (one or both A40s), or one pool per A40."""
    shape = draw(st.sampled_from(("none", "none", "one", "two")))
    if shape == "none":
        return []
    groups = [draw(st.sampled_from(((LO,), (HI,), (LO, HI))))] if shape == "one" else [(LO,), (HI,)]
    out = []
    for k, gpus in enumerate(groups):
        policy = draw(st.sampled_from(sorted(SERVES)))
        classes = draw(st.lists(st.sampled_from(SERVES[policy]), min_size=1, unique=True).map(
            lambda c: tuple(x for x in CLASSES if x in c)))
        out.append((f"p{k}", policy, classes, gpus))
    return out


start_op = st.tuples(st.sampled_from((-1, 0, 0, 1, 1, 2)), st.sampled_from(PROFILES))   # tenant index (-1: none)
ops = st.lists(st.one_of(
    st.tuples(st.just("start"), start_op),
    st.tuples(st.just("start"), start_op),
    st.tuples(st.just("stop"), st.integers(0, 9)),
    st.tuples(st.just("set"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("batch"), st.lists(start_op, min_size=2, max_size=4)),
), min_size=3, max_size=8)

scenario = st.fixed_dictionaries({
    "l40s": st.booleans(),
    "pools": pool_specs(),
    "tenants": st.integers(2, 3).flatmap(lambda n: st.tuples(*[tenant_specs(f"t{i}") for i in range(n)])),
    "ops": ops,
})


# ---------------------------------------------------------------------------
# the property

#: fixed examples (derandomized), no shrinking: a failure prints its example as drawn
PROFILE = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
               phases=(Phase.explicit, Phase.generate))


#: an exclusive tenant's GPU beside a shared tenant of the same size and domains with no tenant (isolation
#: both ways, and the reserve of the exclusive tenant's second vGPU), always run
EXCLUSIVE_BESIDE_SHARED = {
    "l40s": False, "pools": [],
    "tenants": (TenantSpec("t0", (2, 3), None, "exclusive", "burstable", "A40-12Q"),
                TenantSpec("t1", (1, 3), None, "shared", "burstable", "A40-12Q")),
    "ops": [("start", (0, "A40-12Q")), ("start", (1, "A40-12Q")), ("start", (-1, "A40-12Q")),
            ("batch", [(1, "A40-12Q"), (-1, "A40-12Q"), (0, "A40-12Q")]), ("stop", 0), ("start", (1, "A40-12Q"))],
}


@settings(max_examples=36, **PROFILE)
@given(sc=scenario)
@example(sc=EXCLUSIVE_BESIDE_SHARED)
def test_every_admission_equals_the_reference_models_decision_agent_down(sc):
    run_scenario(sc, agent_up=False)


@settings(max_examples=8, **PROFILE)
@given(sc=scenario)
def test_every_admission_equals_the_reference_models_decision_agent_up(sc):
    run_scenario(sc, agent_up=True)


def run_scenario(sc, agent_up: bool) -> None:
    for var in ("VGPUHOST_AGENT", "VGPUHOST_AGENT_SOCKET"):
        assert var not in os.environ, var
    root = Path(tempfile.mkdtemp(prefix="vgpuhost-model-"))
    agent = None
    try:
        spec = (MIXED if sc["l40s"] else TWO_A40).format(faults="")
        host = materialise(parse_spec(spec), root / "host")
        s = StateStore(host.state_dir)
        boards = ((LO, "A40"), (HI, "A40")) + (((L4, "L40S"),) if sc["l40s"] else ())
        if sc["pools"]:
            nvml = SimNvml(host)
            for _, policy, _, gpus in sc["pools"]:
                for g in gpus:
                    nvml.set_scheduler_state(g, SchedulerState(policy=policy))
            tenancy.set_pools(s, [tenancy.adm.Pool(n, p, c, g) for n, p, c, g in sc["pools"]])
        model_host = Host(boards, tuple((g, c) for _, _, c, gpus in sc["pools"] for g in gpus))
        tenants: Dict[str, TenantSpec] = {}
        for t in sc["tenants"]:
            code, _, err = cli(host, *add_argv(t))
            if code != 0:              # a promise this host cannot keep: refused, nothing changed; no guarantee then
                assert code == 2 and "the guarantees cannot all be kept on this host" in err, err
                t = t._replace(vgpus=(0, t.vgpus[1]), fb=None if t.fb is None else (0, t.fb[1]))
                code, _, err = cli(host, *add_argv(t))
                assert code == 0, err
            tenants[t.name] = t
        assert sorted(tenancy.tenants(s)) == sorted(tenants)
        if agent_up:
            agent = AgentRun(host.root, str(host.path("run", "vgpuhost")))
        names = [t.name for t in sc["tenants"]]
        enforced = bool(tenants or sc["pools"])      # else no lock, no admission, no admission row (the guide)
        running: Dict[str, Dom] = {}
        made = 0

        def new_dom(op) -> Dom:
            nonlocal made
            k, profile = op
            tenant = names[k] if 0 <= k < len(names) else None
            profile = tenants[tenant].profile if tenant in tenants else profile
            made += 1
            return dom(made, tenant, profile)

        for step, o in enumerate(sc["ops"]):
            before_rows = len(admission_rows(s))
            held = held_now(s)
            if o[0] == "stop":
                if running:
                    d = running.pop(sorted(running)[o[1] % len(running)])
                    assert stop(host, d.name, d.xml) == (0, ""), d
                    assert len(admission_rows(s)) == before_rows
            elif o[0] == "set":        # a guarantee changed between admissions (under the same host lock)
                _, k, g, extra = o
                if k >= len(names):
                    continue
                t = tenants[names[k]]._replace(vgpus=(g, g + extra))
                code, _, err = cli(host, "tenant", "set", t.name, "--vgpus", f"{g}:{g + extra}")
                if code == 0:
                    tenants[t.name] = t
                else:                  # a promise this host cannot keep: refused, nothing changed
                    assert code == 2 and "the guarantees cannot all be kept on this host" in err, err
                q = tenancy.tenants(s)[t.name].quota
                assert (q.guaranteed.vgpus, q.ceiling("vgpus")) == tenants[t.name].vgpus
            elif o[0] == "start":
                d = new_dom(o[1])
                want = decide(d.tenant, d.profile, tenants, held, model_host)
                rc, err = start(host, d.name, d.xml)
                assert rc in (0, 2) and (rc == 0) == (err == ""), err
                rows = admission_rows(s)[before_rows:]
                gpu = next((h.gpu for h in held_now(s) if h.device == d.device), None)
                if enforced:
                    assert [r.operation for r in rows] == [f"admission {d.name} {d.device}"], rows
                    assert rows[0].result == ("admitted" if rc == 0 else "refused"), (rc, rows[0])
                    check_decision(want, rc == 0, rows[0].value, gpu, f"step {step}: start {d}")
                else:
                    assert rows == []
                    check_decision(want, rc == 0, err.split("): ", 1)[-1], gpu, f"step {step}: start {d}")
                if rc == 0:
                    running[d.name] = d
            else:
                batch = [new_dom(x) for x in o[1]]
                for d in batch:
                    bind_as_asked(host, d.xml)      # the operator binds each to its tenant (issue 28)
                codes = _fork_starts(host, [(d.name, d.xml) for d in batch])
                if not enforced:             # no lock: no decision order to replay; the tree still agrees
                    assert admission_rows(s)[before_rows:] == [] and set(codes.values()) <= {0, 2, 3}, codes
                    running.update((d.name, d) for d in batch if codes[d.name] == 0)
                    check_agreement(host, s, running)
                    continue
                rows = admission_rows(s)[before_rows:]
                by_dev = {d.device: d for d in batch}
                # exactly one row per start, its result matching the exit
                assert sorted(r.operation for r in rows) == sorted(f"admission {d.name} {d.device}" for d in batch)
                after = {h.device: h for h in held_now(s)}
                state = list(held)
                for r in rows:                       # the decision order: rows are written under the host lock
                    d = by_dev[r.operation.rsplit(" ", 1)[1]]
                    assert codes[d.name] in (0, 2) and r.result == ("admitted" if codes[d.name] == 0 else
                                                                     "refused"), (codes, r)
                    want = decide(d.tenant, d.profile, tenants, state, model_host)
                    gpu = after[d.device].gpu if d.device in after else None
                    check_decision(want, codes[d.name] == 0, r.value, gpu,
                                   f"step {step}: batch {[x.name for x in batch]}, {d}, rows {[x.value for x in rows]}")
                    if codes[d.name] == 0:
                        state.append(Held(d.device, d.tenant, gpu, MIB[d.profile]))
                        running[d.name] = d
                assert sorted(state) == sorted(after.values())
            check_agreement(host, s, running)
        if agent is not None:
            served = agent.call("GET", "/v1/agent")[1]["served"]
            starts = sum(1 for o in sc["ops"] if o[0] == "start") + sum(len(o[1]) for o in sc["ops"] if o[0] == "batch")
            assert served.get("POST /v1/hook/prepare", 0) == starts, served
    finally:
        if agent is not None:
            agent.close()
        shutil.rmtree(root, ignore_errors=True)
