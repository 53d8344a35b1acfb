"""Issue 26: what a tester found in the first build of "one decision per start", each on a simulated host.

1. A domain with two unpinned vGPUs was refused once any tenant existed: admission placed both on one
   GPU (NVIDIA allows one vGPU per VM per GPU) and the device layer's re-check then refused the second.
2. A domain naming the layout's free vGPU by its UUID was admitted as if it were placed elsewhere and
   then claimed it where it was, past exclusive isolation and the pool's QoS class.
3. A vGPU lent from the layout's pool landed on another GPU than the one its admission row names.

Outcomes are read back from the simulated sysfs tree, the state store and the audit log.
"""

from __future__ import annotations

from vgpuhost.io.state import StateStore
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.ops import tenancy
from vgpuhost.ops.layout import apply
from vgpuhost.policy.config import parse

from test_hook import GPU_HI, GPU_LO, bind_as_asked, domain_xml, mdev_gpu, mdev_hostdev, mdevs, mixed, start
from test_tenancy import tdom, uid

def pool_layout(name: str, *entries) -> str:
    """A layout of vgpu entries, each ``(GPU BDF, vgpu types, scheduler policy, pool)`` in YAML flow form."""
    gpus = "".join(f"""      - select: {{address: "{gpu}"}}
        mode: vgpu
        vgpu: {{types: {{{types}}}}}
        scheduler: {{policy: {policy}}}
        pool: {pool}
""" for gpu, types, policy, pool in entries)
    return f"version: 1\nlayouts:\n  {name}:\n    gpus:\n{gpus}"


STD = pool_layout("shared", ("0000:81:00.0", "A40-4Q: 2", "equal-share", "std"))

CHEAP = pool_layout("tiers", ("0000:41:00.0", "A40-8Q: 1", "fixed-share", "{name: gold, serves: [guaranteed]}"),
                    ("0000:81:00.0", "A40-8Q: 2", "best-effort", "{name: cheap, serves: [best-effort]}"))


def admission_rows(s: StateStore):
    return [r for r in s.audit_rows() if r.path == "(admission)"]


def test_two_unpinned_vgpus_of_one_domain_go_to_two_gpus_under_tenancy(make_host):
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("web", quota=tenancy.Quota(tenancy.Limits(vgpus=4), tenancy.Limits())))
    m1, m2 = uid("c1c1c1c1", 1), uid("c1c1c1c1", 2)
    meta = Metadata(tenant="web", vgpus=[VgpuRequest("A40-4Q", uuid=m1), VgpuRequest("A40-4Q", uuid=m2)])
    xml = domain_xml("two", uid("d1d1d1d1", 0), meta, [mdev_hostdev(m1), mdev_hostdev(m2)])
    assert start(host, "two", xml) == (0, "")
    assert {mdev_gpu(host, m1), mdev_gpu(host, m2)} == {GPU_LO, GPU_HI}
    rows = admission_rows(s)
    assert [r.result for r in rows] == ["admitted", "admitted"], [r.value for r in rows]
    # each row names the GPU its device went to
    for m in (m1, m2):
        [row] = [r for r in rows if m in r.operation]
        assert str(mdev_gpu(host, m)) in row.value, row.value
    assert {r[0]: r[3] for r in s.allocation_rows()} == {m1: str(mdev_gpu(host, m1)), m2: str(mdev_gpu(host, m2))}


def test_a_third_vgpu_of_one_domain_on_two_gpus_is_refused_by_admission_itself(make_host):
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("web", quota=tenancy.Quota(tenancy.Limits(vgpus=4), tenancy.Limits())))
    ms = [uid("c2c2c2c2", i) for i in range(3)]
    meta = Metadata(tenant="web", vgpus=[VgpuRequest("A40-4Q", uuid=m) for m in ms])
    rc, err = start(host, "three", domain_xml("three", uid("d2d2d2d2", 0), meta, [mdev_hostdev(m) for m in ms]))
    assert rc == 2 and err.count("\n") == 1, err
    assert "one vGPU per VM per GPU" in err and "changed outside admission" not in err, err
    assert mdevs(host) == {} and not s.allocation_rows()
    assert [r.result for r in admission_rows(s)] == ["refused"]


def std_host(make_host):
    """:func:`mixed` with GPU_HI in pool std (equal share) holding the layout's two A40-4Q (first-fit
    would place a new vGPU on GPU_LO), tenants ``web`` (shared) and ``solo`` (exclusive)."""
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    apply(host, s, parse(STD, "std.yaml"))
    tenancy.add(s, tenancy.Tenant("web", quota=tenancy.Quota(tenancy.Limits(vgpus=4), tenancy.Limits())))
    tenancy.add(s, tenancy.Tenant("solo", isolation="exclusive",
                                  quota=tenancy.Quota(tenancy.Limits(vgpus=2), tenancy.Limits())))
    layout = sorted(r.id for r in s.vgpu_records() if r.owner == "layout")
    assert len(layout) == 2 and all(r.gpu == str(GPU_HI) for r in s.vgpu_records())
    return host, s, layout


def test_a_lent_vgpu_goes_where_its_admission_row_says(make_host):
    host, s, layout = std_host(make_host)
    assert start(host, "w0", tdom("w0", uid("e1e1e1e1", 0), uid("f1f1f1f1", 0), tenant="web",
                                  profile="A40-4Q")) == (0, "")
    assert mdev_gpu(host, uid("f1f1f1f1", 0)) == GPU_HI            # lent a layout slot: no new capacity
    [row] = admission_rows(s)
    assert row.result == "admitted" and str(GPU_HI) in row.value and "pool std" in row.value, row.value
    [alloc] = s.allocation_rows()
    assert alloc[3] == str(GPU_HI)


def test_naming_the_layouts_vgpu_keeps_exclusive_isolation(make_host):
    host, s, layout = std_host(make_host)
    assert start(host, "w0", tdom("w0", uid("e1e1e1e1", 0), uid("f1f1f1f1", 0), tenant="web",
                                  profile="A40-4Q")) == (0, "")
    free = [r.id for r in s.vgpu_records() if r.owner == "layout"]
    assert len(free) == 1 and mdev_gpu(host, free[0]) == GPU_HI
    # solo (exclusive) names the layout's other vGPU, on the GPU web's vGPU is on
    rc, err = start(host, "s0", tdom("s0", uid("e2e2e2e2", 0), free[0], tenant="solo", profile="A40-4Q"))
    assert rc == 2 and err.count("\n") == 1, err
    assert "exclusive" in err and str(GPU_HI) in err, err
    assert [r.id for r in s.vgpu_records() if r.owner == "layout"] == free          # not claimed
    assert {r[1] for r in s.allocation_rows()} == {uid("e1e1e1e1", 0)}
    assert admission_rows(s)[-1].result == "refused"


def test_naming_the_layouts_vgpu_keeps_the_pools_class(make_host):
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    apply(host, s, parse(CHEAP, "cheap.yaml"))
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    tenancy.add(s, tenancy.Tenant("low", qos="best-effort"))
    cheap = sorted(r.id for r in s.vgpu_records() if r.owner == "layout" and r.gpu == str(GPU_HI))
    assert len(cheap) == 2
    # a guaranteed domain names a vGPU of pool cheap, which serves best effort only
    rc, err = start(host, "g0", tdom("g0", uid("e3e3e3e3", 0), cheap[0], tenant="g"))
    assert rc == 2 and err.count("\n") == 1, err
    assert "pool 'cheap' does not serve guaranteed" in err, err
    assert sorted(r.id for r in s.vgpu_records() if r.owner == "layout" and r.gpu == str(GPU_HI)) == cheap
    assert not s.allocation_rows()
    # a best-effort tenant naming it claims it where it is, and its row names that GPU and pool
    assert start(host, "b0", tdom("b0", uid("e4e4e4e4", 0), cheap[0], tenant="low")) == (0, "")
    rec = next(r for r in s.vgpu_records() if r.id == cheap[0])
    assert rec.owner == uid("e4e4e4e4", 0) and rec.pool == "layout" and rec.gpu == str(GPU_HI)
    row = admission_rows(s)[-1]
    assert row.result == "admitted" and str(GPU_HI) in row.value and "pool cheap" in row.value, row.value


def test_a_start_waiting_on_the_host_lock_ends_as_transient_before_the_hook_times_out(make_host, monkeypatch):
    """The host lock held by another operation: the hook's start waits only until just before its own
    timeout, then exits 5 (a lock held past the timeout, docs/guide/hook.md), with nothing made."""
    import fcntl
    import os
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    tenancy.add(s, tenancy.Tenant("web"))
    monkeypatch.setenv("VGPUHOST_HOOK_TIMEOUT", "3")
    path = os.path.join(str(host.state_dir), "locks", "tenancy.lock")
    w0 = tdom("w0", uid("e5e5e5e5", 0), uid("f5f5f5f5", 0), tenant="web")
    bind_as_asked(host, w0)         # bound by the operator (issue 28; binding takes the host lock too)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, err = start(host, "w0", w0)
    finally:
        os.close(fd)
    assert rc == 5 and err.count("\n") == 1, err
    assert "lock 'tenancy'" in err and "timed out" not in err, err
    assert mdevs(host) == {} and not s.allocation_rows()
    assert start(host, "w0", tdom("w0", uid("e5e5e5e5", 0), uid("f5f5f5f5", 0), tenant="web")) == (0, "")


def test_plan_and_assert_show_the_pool_change_apply_refuses(make_host, capsys, tmp_path):
    """A pool change apply refuses (a guaranteed vGPU would be left in a pool not serving guaranteed) is
    BLOCKED in plan and drift in assert, as apply says; a change apply can record is drift until it does."""
    from vgpuhost.cli.main import main as cli_main
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    good = tmp_path / "cheap.yaml"
    good.write_text(CHEAP)
    assert cli_main(["--root", str(host.root), "apply", "-c", str(good)]) == 0
    tenancy.add(s, tenancy.Tenant("g", qos="guaranteed"))
    gold = next(r.id for r in s.vgpu_records() if r.gpu == str(GPU_LO))
    assert start(host, "g0", tdom("g0", uid("e6e6e6e6", 0), gold, tenant="g")) == (0, "")
    capsys.readouterr()
    bad = tmp_path / "burstable.yaml"
    bad.write_text(CHEAP.replace("pool: {name: gold, serves: [guaranteed]}", "pool: {name: gold, serves: [burstable]}"))
    rows = len(s.audit_rows())

    def run(*argv):
        code = cli_main(["--root", str(host.root), *argv, "-c", str(bad)])
        out, err = capsys.readouterr()
        return code, out, err
    code, out, _ = run("plan")
    assert "BLOCKED" in out and "pool 'gold' would not serve guaranteed" in out, out
    code, out, _ = run("assert")
    assert code == 1 and f"- pools: GPU {GPU_LO}: pool gold (fixed-share, serves burstable)" in out, out
    code, _, err = run("apply")
    assert code == 2 and "would not serve guaranteed" in err, err
    assert [p.classes for p in tenancy.pools(s) if p.name == "gold"] == [("guaranteed",)]
    assert len(s.audit_rows()) == rows
    # the same layout once nothing guaranteed runs there: drift until apply records it, then in sync
    from test_hook import stop
    assert stop(host, "g0", tdom("g0", uid("e6e6e6e6", 0), gold, tenant="g")) == (0, "")
    assert run("assert")[0] == 1
    assert run("apply")[0] == 0
    code, out, _ = run("assert")
    assert code == 0 and "in sync" in out, out


ONE_FREE = pool_layout("one", ("0000:41:00.0", "A40-8Q: 1", "fixed-share", "{name: gold, serves: [guaranteed]}"),
                       ("0000:81:00.0", "A40-8Q: 1", "equal-share", "std"))


def test_an_exclusive_tenant_may_take_the_one_free_layout_vgpu_of_a_gpu(make_host):
    """The layout vGPU a start claims or is handed is not its own neighbour: an exclusive tenant takes the
    only free one of a GPU (the GPU then holds its vGPU alone), named by UUID or lent."""
    host = mixed(make_host)
    s = StateStore(host.state_dir)
    apply(host, s, parse(ONE_FREE, "one.yaml"))
    tenancy.add(s, tenancy.Tenant("x", isolation="exclusive"))
    [free] = [r.id for r in s.vgpu_records() if r.gpu == str(GPU_HI)]
    assert start(host, "x0", tdom("x0", uid("e7e7e7e7", 0), free, tenant="x")) == (0, "")
    assert next(r for r in s.vgpu_records() if r.id == free).owner == uid("e7e7e7e7", 0)
    from test_hook import stop
    assert stop(host, "x0", tdom("x0", uid("e7e7e7e7", 0), free, tenant="x")) == (0, "")
    # a new UUID: the slot is handed over on the only GPU whose pool serves burstable
    assert start(host, "x1", tdom("x1", uid("e7e7e7e7", 1), uid("f7f7f7f7", 1), tenant="x")) == (0, "")
    assert mdev_gpu(host, uid("f7f7f7f7", 1)) == GPU_HI
    assert [r.result for r in admission_rows(s)] == ["admitted", "admitted"]


def test_an_unpinned_vgpu_listed_first_leaves_the_gpu_a_pinned_one_needs(make_host):
    for tenant in (None, "t"):
        host = mixed(make_host)
        s = StateStore(host.state_dir)
        if tenant:
            tenancy.add(s, tenancy.Tenant(tenant))
        m1, m2 = uid("c3c3c3c3", 1), uid("c3c3c3c3", 2)
        meta = Metadata(tenant=tenant, vgpus=[VgpuRequest("A40-8Q", uuid=m1),
                                              VgpuRequest("A40-8Q", uuid=m2, gpu=GPU_LO)])
        assert start(host, "pin", domain_xml("pin", uid("d3d3d3d3", 0), meta,
                                             [mdev_hostdev(m1), mdev_hostdev(m2)])) == (0, ""), tenant
        assert (mdev_gpu(host, m1), mdev_gpu(host, m2)) == (GPU_HI, GPU_LO)
