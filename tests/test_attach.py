"""attach / detach against libvirt: the test driver (fast) and one real, isolated libvirtd.

``test:///default`` keeps its domains for as long as one connection to it
is open in this process, so the ``lv`` fixture holds one for the test and
undefines what it defined.  Every refusal is checked to leave the
persistent definition byte-for-byte unchanged.  Host facts come from
simulated hosts (``make_host``); state stores live in pytest's tmp dirs.
"""

from __future__ import annotations

import json
import sys
import uuid as uuidlib
from pathlib import Path
from types import SimpleNamespace

import libvirt
import pytest
from lxml import etree

from vgpuhost.libvirt import domxml
from vgpuhost.ops import passthrough, vgpu
from vgpuhost.ops.attach import attach, detach
from vgpuhost.cli.main import main
from vgpuhost.model.errors import DeviceError, HostEnvironmentError, InputError, RefusedError
from vgpuhost.io.hostroot import HostRoot
from vgpuhost.observe.inventory import discover
from vgpuhost.io.state import StateStore
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

sys.path.insert(0, str(Path(__file__).resolve().parent))  # libvirtd_fixture, nsutil
pytest_plugins = ["libvirtd_fixture"]                      # a no-op when conftest loads it

URI = "test:///default"
NS = domxml.NS
INACTIVE = libvirt.VIR_DOMAIN_XML_INACTIVE


@pytest.fixture
def lv():
    conn = libvirt.open(URI)
    names = []

    def define(name, devices="", *, graphics=False):
        gfx = "<graphics type='vnc'/>" if graphics else ""
        xml = (f"<domain type='test'><name>{name}</name><memory>65536</memory><os><type>hvm</type></os>"
               f"<devices>{gfx}{devices}</devices></domain>")
        names.append(name)
        return conn.defineXML(xml)

    yield SimpleNamespace(conn=conn, define=define)
    for n in names:
        try:
            d = conn.lookupByName(n)
            if d.isActive():
                d.destroy()
            d.undefine()
        except libvirt.libvirtError:
            pass
    conn.close()


@pytest.fixture
def env(make_host, tmp_path):
    """``env('a40-mdev')`` -> (host, store) with a state dir of its own (``yaml_text``: that spec instead)."""
    def build(spec, yaml_text=None):
        h = make_host(spec) if yaml_text is None else make_host(yaml_text=yaml_text)
        host = HostRoot(h.root, tmp_path / f"state-{spec}-{uuidlib.uuid4().hex[:6]}")
        return host, StateStore(host.state_dir)
    return build


def xml_of(dom) -> str:
    return dom.XMLDesc(INACTIVE)


def meta_of(dom):
    """The metadata both ways: libvirt's metadata() API and a parse of the definition; must agree."""
    try:
        raw = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, NS, libvirt.VIR_DOMAIN_AFFECT_CONFIG)
    except libvirt.libvirtError as e:
        assert e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA
        raw = None
    parsed = domxml.parse_domain(xml_of(dom)).metadata
    if raw is None:
        assert parsed is None
        return None
    root = etree.fromstring(raw.encode())                 # libvirt's copy: unprefixed, same content
    assert root.tag == "domain" and root.get("version") == "1" and root.get("strategy") == parsed.strategy
    assert (root.get("tenant"), root.get("anti-affinity")) == (parsed.tenant, parsed.anti_affinity)
    want = [("vgpu", {k: str(v) for k, v in (("profile", r.profile), ("uuid", r.uuid), ("vf", r.vf),
                                              ("gpu", r.gpu)) if v is not None}) for r in parsed.vgpus]
    want += [("passthrough", {"gpu": str(g)}) for g in parsed.passthrough]
    assert [(c.tag, dict(c.attrib)) for c in root] == want
    return parsed


def hostdevs(dom):
    return etree.fromstring(xml_of(dom).encode()).findall("devices/hostdev")


def refused(exc, fn, dom, text):
    """``fn()`` raises ``exc`` mentioning ``text`` and the definition stays byte-for-byte the same."""
    before = xml_of(dom)
    with pytest.raises(exc) as err:
        fn()
    assert text in err.value.one_line(), err.value.one_line()
    assert "\n" not in err.value.one_line()
    assert xml_of(dom) == before
    return err.value


# --- attach each kind ---------------------------------------------------------------

def test_attach_mdev_writes_hostdev_and_metadata_in_one_definition(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-mdev", graphics=True)
    out = attach(host, store, URI, "vgh-mdev", profile="a40-8q", tenant="team-a", strategy="best-fit",
                 anti_affinity="web", display=True, ramfb=True)
    [entry] = out.devices
    assert entry.kind == "mdev" and entry.profile == "A40-8Q" and out.changed and not out.dry_run
    u = entry.id
    assert str(uuidlib.UUID(u)) == u
    [hd] = hostdevs(dom)
    assert (hd.get("type"), hd.get("model"), hd.get("display"), hd.get("ramfb")) == ("mdev", "vfio-pci", "on", "on")
    assert hd.find("source/address").get("uuid") == u
    m = meta_of(dom)
    assert m == domxml.Metadata("best-fit", "team-a", "web", [domxml.VgpuRequest("A40-8Q", uuid=u)])
    # the hook creates the mdev at start: nothing on the host yet, nothing recorded
    assert discover(Sysfs(host)).mdevs == () and store.vgpu_records() == []
    rows = [r for r in store.audit_rows() if r.path == "libvirt:defineXML"]
    assert len(rows) == 1 and rows[0].operation == "attach vgh-mdev" and u in rows[0].value
    assert dom.UUIDString() in rows[0].value


def test_attach_passthrough_group_shares_a_slot_and_detach_removes_it(lv, env):
    host, store = env("a100-sriov-mdev", yaml_text=a100_vfs_off())      # passthrough needs its VFs off
    dom = lv.define("vgh-pt")
    out = attach(host, store, URI, dom.UUIDString(), passthrough="0000:41:00.0")    # by UUID
    assert out.domain == "vgh-pt" and out.devices[0].functions == ["0000:41:00.0", "0000:41:00.1"]
    hds = hostdevs(dom)
    assert [h.get("managed") for h in hds] == ["no", "no"]
    assert [h.find("source/address").get("function") for h in hds] == ["0x0", "0x1"]
    guests = [h.find("address") for h in hds]
    assert [(g.get("slot"), g.get("function"), g.get("multifunction")) for g in guests] == \
        [("0x10", "0x0", "on"), ("0x10", "0x1", None)]
    assert meta_of(dom).passthrough == [PciAddress.parse("0000:41:00.0")]
    out = detach(host, store, URI, "vgh-pt", device="0000:41:00.0")
    assert out.devices[0].kind == "passthrough" and out.released == []
    assert hostdevs(dom) == [] and meta_of(dom) is None


def test_attach_vendor_vf_reserves_distinct_vfs_across_domains(lv, env):
    host, store = env("l40s-vendor-vfio")
    a, b = lv.define("vgh-vf-a"), lv.define("vgh-vf-b")
    first = attach(host, store, URI, "vgh-vf-a", profile="L40S-4Q")
    second = attach(host, store, URI, "vgh-vf-b", profile="L40S-4Q")
    assert first.devices[0].id == "0000:21:00.4" and second.devices[0].id == "0000:21:00.5"
    assert "first-fit" in first.reason
    [hd] = hostdevs(a)
    assert (hd.get("type"), hd.get("managed")) == ("pci", "no")
    assert meta_of(a).vgpus == [domxml.VgpuRequest("L40S-4Q", vf=PciAddress.parse("0000:21:00.4"))]
    # a second vGPU in domain a goes to the other GPU (one vGPU per VM per physical GPU) ...
    again = attach(host, store, URI, "vgh-vf-a", profile="L40S-4Q")
    assert again.devices[0].gpu == "0000:a1:00.0"
    # ... and a third finds no GPU of its own
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-vf-a", profile="L40S-2Q"), a,
            "one vGPU per VM per GPU")
    # nothing was written to the host: the hook sets the VF type at start
    assert all(v.type_id is None for v in discover(Sysfs(host)).vf_vgpus)
    out = detach(host, store, URI, "vgh-vf-a", all=True)
    assert sorted(d.id for d in out.devices) == ["0000:21:00.4", "0000:a1:00.4"]
    assert hostdevs(a) == [] and meta_of(a) is None and len(hostdevs(b)) == 1


def test_vf_reservation_counts_pending_capacity(lv, env):
    """VFs reserved by stopped domains count against the GPU's framebuffer: L40S-48Q fits once."""
    host, store = env("l40s-vendor-vfio")
    for n in ("vgh-big-1", "vgh-big-2", "vgh-big-3"):
        lv.define(n)
    assert attach(host, store, URI, "vgh-big-1", profile="L40S-48Q").devices[0].gpu == "0000:21:00.0"
    assert attach(host, store, URI, "vgh-big-2", profile="L40S-48Q").devices[0].gpu == "0000:a1:00.0"
    dom3 = lv.conn.lookupByName("vgh-big-3")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-big-3", profile="L40S-48Q"), dom3,
                  "cannot reserve a VF for L40S-48Q")
    assert "reserved by defined domains" in err.message
    # detaching the first domain's VF (by its BDF) frees the GPU for the third
    assert detach(host, store, URI, "vgh-big-1", device="0000:21:00.4").devices[0].kind == "vendor-vfio"
    assert attach(host, store, URI, "vgh-big-3", profile="L40S-48Q").devices[0].id == "0000:21:00.4"


def test_dry_run_changes_nothing_and_shows_the_diff(lv, env, tmp_path):
    host, _ = env("a40-mdev")
    store = StateStore(tmp_path / "never", create=False)
    dom = lv.define("vgh-dry")
    before = xml_of(dom)
    out = attach(host, store, URI, "vgh-dry", passthrough="0000:81:00.0", dry_run=True)
    assert out.dry_run and xml_of(dom) == before
    assert "+    <hostdev mode=\"subsystem\" type=\"pci\" managed=\"no\">" in out.diff
    assert "+      <vgpuhost:passthrough gpu=\"0000:81:00.0\"/>" in out.diff
    assert not (tmp_path / "never").exists()


# --- refusals: definition unchanged --------------------------------------------------------

def test_duplicate_and_foreign_passthrough_are_refused(lv, env):
    host, store = env("a100-sriov-mdev", yaml_text=a100_vfs_off())      # passthrough needs its VFs off
    one, two = lv.define("vgh-dup-1"), lv.define("vgh-dup-2")
    attach(host, store, URI, "vgh-dup-1", passthrough="0000:41:00.0")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-dup-1", passthrough="0000:41:00.0"), one,
            "already passed through to vgh-dup-1")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-dup-2", passthrough="0000:41:00.0"), two,
            "already given to domain vgh-dup-1")
    # a vGPU on a GPU passed through in the same domain has no GPU left
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-dup-2", profile="A100-4C"), two,
            "passed through by a defined domain")


def test_hand_made_hostdev_is_a_duplicate(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-hand", "<hostdev mode='subsystem' type='pci' managed='yes'><source><address "
                                "domain='0x0000' bus='0x81' slot='0x00' function='0x0'/></source></hostdev>")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-hand", passthrough="0000:81:00.0"), dom,
            "not attached by vgpuhost")
    refused(RefusedError, lambda: detach(host, store, URI, "vgh-hand", device="0000:81:00.0"), dom,
            "was not attached by vgpuhost")


def pci_hostdev(bdf: str, managed: str = "yes") -> str:
    """A hand-written ``<hostdev type='pci'>`` for host function ``bdf``."""
    a = PciAddress.parse(bdf)
    return (f"<hostdev mode='subsystem' type='pci' managed='{managed}'><source><address domain='0x{a.domain:04x}' "
            f"bus='0x{a.bus:02x}' slot='0x{a.slot:02x}' function='0x{a.function:x}'/></source></hostdev>")


def test_vf_is_never_placed_on_a_gpu_a_hand_written_hostdev_passes_through(lv, env):
    """Review 1 item 2: vm5 passes the PF through by hand (managed='yes', no vgpuhost metadata)."""
    host, store = env("l40s-vendor-vfio")
    lv.define("vgh-hand5", pci_hostdev("0000:21:00.0"))
    vm3 = lv.define("vgh-vm3")
    # pinned to the GPU vm5 holds: refused, nothing reserved
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-vm3", profile="L40S-4Q", gpu="0000:21:00.0"),
                  vm3, "cannot reserve a VF for L40S-4Q")
    assert "passed through to domain vgh-hand5" in err.message and err.exit_code == 2
    # unpinned: the other GPU, never a VF of 0000:21:00.0
    out = attach(host, store, URI, "vgh-vm3", profile="L40S-48Q")
    assert out.devices[0].gpu == "0000:a1:00.0"
    assert [h.find("source/address").get("bus") for h in hostdevs(vm3)] == ["0xa1"]
    assert meta_of(vm3).vgpus == [domxml.VgpuRequest("L40S-48Q", vf=PciAddress.parse(out.devices[0].id))]
    # ... and once that GPU is full, there is no GPU left: refused, not a VF of the passed-through PF
    vm4 = lv.define("vgh-vm4")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-vm4", profile="L40S-48Q"), vm4,
            "cannot reserve a VF for L40S-48Q")
    assert hostdevs(vm4) == [] and meta_of(vm4) is None


def test_vf_placement_skips_a_gpu_this_domain_passes_through_by_hand(lv, env):
    host, store = env("l40s-vendor-vfio")
    dom = lv.define("vgh-self", pci_hostdev("0000:21:00.0", managed="no"))
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-self", profile="L40S-4Q", gpu="0000:21:00.0"),
            dom, "passed through to domain vgh-self")
    assert attach(host, store, URI, "vgh-self", profile="L40S-4Q").devices[0].gpu == "0000:a1:00.0"


def test_mdev_refuses_a_gpu_whose_group_function_another_domain_holds_by_hand(lv, env):
    """A hostdev for the GPU's HD-audio function (same IOMMU group) takes the whole GPU away."""
    host, store = env("a100-sriov-mdev")
    lv.define("vgh-audio", pci_hostdev("0000:41:00.1"))
    dom = lv.define("vgh-mdev-pin")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-mdev-pin", profile="A100-4C", gpu="0000:41:00.0"),
            dom, "0000:41:00.0 is passed through to domain vgh-audio: it offers no vGPUs")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-mdev-pin", profile="A100-4C"), dom,
                  "every GPU that offers A100-4C (0000:41:00.0) is passed through by a defined domain")
    assert err.exit_code == 2 and meta_of(dom) is None


def test_passthrough_held_by_a_hand_written_hostdev_points_to_virsh(lv, env):
    """Review 1 item 3: vgpuhost detach cannot remove a hostdev it did not attach; the remedy is virsh."""
    host, store = env("l40s-vendor-vfio", yaml_text=l40s_second_vfs_off())   # a1:00.0 can be passed through
    lv.define("vgh-vm5", pci_hostdev("0000:21:00.0"))
    vm2 = lv.define("vgh-vm2")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-vm2", passthrough="0000:21:00.0"), vm2,
                  "0000:21:00.0 is already given to domain vgh-vm5: its hostdev for 0000:21:00.0 was not "
                  "attached by vgpuhost")
    assert "virsh" in err.hint and "vgpuhost detach" not in err.hint
    # attached by vgpuhost: the remedy is vgpuhost detach, which works
    lv.define("vgh-vm6")
    attach(host, store, URI, "vgh-vm6", passthrough="0000:a1:00.0")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-vm2", passthrough="0000:a1:00.0"), vm2,
                  "already given to domain vgh-vm6")
    assert "vgpuhost detach vgh-vm6 0000:a1:00.0" in err.hint
    detach(host, store, URI, "vgh-vm6", device="0000:a1:00.0")
    attach(host, store, URI, "vgh-vm2", passthrough="0000:a1:00.0")
    assert meta_of(vm2).passthrough == [PciAddress.parse("0000:a1:00.0")]


def test_passthrough_refusal_names_each_vf_once(lv, env):
    """Review 1 item 14: a VF is in the metadata and in a hostdev; the message lists it once."""
    host, store = env("l40s-vendor-vfio")
    lv.define("vgh-vm1")
    vf = attach(host, store, URI, "vgh-vm1", profile="L40S-4Q", gpu="0000:a1:00.0").devices[0].id
    dom = lv.define("vgh-pt-vf")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-pt-vf", passthrough="0000:a1:00.0"), dom,
                  f"0000:a1:00.0 carries vGPUs of domain vgh-vm1 ({vf}): a GPU is either passed through or shared")
    assert err.message.count(vf) == 1


def test_second_vgpu_on_the_same_gpu_is_refused(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-two")
    attach(host, store, URI, "vgh-two", profile="A40-8Q", gpu="0000:81:00.0")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-two", profile="A40-4Q", gpu="0000:81:00.0"),
            dom, "already has vGPU")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-two", profile="A40-4Q"), dom,
            "one vGPU per VM per physical GPU")
    # passing the GPU through would leave the vGPU without a GPU
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-two", passthrough="0000:81:00.0"), dom,
            "already has vGPU")


def test_guest_slot_collision_and_ramfb_and_display(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-slot", "<watchdog model='i6300esb'><address type='pci' domain='0x0000' bus='0x00' "
                                "slot='0x10' function='0x0'/></watchdog>", graphics=True)
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-slot", passthrough="0000:81:00.0",
                                         guest_slot=0x10), dom, "0000:00:10 is taken by <watchdog")
    out = attach(host, store, URI, "vgh-slot", profile="A40-8Q", display=True, ramfb=True, guest_slot=0x11)
    assert hostdevs(dom)[0].find("address").get("slot") == "0x11"
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-slot", profile="A40-8Q", display=True, ramfb=True),
            dom, f"already has a ramfb on mdev {out.devices[0].id}")
    bare = lv.define("vgh-nogfx")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-nogfx", profile="A40-8Q", display=True), bare,
            "needs a graphics device")


def test_running_domain_and_live(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-run")
    dom.create()
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-run", profile="A40-8Q"), dom, "is running")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-run", passthrough="0000:81:00.0", live=True), dom,
            "--live is supported for classic mdev vGPUs only")
    refused(RefusedError, lambda: detach(host, store, URI, "vgh-run", all=True), dom, "is running")
    # --live mdev: created now, hot-plug fails on the test driver -> rolled back, definition unchanged
    err = refused(DeviceError, lambda: attach(host, store, URI, "vgh-run", profile="A40-8Q", live=True), dom,
                  "was removed again")
    # review 1 item 17: said once, naming the vGPU: "hot-plugging A40-8Q vGPU <uuid> into vgh-run: ..."
    assert err.message.startswith("hot-plugging A40-8Q vGPU ") and " into vgh-run: " in err.message
    assert err.message.count("hot-plugging") == 1 and err.message.endswith("the definition is unchanged")
    assert discover(Sysfs(host)).mdevs == () and store.vgpu_records() == []
    assert [r for r in store.audit_rows() if r.path.endswith("/create")], "the mdev was really created first"


def test_live_mdev_creates_hotplugs_and_defines(lv, env, monkeypatch):
    """The test driver cannot hot-plug, so only that one libvirt call is stood in; the mdev, the
    record, the definition and the live metadata are the real outcomes."""
    from vgpuhost.io import virt
    plugged = []
    monkeypatch.setattr(virt.Domain, "attach_live", lambda self, xml, **kw: plugged.append((self.name, xml)))
    host, store = env("a40-mdev")
    dom = lv.define("vgh-live")
    dom.create()
    out = attach(host, store, URI, "vgh-live", profile="A40-8Q", live=True)
    u = out.devices[0].id
    assert out.live and out.devices[0].gpu == "0000:81:00.0"
    assert [m.uuid for m in discover(Sysfs(host)).mdevs] == [u]
    [rec] = store.vgpu_records()
    assert rec.id == u and rec.owner == dom.UUIDString()
    assert plugged == [("vgh-live", out.hostdevs)] and u in out.hostdevs
    assert meta_of(dom).vgpus == [domxml.VgpuRequest("A40-8Q", uuid=u)]
    live = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, NS, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    assert u in live                                     # what the hook reads at release end:
    assert domxml.parse_domain(dom.XMLDesc(0)).metadata.vgpus == [domxml.VgpuRequest("A40-8Q", uuid=u)]
    assert [r.path for r in store.audit_rows() if r.path.startswith("libvirt:")] == \
        ["libvirt:attachDeviceFlags", "libvirt:defineXML"]


def test_live_ramfb_refused_before_anything_changes(lv, env, monkeypatch):
    """Issue 25 item 11: a ramfb vGPU is QEMU's vfio-pci-nohotplug, so --live --ramfb is refused, nothing made."""
    from vgpuhost.io import virt
    plugged = []
    monkeypatch.setattr(virt.Domain, "attach_live", lambda self, xml, **kw: plugged.append(xml))
    host, store = env("a40-mdev")
    dom = lv.define("vgh-live-ramfb", graphics=True)
    dom.create()
    err = refused(InputError, lambda: attach(host, store, URI, "vgh-live-ramfb", profile="A40-8Q", display=True,
                                             ramfb=True, live=True), dom, "vfio-pci-nohotplug")
    assert "--ramfb cannot go with --live" in err.message
    assert plugged == [] and discover(Sysfs(host)).mdevs == () and store.vgpu_records() == []


def test_live_vendor_vf_refused(lv, env):
    host, store = env("l40s-vendor-vfio")
    dom = lv.define("vgh-run-vf")
    dom.create()
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-run-vf", profile="L40S-4Q", live=True), dom,
            "stop the domain first")


def test_unknown_profile_is_refused_before_libvirt_is_contacted(env):
    host, store = env("a40-mdev")
    with pytest.raises(InputError) as err:
        attach(host, store, "test:///nonexistent/node.xml", "whatever", profile="A40-9Q")
    assert "unknown vGPU profile 'A40-9Q'" in err.value.message and "A40-8Q" in err.value.one_line()


def test_input_errors(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-input")
    refused(InputError, lambda: attach(host, store, URI, "vgh-input"), dom, "exactly one of")
    refused(InputError, lambda: attach(host, store, URI, "vgh-input", profile="A40-8Q", ramfb=True), dom,
            "--ramfb needs --display")
    refused(InputError, lambda: attach(host, store, URI, "vgh-input", profile="A40-8Q", tenant="a b"), dom,
            "invalid tenant")
    refused(InputError, lambda: attach(host, store, URI, "vgh-input", profile="A40-8Q", strategy="random"), dom,
            "unknown placement strategy")
    refused(InputError, lambda: attach(host, store, URI, "vgh-input", passthrough="0000:99:00.0"), dom,
            "no NVIDIA GPU at 0000:99:00.0")
    refused(InputError, lambda: detach(host, store, URI, "vgh-input", device="../../x"), dom, "invalid device")
    refused(InputError, lambda: detach(host, store, URI, "vgh-input", device=str(uuidlib.uuid4())), dom,
            "has no device")
    with pytest.raises(InputError) as err:
        attach(host, store, URI, "vgh-missing", profile="A40-8Q")
    assert "no domain 'vgh-missing' on test:///default" in err.value.message


def test_not_viable_group_and_transient_domain(lv, env):
    host, store = env("sata-shared-group")
    dom = lv.define("vgh-sata")
    refused(RefusedError, lambda: attach(host, store, URI, "vgh-sata", passthrough="0000:03:00.0"), dom,
            "is not viable")
    tr = lv.conn.createXML("<domain type='test'><name>vgh-transient</name><memory>65536</memory><os><type>hvm"
                           "</type></os></domain>")
    try:
        with pytest.raises(RefusedError) as err:
            attach(host, store, URI, "vgh-transient", passthrough="0000:03:00.0")
        assert "transient" in err.value.message
    finally:
        tr.destroy()


def test_unreachable_libvirt_is_one_line(env, tmp_path):
    host, store = env("a40-mdev")
    uri = f"qemu:///system?socket={tmp_path}/no-such-sock"
    with pytest.raises(HostEnvironmentError) as err:
        attach(host, store, uri, "vm", passthrough="0000:81:00.0")
    line = err.value.one_line()
    assert f"cannot connect to libvirt at {uri}" in line and "--connect" in line and "\n" not in line


def test_only_virt_imports_libvirt():
    import ast
    pkg = Path(__file__).resolve().parents[1] / "vgpuhost"
    importers = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "libvirt" or n.startswith("libvirt.") for n in names):
                importers.add(path.relative_to(pkg).as_posix())
    assert importers == {"io/virt.py"}


# --- detach releases what vgpuhost owns ---------------------------------------------------------

def test_detach_releases_the_domains_vgpu(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-rel")
    u = attach(host, store, URI, "vgh-rel", profile="A40-8Q").devices[0].id
    # as if the hook created it at start and the release never came
    vgpu.create(host, store, profile="A40-8Q", uuid=u, owner=dom.UUIDString())
    assert [m.uuid for m in discover(Sysfs(host)).mdevs] == [u]
    out = detach(host, store, URI, "vgh-rel", device=u.upper())
    assert out.released == [u] and discover(Sysfs(host)).mdevs == () and store.vgpu_records() == []
    assert hostdevs(dom) == [] and meta_of(dom) is None


def l40s_second_vfs_off() -> str:
    """l40s-vendor-vfio with the SR-IOV VFs of its second GPU (0000:a1:00.0) disabled (so no vGPU backend
    there: vendor VFIO needs them): it can be passed through."""
    from vgpuhost.sim.data import bundled_specs
    text = Path(bundled_specs()["l40s-vendor-vfio"]).read_text()
    head, sep, tail = text.partition('bdf: "0000:a1:00.0"')
    old = "vgpu: {backend: vendor-vfio, sriov_numvfs: 16}"
    assert sep and old in tail
    return head + sep + tail.replace(old, "vgpu: {backend: none}", 1)


def test_attach_passthrough_refuses_a_pf_with_sriov_vfs_enabled_naming_the_fix(lv, env):
    """Issue 12 #4c, the leftover: 'passthrough prepare' refused a PF with SR-IOV VFs enabled (vfio-pci does
    not bind one) but 'attach --passthrough' accepted it, so the domain failed at every start."""
    host, store = env("a100-sriov-mdev")
    dom = lv.define("vgh-pt-vfs")
    err = refused(RefusedError, lambda: attach(host, store, URI, "vgh-pt-vfs", passthrough="0000:41:00.0"), dom,
                  "0000:41:00.0 cannot be passed through to vgh-pt-vfs: 0000:41:00.0 has 20 SR-IOV VFs enabled")
    assert "sriov-manage -d 0000:41:00.0" in err.one_line()
    with pytest.raises(RefusedError, match="has 20 SR-IOV VFs enabled"):          # prepare says the same
        passthrough.prepare(host, store, PciAddress.parse("0000:41:00.0"))
    # the same GPU after 'sriov-manage -d': attached
    host, store = env("a100-sriov-mdev", yaml_text=a100_vfs_off())
    attach(host, store, URI, "vgh-pt-vfs", passthrough="0000:41:00.0")
    assert meta_of(dom).passthrough == [PciAddress.parse("0000:41:00.0")]


def a100_vfs_off() -> str:
    """a100-sriov-mdev after ``sriov-manage -d``: vfio-pci binds no PF with VFs enabled (issue 12 #4c)."""
    from vgpuhost.sim.data import bundled_specs
    text = Path(bundled_specs()["a100-sriov-mdev"]).read_text()
    assert "sriov_numvfs: 20" in text
    return text.replace("sriov_numvfs: 20", "sriov_numvfs: 0")


def test_detach_releases_the_domains_group(lv, env):
    host, store = env("a100-sriov-mdev", yaml_text=a100_vfs_off())
    dom = lv.define("vgh-relpt")
    attach(host, store, URI, "vgh-relpt", passthrough="0000:41:00.0")
    passthrough.prepare(host, store, PciAddress.parse("0000:41:00.0"), owner=dom.UUIDString())
    inv = discover(Sysfs(host))
    assert inv.devices[PciAddress.parse("0000:41:00.0")].driver == "vfio-pci"
    out = detach(host, store, URI, "vgh-relpt", all=True)
    assert out.released == ["0000:41:00.0"]
    inv = discover(Sysfs(host))
    assert inv.devices[PciAddress.parse("0000:41:00.0")].driver == "nvidia"
    assert inv.devices[PciAddress.parse("0000:41:00.1")].driver == "snd_hda_intel"


def test_detach_all_without_devices_is_a_no_op(lv, env):
    host, store = env("a40-mdev")
    dom = lv.define("vgh-empty")
    before = xml_of(dom)
    out = detach(host, store, URI, "vgh-empty", all=True)
    assert not out.changed and xml_of(dom) == before


# --- CLI -----------------------------------------------------------------------------------

def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_attach_detach_json_and_exit_codes(lv, env, capsys, monkeypatch):
    host, _ = env("a40-mdev")
    dom = lv.define("vgh-cli", graphics=True)
    base = ["--root", str(host.root), "--state-dir", str(host.state_dir), "--connect", URI]
    code, out, err = run(capsys, *base, "--json", "attach", "vgh-cli", "--profile", "A40-8Q", "--display")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "vgpuhost.attach/v1" and doc["domain"] == "vgh-cli"
    assert set(doc) == {"schema", "action", "domain", "uuid", "uri", "changed", "dry_run", "live", "devices",
                        "hostdevs", "metadata", "reason", "diff", "released", "notes"}
    u = doc["devices"][0]["id"]
    before = xml_of(dom)
    code, out, err = run(capsys, *base, "attach", "vgh-cli", "--profile", "A40-8Q")
    assert code == 2 and out == "" and err.startswith("vgpuhost: error: ") and err.count("\n") == 1
    assert xml_of(dom) == before
    monkeypatch.setenv("LIBVIRT_DEFAULT_URI", URI)        # as virsh: the environment names the URI
    code, out, err = run(capsys, "--root", str(host.root), "--state-dir", str(host.state_dir),
                         "detach", "vgh-cli", "--dry-run", u)
    assert code == 0 and out.startswith(f"would detach A40-8Q vGPU (classic mdev {u}) from vgh-cli")
    assert "-    <hostdev" in out and xml_of(dom) == before
    code, out, err = run(capsys, *base, "--json", "detach", "vgh-cli", u)
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.detach/v1" and doc["devices"][0]["id"] == u
    assert hostdevs(dom) == []
    code, _, err = run(capsys, *base, "detach", "vgh-cli")
    assert code == 2 and "DEVICE" in err


# --- a real libvirtd (root; skipped elsewhere, failed in CI) ---------------------------------------

@pytest.mark.root
def test_real_libvirtd_attach_passthrough_and_vgpu_then_detach(libvirtd, env):
    from vgpuhost.sim.libvirtd import diskless_domain_xml
    pt_host, pt_store = env("turing-consumer")
    vg_host, vg_store = env("a40-mdev")
    conn = libvirt.open(libvirtd.uri)
    try:
        dom = conn.defineXML(diskless_domain_xml("vgh-real"))
        out = attach(pt_host, pt_store, libvirtd.uri, "vgh-real", passthrough="0000:01:00.0", tenant="t1")
        slot = out.notes[0].split("guest slot 0000:00:")[1][:2]
        attach(vg_host, vg_store, libvirtd.uri, "vgh-real", profile="A40-8Q")
        dumped = libvirtd.virsh("dumpxml", "--inactive", "vgh-real", check=True).stdout
        view = domxml.parse_domain(dumped)
        assert [str(a) for a in view.pci_sources] == [f"0000:01:00.{f}" for f in range(4)]
        assert len(view.mdev_uuids) == 1
        assert view.metadata.tenant == "t1" and view.metadata.passthrough == [PciAddress.parse("0000:01:00.0")]
        assert view.metadata.vgpus[0].uuid == view.mdev_uuids[0]
        # the qemu driver kept the functions together on the slot vgpuhost chose
        root = etree.fromstring(dumped.encode())
        guest = [h.find("address") for h in root.findall("devices/hostdev[@type='pci']")]
        assert {(g.get("bus"), g.get("slot")) for g in guest} == {("0x00", f"0x{slot}")}
        assert guest[0].get("multifunction") == "on"
        assert (libvirtd.etc_dir / "qemu" / "vgh-real.xml").read_text().count("<hostdev") == 5
        out = detach(pt_host, pt_store, libvirtd.uri, "vgh-real", all=True)
        assert len(out.devices) == 2
        dumped = libvirtd.virsh("dumpxml", "--inactive", "vgh-real", check=True).stdout
        assert "<hostdev" not in dumped and NS not in dumped
    finally:
        try:
            conn.lookupByName("vgh-real").undefine()
        except libvirt.libvirtError:
            pass
        conn.close()


def test_the_shipped_test_node_file_takes_an_attach_from_the_cli(make_host, capsys):
    """README: examples/libvirt/test-node.xml gives the CLI a shut-off domain to attach to."""
    from vgpuhost.cli.main import main as cli
    host = make_host("a40-mdev")
    node = Path(__file__).resolve().parents[1] / "examples" / "libvirt" / "test-node.xml"
    code = cli(["--root", str(host.root), "--connect", f"test://{node}", "--json", "attach", "demo-vm",
                "--profile", "A40-8Q", "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert doc["domain"] == "demo-vm" and doc["dry_run"] and doc["devices"][0]["profile"] == "A40-8Q"
    assert "+      <vgpuhost:vgpu profile=\"A40-8Q\"" in doc["diff"]


def test_a_test_driver_file_that_is_no_node_description_is_one_line_without_its_content(tmp_path, env):
    """libvirt's test driver quotes the file it cannot parse; the refusal names the URI, never the content
    (and a file that is not UTF-8, which the binding fails on with SystemError, is the same refusal)."""
    host, store = env("a40-mdev")
    secret, binary = tmp_path / "secret", tmp_path / "binary.xml"
    secret.write_text("root:s3cr3t-hash:20228:0:99999:7:::\n")
    binary.write_bytes(b"<node>\xff</node>")
    for path in (secret, binary):
        with pytest.raises(HostEnvironmentError) as e:
            attach(host, store, f"test://{path}", "vm1", profile="A40-8Q")
        line = e.value.one_line()
        assert line.startswith(f"cannot connect to libvirt at test://{path}: not a test driver node description")
        assert "s3cr3t" not in line and "node>" not in line


def test_attach_resize_auto_records_the_opt_in_and_keeps_it_across_attaches(lv, env):
    """``attach --resize auto`` (issue 30 item 5): the metadata asks resize="auto" (read back from libvirt);
    a later attach without --resize keeps it; a passthrough with --resize is refused."""
    host, store = env("a40-mdev")
    dom = lv.define("vgh-resize")
    attach(host, store, URI, "vgh-resize", profile="A40-8Q", resize="auto")
    assert meta_of(dom).resize == "auto"
    assert 'resize="auto"' in xml_of(dom)
    with pytest.raises(InputError) as e:
        attach(host, store, URI, "vgh-resize", passthrough="0000:21:00.0", resize="auto")
    assert "--resize applies to vGPUs" in str(e.value)
    with pytest.raises(InputError):
        attach(host, store, URI, "vgh-resize", profile="A40-4Q", resize="always")
    assert meta_of(dom).resize == "auto"
