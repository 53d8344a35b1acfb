"""Issue 12 #4l, the leftover: an mdevctl definition's ``attrs`` (defined, not started) are applied
when the qemu hook creates the mdev the domain names, or the start is refused with the reason.
They used to be ignored: the mdev came up without the parameters mdevctl would have written."""

from __future__ import annotations

from vgpuhost.io.sysfs import Sysfs

from test_hook import A40, DOM1, MDEV1, _define_in_mdevctl, mdevs, start, stop, store, vgpu_domain, writes


def _params(host, uuid):
    return Sysfs(host).read_optional(host.mdev_devices / uuid / "nvidia" / "vgpu_params")


def test_the_definitions_vgpu_params_are_applied(make_host):
    host = make_host("a40-mdev")
    _define_in_mdevctl(host, str(A40), MDEV1, '{"mdev_type": "nvidia-566", "start": "manual", "attrs": '
                                              '[{"nvidia/vgpu_params": "frame_rate_limiter=0"}]}\n')
    xml = vgpu_domain("web", DOM1, MDEV1)
    assert start(host, "web", xml) == (0, "")
    assert mdevs(host) == {MDEV1: "nvidia-566"}
    assert _params(host, MDEV1) == "frame_rate_limiter=0"
    assert store(host).vgpu_records()[0].params == "frame_rate_limiter=0"     # reconcile re-creates them too
    assert (f"/sys/bus/mdev/devices/{MDEV1}/nvidia/vgpu_params", "frame_rate_limiter=0") in \
        [(r.path, r.value) for r in store(host).audit_rows()]
    assert stop(host, "web", xml) == (0, "") and mdevs(host) == {}


def test_an_attribute_vgpuhost_does_not_apply_refuses_the_start_naming_it(make_host):
    host = make_host("a40-mdev")
    _define_in_mdevctl(host, str(A40), MDEV1, '{"mdev_type": "nvidia-566", "start": "manual", "attrs": '
                                              '[{"nvidia/vgpu_params": "frame_rate_limiter=0"}, '
                                              '{"nvidia/other_knob": "1"}]}\n')
    rc, err = start(host, "web", vgpu_domain("web", DOM1, MDEV1))
    assert rc == 2 and err.count("\n") == 1, err
    assert "sets the attribute 'nvidia/other_knob' (attrs entry 1)" in err and "nvidia/vgpu_params only" in err
    assert f"mdevctl modify --uuid {MDEV1} --delattr --index N" in err
    assert mdevs(host) == {} and writes(host) == [] and store(host).vgpu_records() == []


def test_malformed_attrs_are_refused_by_position_only(make_host):
    host = make_host("a40-mdev")
    _define_in_mdevctl(host, str(A40), MDEV1, '{"mdev_type": "nvidia-566", "attrs": [{"a": "SECRET1", '
                                              '"b": "SECRET2"}]}\n')
    rc, err = start(host, "web", vgpu_domain("web", DOM1, MDEV1))
    assert rc == 2 and "its attrs entry 0 is not one {attribute: value} pair" in err, err
    assert "SECRET" not in err and mdevs(host) == {} and writes(host) == []
    _define_in_mdevctl(host, str(A40), MDEV1, '{"mdev_type": "nvidia-566", "attrs": '
                                              '[{"nvidia/vgpu_params": "SECRET not pairs"}]}\n')
    rc, err = start(host, "web", vgpu_domain("web", DOM1, MDEV1))
    assert rc == 2 and "its nvidia/vgpu_params (attrs entry 0) is not a list of key=value pairs" in err, err
    assert "SECRET" not in err and mdevs(host) == {} and writes(host) == []
