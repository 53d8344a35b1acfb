"""Tenancy gaps a breaker found (multi-tenant half, 2026-12-02): devices made for a domain in advance,
tenant changes racing admission, guaranteed capacity, names and parsing.

Outcomes are read back from the simulated sysfs tree, the state store (allocations, records, tenants)
and the audit log; exit codes and the one-line messages are asserted as the operator sees them.
"""

from __future__ import annotations

import json

from vgpuhost.cli.main import main as cli_main
from vgpuhost.io.state import StateStore
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest
from vgpuhost.model.values import PciAddress
from vgpuhost.ops import tenancy
from vgpuhost.ops import vgpu as vgpu_ops

from test_hook import GPU_HI, GPU_LO, domain_xml, driver, mdev_gpu, mdevs, mixed, pci_hostdev, start, stop
from test_mig_vgpu import GPU as H200, H200_MIG_ON
from test_tenancy import tdom, uid

T, L = tenancy.Tenant, tenancy.Limits


def run(capsys, host, *argv):
    code = cli_main(["--root", str(host.root), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def store_of(host) -> StateStore:
    return StateStore(host.state_dir)


def admission_rows(s: StateStore):
    return [r for r in s.audit_rows() if r.path == "(admission)"]


def quota(**g) -> tenancy.Quota:
    return tenancy.Quota(L(**g))


# ---------------------------------------------------------------------------
# 1. devices a domain holds in advance are admitted at its start

def test_a_vgpu_made_in_advance_for_a_domain_is_admitted_against_its_quota(make_host, capsys):
    host = mixed(make_host)
    s = store_of(host)
    dom, dev = uid("31313131", 0), uid("cbcbcbcb", 0)
    assert run(capsys, host, "tenant", "add", "u", "--vgpus", "0")[0] == 0
    assert run(capsys, host, "vgpu", "create", "--profile", "A40-8Q", "--uuid", dev, "--owner", dom,
               "--gpu", str(GPU_HI))[0] == 0
    before = mdevs(host)
    x = tdom("vmu", dom, dev, tenant="u")
    rc, err = start(host, "vmu", x)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("vgpuhost: error: domain 'vmu': admission: quota vGPUs of tenant 'u': 0 in use + 1 "
                          "asked > 0")
    # nothing changed: the vGPU stays where it was, held by the domain, with no allocation recorded
    assert mdevs(host) == before and mdev_gpu(host, dev) == GPU_HI
    assert [(r.id, r.owner) for r in s.vgpu_records()] == [(dev, dom)]
    assert s.allocation_rows() == [] and dom not in s.active_domains()
    assert [r.result for r in admission_rows(s)] == ["refused"]
    # with room in the quota it is admitted in place, counted against the tenant and audited
    assert run(capsys, host, "tenant", "set", "u", "--vgpus", "1")[0] == 0
    assert start(host, "vmu", x) == (0, "")
    assert mdevs(host) == before and mdev_gpu(host, dev) == GPU_HI
    assert [(r[0], r[1], r[2], r[3]) for r in s.allocation_rows()] == [(dev, dom, "u", str(GPU_HI))]
    assert [r.result for r in admission_rows(s)] == ["refused", "admitted"]
    usage = {u["tenant"]: u for u in tenancy.usage_report(s)}
    assert set(usage) == {"u"} and usage["u"]["usage"]["vgpus"]["used"] == 1
    # a second domain of the tenant no longer fits
    rc, err = start(host, "vmv", tdom("vmv", uid("31313131", 1), uid("cbcbcbcb", 1), tenant="u"))
    assert rc == 2 and "1 in use + 1 asked > 1" in err
    assert stop(host, "vmu", x) == (0, "")
    assert s.allocation_rows() == [] and dev not in mdevs(host)


def test_a_vgpu_made_in_advance_does_not_count_against_its_own_exclusive_tenant(make_host):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, T("solo", isolation="exclusive", quota=quota(vgpus=2)))
    dom, dev = uid("32323232", 0), uid("cdcdcdcd", 0)
    vgpu_ops.create(host, s, profile="A40-8Q", uuid=dev, owner=dom, gpu=GPU_LO)   # as the agent's allocate does
    assert start(host, "s0", tdom("s0", dom, dev, tenant="solo")) == (0, "")
    assert mdev_gpu(host, dev) == GPU_LO
    assert [(r[0], r[2], r[3]) for r in s.allocation_rows()] == [(dev, "solo", str(GPU_LO))]


def test_a_passthrough_gpu_bound_in_advance_for_a_domain_is_admitted_against_its_quota(make_host):
    from vgpuhost.ops import passthrough
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, T("hw", isolation="hardware", quota=quota(passthrough_gpus=0)))
    dom = uid("33333333", 9)
    passthrough.prepare(host, s, GPU_LO, owner=dom)
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.observe.inventory import discover
    fns = [GPU_LO, *discover(Sysfs(host)).gpu(GPU_LO).companions]
    held = sorted((r.bdf, r.owner) for r in s.passthrough_records())
    assert held and all(o == dom for _, o in held) and driver(host, GPU_LO) == "vfio-pci"
    x = domain_xml("p0", dom, Metadata(tenant="hw", passthrough=[GPU_LO]), [pci_hostdev(f) for f in fns])
    rc, err = start(host, "p0", x)
    assert rc == 2 and err.count("\n") == 1 and "quota passthrough GPUs of tenant 'hw': 0 in use + 1 asked > 0" in err
    assert sorted((r.bdf, r.owner) for r in s.passthrough_records()) == held      # still bound for it
    assert driver(host, GPU_LO) == "vfio-pci"
    assert s.allocation_rows() == [] and [r.result for r in admission_rows(s)] == ["refused"]
    tenancy.update(s, "hw", quota=quota(passthrough_gpus=1))
    assert start(host, "p0", x) == (0, "")
    assert [(r[0], r[2], r[4]) for r in s.allocation_rows()] == [(str(GPU_LO), "hw", "passthrough")]


def test_a_mig_backed_vgpu_made_in_advance_is_admitted_against_the_slices_quota(make_host):
    host = make_host(yaml_text=H200_MIG_ON)
    s = store_of(host)
    tenancy.add(s, T("m", isolation="hardware", quota=quota(mig_slices=0)))
    dom = uid("34343434", 0)
    out = vgpu_ops.create(host, s, profile="H200X-1-18C", create_gi=True, owner=dom)
    vf = PciAddress.parse(out.id)
    x = domain_xml("g0", dom, Metadata(tenant="m", vgpus=[VgpuRequest("H200X-1-18C", vf=vf)]), [pci_hostdev(vf)])
    before = (host.pci_device(out.id) / "nvidia" / "current_vgpu_type").read_text()
    rc, err = start(host, "g0", x)
    assert rc == 2 and "quota MIG compute slices of tenant 'm': 0 in use + 1 asked > 0" in err
    assert (host.pci_device(out.id) / "nvidia" / "current_vgpu_type").read_text() == before
    assert [(r.id, r.owner) for r in s.vgpu_records()] == [(out.id, dom)] and s.allocation_rows() == []
    tenancy.update(s, "m", quota=quota(mig_slices=1))
    assert start(host, "g0", x) == (0, "")
    assert [(r[0], r[2], r[3], r[7]) for r in s.allocation_rows()] == [(out.id, "m", str(H200), 1)]
    [u] = tenancy.usage_report(s)
    assert u["tenant"] == "m" and u["usage"]["mig_slices"]["used"] == 1
    assert json.loads(json.dumps(u))["usage"]["vgpus"]["used"] == 1


# ---------------------------------------------------------------------------
# 6. tenant changes serialise with admission

def _lock_held(host, name: str) -> bool:
    import errno
    import fcntl
    import os
    path = host.state_dir / "locks" / f"{name}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        assert e.errno in (errno.EAGAIN, errno.EACCES)
        return True
    finally:
        os.close(fd)
    return False


def test_tenant_add_set_remove_wait_for_the_host_lock_admission_holds(make_host):
    import time

    import pytest

    from vgpuhost.io.locks import deadline
    from vgpuhost.model.errors import TransientError
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, T("r", quota=quota(vgpus=1)))
    before = tenancy.tenants(s)
    with tenancy.host_lock(s):
        for change in (lambda: tenancy.remove(s, "r"), lambda: tenancy.update(s, "r", quota=quota(vgpus=5)),
                       lambda: tenancy.add(s, T("other"))):
            with deadline(time.monotonic()), pytest.raises(TransientError, match="lock 'tenancy'"):
                change()
    assert tenancy.tenants(s) == before
    assert [r.operation for r in s.audit_rows()] == ["tenant add r"]


def test_tenant_remove_during_a_start_waits_and_is_then_refused_naming_the_domain(make_host, capsys):
    """A start between admission and recording its allocation (a slow mdev create: the simulated
    kernel's lock held here) holds the host lock; ``tenant remove`` cannot slip in between."""
    import fcntl
    import threading
    import time

    import pytest

    from vgpuhost.io.locks import deadline
    from vgpuhost.model.errors import TransientError
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, T("r", quota=quota(vgpus=1)))
    dom, dev = uid("36363636", 0), uid("cececece", 0)
    x = tdom("r1", dom, dev, tenant="r")
    out = {}
    kernel = open(host.root / ".vgpuhost-sim" / "lock", "a+")
    fcntl.flock(kernel, fcntl.LOCK_EX)
    try:
        t = threading.Thread(target=lambda: out.setdefault("start", start(host, "r1", x)))
        t.start()
        while not _lock_held(host, "tenancy"):      # the start has been admitted and waits for the kernel
            assert t.is_alive()
            time.sleep(0.01)
        with deadline(time.monotonic()), pytest.raises(TransientError):
            tenancy.remove(s, "r")
        assert set(tenancy.tenants(s)) == {"r"}
    finally:
        fcntl.flock(kernel, fcntl.LOCK_UN)
        kernel.close()
    t.join()
    assert out["start"] == (0, "")
    assert [(r[0], r[2]) for r in s.allocation_rows()] == [(dev, "r")]
    code, _, err = run(capsys, host, "tenant", "remove", "R")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"vgpuhost: error: tenant 'r' holds 1 device(s): domain 'r1' (vGPU A40-8Q {dev} on ")
    assert "stop those domains first" in err and "nothing was changed" in err
    assert set(tenancy.tenants(s)) == {"r"}
    assert stop(host, "r1", x) == (0, "")
    assert run(capsys, host, "tenant", "remove", "r")[0] == 0 and tenancy.tenants(s) == {}


# ---------------------------------------------------------------------------
# 9. counts are ASCII digits: '²' (int() refuses it) and '٣' (int() reads 3) are input errors

def test_quota_counts_take_ascii_digits_only(make_host, capsys):
    host = mixed(make_host)
    for argv in (("tenant", "add", "t", "--vgpus", "²"), ("tenant", "add", "t", "--vgpus", "٣"),
                 ("tenant", "add", "t", "--framebuffer", "٣G"), ("tenant", "add", "t", "--mig-slices", "1:²")):
        code, _, err = run(capsys, host, *argv)
        assert code == 2 and err.count("\n") == 1, (argv, code, err)
        assert err.startswith(f"vgpuhost: error: --{argv[3][2:]}: ") and "is not a count" in err, err
    assert tenancy.tenants(store_of(host)) == {}
    assert run(capsys, host, "tenant", "add", "t", "--vgpus", "3")[0] == 0
    code, _, err = run(capsys, host, "tenant", "set", "t", "--vgpus", "²")
    assert code == 2 and "'²' is not a count" in err
    assert tenancy.get(store_of(host), "t").quota.guaranteed.vgpus == 3


def test_other_number_parsers_take_ascii_digits_only():
    import pytest

    from datetime import datetime, timezone
    from vgpuhost.cli.output import _type_sort
    from vgpuhost.io.unixsock import group_id
    from vgpuhost.model.errors import InputError
    from vgpuhost.model.values import MigProfile, is_digits
    from vgpuhost.policy.usage import parse_when
    from vgpuhost.policy.when import parse_since
    assert is_digits("0123") and not any(is_digits(t) for t in ("", "²", "٣", "1²", " 1", "-1", None))
    for bad in ("²", "٣"):
        with pytest.raises(InputError):
            group_id(bad)
        with pytest.raises(InputError):
            parse_since(bad + "h")
        assert parse_when(bad + "h", datetime.now(timezone.utc)) is None
        with pytest.raises(InputError):
            MigProfile.parse(bad + "g.10gb")
    assert group_id("0") == 0 and MigProfile.parse("1g.10gb").slices == 1
    assert sorted(["nvidia-²", "nvidia-10", "nvidia-9"], key=_type_sort) == ["nvidia-9", "nvidia-10", "nvidia-²"]
