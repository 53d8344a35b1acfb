"""Right-sizing at restart (issue 30 item 5) through the qemu hook on a simulated host.

A domain whose metadata asks ``resize="auto"`` gets the profile ``advise`` proposes at its next start
(same board and series), admitted within its tenant's quota, with an audit row naming the old and new
profile and the evidence; a domain without the opt-in keeps its profile; where the advised profile is
refused the one asked is used and the audit row says so.  Outcomes read back from the simulated tree
(the mdev's type), the state store and the audit log.
"""

from __future__ import annotations

import time

from vgpuhost.io import state as st
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
from vgpuhost.model.tenancy import Limits, Quota, Tenant
from vgpuhost.model.usage import UsageRow
from vgpuhost.ops import tenancy

from test_hook import GPU_LO, mdevs, mixed, start
from test_tenancy import store_of, tdom, uid

MIB = 1024 * 1024


def history(s, domain: str, device: str, profile: str, *, peak_mib: int, share: float, hours: int = 3) -> None:
    """``hours`` of metered rollups of ``device`` (the domain's mdev) on ``profile``."""
    now = int(time.time()) // 3600 * 3600
    rows = [UsageRow(time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 3600 * (h + 1))), device, domain, "vgpu",
                     str(GPU_LO), profile, "", "web", "burstable", 3600.0, 3600.0 * share, 0.0, 0.0,
                     peak_mib * MIB, 8192 * MIB, 60) for h in range(hours)]
    with s.transaction() as conn:
        st.add_usage(conn, rows)


def dom(i: int, resize: bool) -> str:
    xml = tdom(f"r{i}", uid("d1d1d1d1", i), uid("e1e1e1e1", i), tenant="web", profile="A40-8Q")
    return xml.replace('strategy="first-fit"', 'strategy="first-fit" resize="auto"') if resize else xml


def type_name(host, uuid: str) -> str:
    tid = mdevs(host)[uuid]
    return (host.root / "sys/bus/mdev/devices" / uuid / "mdev_type" / "name").read_text().split()[-1] if tid else ""


def setup(make_host, quota=None):
    host = mixed(make_host)
    s = store_of(host)
    tenancy.add(s, Tenant("web", quota=quota or Quota()))
    return host, s


def test_metadata_round_trips_resize_and_refuses_another_value():
    m = Metadata(tenant="web", vgpus=[VgpuRequest("A40-8Q", uuid=uid("e1e1e1e1", 1))], resize="auto")
    assert 'resize="auto"' in m.to_xml()
    assert parse_domain(dom(1, True)).metadata.resize == "auto"
    assert parse_domain(dom(1, False)).metadata.resize is None
    import pytest
    from vgpuhost.model.errors import InputError
    with pytest.raises(InputError):
        parse_domain(dom(1, True).replace('resize="auto"', 'resize="always"'))


def test_an_opted_in_domain_starts_on_the_advised_smaller_profile_with_an_audit_row(make_host):
    host, s = setup(make_host)
    history(s, uid("d1d1d1d1", 1), uid("e1e1e1e1", 1), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r1", dom(1, True)) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 1)) == "A40-2Q"        # 1500 MiB x 1.25 fits 2 GiB; same board, Q
    [row] = [r for r in s.audit_rows() if r.result == "resized"]
    assert row.path == uid("e1e1e1e1", 1) and "A40-8Q -> A40-2Q" in row.value and "framebuffer peak 1500 MiB" in row.value
    assert [r[0] for r in s.allocation_rows()] == [uid("e1e1e1e1", 1)]


def test_a_domain_without_the_opt_in_keeps_its_profile(make_host):
    host, s = setup(make_host)
    history(s, uid("d1d1d1d1", 2), uid("e1e1e1e1", 2), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r2", dom(2, False)) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 2)) == "A40-8Q"
    assert not [r for r in s.audit_rows() if r.result in ("resized", "resize-fallback")]


def test_no_history_no_resize(make_host):
    host, s = setup(make_host)
    assert start(host, "r3", dom(3, True)) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 3)) == "A40-8Q"


def test_the_advised_profile_is_admitted_within_the_tenants_quota(make_host):
    # web may hold 8 GiB of framebuffer and already holds 4 GiB (A40-4Q): A40-8Q would pass its quota,
    # the advised A40-2Q is within it
    host, s = setup(make_host, Quota(Limits(framebuffer_mib=8192)))
    other = tdom("r9", uid("d1d1d1d1", 9), uid("e1e1e1e1", 9), tenant="web", profile="A40-4Q")
    assert start(host, "r9", other) == (0, "")
    rc, err = start(host, "r5", dom(5, False))
    assert rc == 2 and "quota" in err, err                           # asked as it is: over web's quota
    history(s, uid("d1d1d1d1", 5), uid("e1e1e1e1", 5), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r5", dom(5, True)) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 5)) == "A40-2Q"
    held = sum({"A40-4Q": 4096, "A40-2Q": 2048}[type_name(host, u)] for u in mdevs(host))
    assert held <= 8192


def _started_with_no_room_for_the_advised(make_host):
    """Both A40s hold an A40-8Q of another domain (equal-size mode), then r6 (opted in, history advising
    A40-2Q) starts: no GPU takes the advised A40-2Q; ``(host, store)``."""
    host, s = setup(make_host)
    for i, g in ((7, "0"), (8, "1")):
        assert start(host, f"r{i}", tdom(f"r{i}", uid("d1d1d1d1", i), uid("e1e1e1e1", i), tenant="web",
                                         profile="A40-8Q", strategy="spread")) == (0, "")
    history(s, uid("d1d1d1d1", 6), uid("e1e1e1e1", 6), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r6", dom(6, True)) == (0, "")
    return host, s


def test_an_advised_profile_that_cannot_be_placed_falls_back_to_the_one_asked(make_host):
    # both A40s hold an A40-8Q of another domain (equal-size mode): no GPU takes an A40-2Q, an A40-8Q fits
    host, s = _started_with_no_room_for_the_advised(make_host)
    assert type_name(host, uid("e1e1e1e1", 6)) == "A40-8Q"
    [row] = [r for r in s.audit_rows() if r.result == "resize-fallback"]
    assert row.path == uid("e1e1e1e1", 6)
    assert "A40-2Q advised for A40-8Q could not be placed" in row.value and "started with A40-8Q as asked" in row.value
    assert not [r for r in s.audit_rows() if r.result == "resized"]


def test_without_tenancy_the_advised_profile_is_used_and_falls_back_where_it_finds_no_room(make_host):
    host = mixed(make_host)
    s = store_of(host)                      # no tenant: nothing to enforce, placement alone decides
    xml = dom(1, True).replace(' tenant="web"', "")
    history(s, uid("d1d1d1d1", 1), uid("e1e1e1e1", 1), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r1", xml) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 1)) == "A40-2Q"
    assert [r.result for r in s.audit_rows() if r.path == uid("e1e1e1e1", 1) and r.result.startswith("resize")] \
        == ["resized"]


def test_a_vendor_vfio_vf_gets_the_advised_type(make_host):
    """The VF the domain names holds the smaller type after the start (nvidia/current_vgpu_type read back)."""
    from test_hook import domain_xml, pci_hostdev
    from vgpuhost.io.sysfs import Sysfs
    from vgpuhost.io.vgpudev import vf_current_type
    from vgpuhost.observe.inventory import discover
    host, s = setup(make_host)
    vf = "0000:a1:00.4"
    meta = Metadata(tenant="web", vgpus=[VgpuRequest("L40S-8Q", vf=vf)], resize="auto")
    history(s, uid("d1d1d1d1", 7), vf, "L40S-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r7", domain_xml("r7", uid("d1d1d1d1", 7), meta, [pci_hostdev(vf)])) == (0, "")
    tid = vf_current_type(Sysfs(host), vf)
    names = {(t.type_id): t.name for t in discover(Sysfs(host)).vgpu_types}
    assert names.get(tid) == "L40S-2Q", (tid, names.get(tid))
    [row] = [r for r in s.audit_rows() if r.result == "resized"]
    assert row.path == vf and "L40S-8Q -> L40S-2Q" in row.value


def test_a_fallen_back_first_try_is_no_demand_for_the_reconciler(make_host):
    """The advised profile's refused admission (the start's first try) is followed by its
    'resize-fallback' row; the capacity reconciler does not weigh it (the start then ran as asked),
    while a plain refused start of the same domain later still counts once."""
    from vgpuhost.ops import rebalance
    from vgpuhost.policy import rebalance as pol
    host, s = _started_with_no_room_for_the_advised(make_host)
    [first] = [r for r in s.audit_rows() if r.path == "(admission)" and r.result == "refused"]
    assert first.value.endswith("; refusal=capacity profile=A40-2Q qos=burstable tenant=web"), first.value
    assert rebalance.facts(host, s, pol.Bounds()).refusals == []
    # a start refused outright (no resize) is demand, once
    big = tdom("r4", uid("d1d1d1d1", 4), uid("e1e1e1e1", 4), tenant="web", profile="A40-48Q")
    assert start(host, "r4", big)[0] == 2
    got = rebalance.facts(host, s, pol.Bounds()).refusals
    assert [(r.profile, r.tenant, r.qos, r.code) for r in got] == [("A40-48Q", "web", "burstable", "capacity")]


def test_the_advice_is_never_a_larger_profile_than_the_one_asked(make_host):
    """Trial 10a finding 2: the device metered on A40-8Q (advice there: A40-2Q); its metadata now asks
    A40-1Q, which the use does not fit: it starts on A40-1Q as asked, never on the larger A40-2Q."""
    host, s = setup(make_host)
    history(s, uid("d1d1d1d1", 1), uid("e1e1e1e1", 1), "A40-8Q", peak_mib=1500, share=0.03)
    assert start(host, "r1", dom(1, True).replace("A40-8Q", "A40-1Q")) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 1)) == "A40-1Q"
    assert not [r for r in s.audit_rows() if r.result in ("resized", "resize-fallback")]
    assert [(r[0], r[5]) for r in s.allocation_rows()] == [(uid("e1e1e1e1", 1), "A40-1Q")]


def test_the_same_use_gets_the_same_profile_at_every_restart(make_host):
    """Trial 10a finding 6: after a run on the advised A40-2Q with the same use, the next start is advised
    A40-2Q again (the run on 2Q is evidence for the A40-8Q asked), not put back on A40-8Q; each start's
    resize has its audit row."""
    from test_hook import stop
    host, s = setup(make_host)
    dev = uid("e1e1e1e1", 1)
    now = int(time.time()) // 3600 * 3600

    def meter(profile: str, hours_ago) -> None:
        rows = [UsageRow(time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 3600 * h)), dev, uid("d1d1d1d1", 1),
                         "vgpu", str(GPU_LO), profile, "", "web", "burstable", 3600.0, 3600.0 * 0.03, 0.0, 0.0,
                         1500 * MIB, 8192 * MIB, 60) for h in hours_ago]
        with s.transaction() as conn:
            st.add_usage(conn, rows)

    meter("A40-8Q", range(22, 25))
    made = []
    for k in range(1, 5):
        assert start(host, "r1", dom(1, True)) == (0, "")
        made.append(type_name(host, dev))
        stop(host, "r1", dom(1, True))
        meter(made[-1], range(22 - 4 * k, 25 - 4 * k))          # 3 more hours, the same use, on what it got
    assert made == ["A40-2Q"] * 4
    rows = [r for r in s.audit_rows() if r.result == "resized"]
    assert len(rows) == 4 and all("A40-8Q -> A40-2Q" in r.value and r.path == dev for r in rows)


def test_history_on_another_series_is_no_evidence_for_the_profile_asked(make_host):
    """Right-sizing weighs only the history on the asked profile's board, series and GI size: a device that
    metered on A40-8C (compute) gets no advice for the A40-8Q asked now."""
    host, s = setup(make_host)
    history(s, uid("d1d1d1d1", 1), uid("e1e1e1e1", 1), "A40-8C", peak_mib=1500, share=0.03)
    assert start(host, "r1", dom(1, True)) == (0, "")
    assert type_name(host, uid("e1e1e1e1", 1)) == "A40-8Q"
    assert not [r for r in s.audit_rows() if r.result in ("resized", "resize-fallback")]
