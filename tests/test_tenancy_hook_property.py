"""Property test (hypothesis) end to end: random tenant changes, domain starts, stops and failed starts
through the real qemu hook handler on a simulated host whose second A40 fails every mdev create (EIO).

After every operation: the store matches sysfs (mdevs == vGPU records == allocations), no tenant holds
more than its quota allows, an exclusive tenant's GPU holds no one else's vGPU, and a refused or
failed start changed nothing.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpuhost.io.state import StateStore
from vgpuhost.ops import tenancy
from vgpuhost.policy import admission as adm
from vgpuhost.sim.build import materialise
from vgpuhost.sim.spec import parse_spec

from test_hook import GPU_HI, MIXED, mdevs, start, stop
from test_tenancy import tdom, uid

TENANTS = ("red", "blue", "green")
PROFILES = ("A40-8Q", "A40-12Q", "A40-8C")

ops = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, 7), st.sampled_from(TENANTS), st.sampled_from(PROFILES),
              st.sampled_from(("first-fit", "spread"))),
    st.tuples(st.just("stop"), st.integers(0, 7)),
    st.tuples(st.just("set"), st.sampled_from(TENANTS), st.integers(0, 3), st.integers(0, 2),
              st.sampled_from(("shared", "exclusive"))),
), min_size=1, max_size=12)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops)
def test_random_hook_operations_keep_store_sysfs_quota_and_isolation(ops):
    root = Path(tempfile.mkdtemp(prefix="vgpuhost-tenancy-"))
    try:
        host = materialise(parse_spec(MIXED.format(
            faults=f'{{op: create, device: "{GPU_HI}", errno: EIO, count: 0}}')), root / "host")
        s = StateStore(host.state_dir)
        for t in TENANTS:
            tenancy.add(s, tenancy.Tenant(t, quota=tenancy.Quota(tenancy.Limits(vgpus=1), tenancy.Limits(vgpus=2))))
        running = {}
        for o in ops:
            if o[0] == "start":
                _, i, t, profile, strategy = o
                if i in running:
                    continue
                xml = tdom(f"vm{i}", uid("5a5a5a5a", i), uid("6b6b6b6b", i), tenant=t, profile=profile,
                           strategy=strategy)
                before = mdevs(host)
                rc, err = start(host, f"vm{i}", xml)
                if rc == 0:
                    running[i] = (t, xml)
                    _admitted(s, t, uid("6b6b6b6b", i))
                else:
                    assert rc in (2, 3) and err.count("\n") == 1, err
                    assert mdevs(host) == before, err            # refused or failed: nothing changed
            elif o[0] == "stop":
                if o[1] in running:
                    assert stop(host, f"vm{o[1]}", running.pop(o[1])[1]) == (0, "")
            else:
                _, t, g, extra, isolation = o
                q = tenancy.Quota(tenancy.Limits(vgpus=g), tenancy.Limits(vgpus=g + extra))
                tenancy.update(s, t, quota=q, isolation=isolation)
            _check(host, s, running)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check(host, s: StateStore, running) -> None:
    present = set(mdevs(host))
    recs = {r.id: r for r in s.vgpu_records()}
    allocs = {r[0]: r for r in s.allocation_rows()}
    assert present == set(recs) == set(allocs)
    assert {r.owner for r in recs.values()} == {uid("5a5a5a5a", i) for i in running}
    assert all(a.gpu != str(GPU_HI) for a in tenancy.allocations(s))   # every create there fails, rolled back


def _admitted(s: StateStore, t: str, device: str) -> None:
    """What admission guaranteed for the start that made ``device`` for tenant ``t``, under the rules in force."""
    held = tenancy.allocations(s)
    ts = tenancy.tenants(s)
    q = ts[t].quota
    total, burst = adm.usage(t, held)["vgpus"]
    mine = next(a for a in held if a.device == device)
    assert total <= q.ceiling("vgpus")
    if not mine.burst:
        assert total <= q.guaranteed.vgpus
    others = {a.tenant for a in held if a.gpu == mine.gpu and a.device != device}
    if ts[t].isolation == "exclusive":
        assert others <= {t}, (t, others)
    for u in others - {t}:
        assert ts[u].isolation != "exclusive", (t, u)
