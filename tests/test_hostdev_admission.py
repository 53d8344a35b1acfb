"""Every GPU device a domain names is admitted or refused (issue 28, findings 3 and 4).

Each case runs ``prepare begin`` through the real hook handler (``vgpuhost.hook.runtime.main``, agent
down) on a simulated host, and asserts the one refusal line, exit 2, that nothing was made, bound or
removed in the simulated sysfs tree (:func:`test_hook.tree`), that the domain is not recorded as
running, and the audit row (path ``(hostdevs)``, result ``refused``).  One case runs through the
installed dispatcher as a real process.  The parser's part (the trust boundary) is tested on hostile
XML, with a property test that reads PCI address numbers exactly as libvirt does (``strtoul``, base 0).
"""

from __future__ import annotations

import ctypes
import io

import pytest
from hypothesis import given, settings, strategies as st

from vgpuhost.cli.main import main as cli_main
from vgpuhost.hook import runtime as hook
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.libvirt import domxml
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
from vgpuhost.model.errors import InputError
from vgpuhost.model.values import PciAddress
from vgpuhost.ops import tenancy
from vgpuhost.ops.devices import allow_path
from vgpuhost.ops.passthrough import prepare as pt_prepare
from vgpuhost.policy import hostdevs as hd
from vgpuhost.model.tenancy import Limits as L

from test_hook import (DOM1, DOM2, GPU_HI, GPU_LO, MDEV1, MDEV2, SATA_DISK, audit, dispatch, domain_xml, driver,
                       install, mdev_hostdev, mdevs, mixed, pci_hostdev, start, stop, store, tree, vf_type)

A = PciAddress.parse
AUDIO_LO = A("0000:41:00.1")                # the A40's HD-audio function, in GPU_LO's IOMMU group
L40S_VF4, L40S_VF5 = A("0000:a1:00.4"), A("0000:a1:00.5")
IGPU = A("0000:00:02.0")                    # Intel iGPU: not a GPU device of vgpuhost's
MDEV3 = "aaaaaaaa-2222-4333-8444-000000000003"
DOM3 = "11111111-2222-4333-8444-000000000003"
NOT_DECLARED = "which vgpuhost's metadata does not declare: a GPU device the domain does not declare would bypass admission"


def one_vgpu(name: str, uuid: str, extra=(), mdev: str = MDEV1, **meta) -> str:
    """A domain declaring one A40-8Q (mdev ``mdev``) plus the hostdevs ``extra`` it does not declare."""
    m = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=mdev)], **meta)
    return domain_xml(name, uuid, m, [mdev_hostdev(mdev), *extra])


def interface_hostdev(bdf) -> str:
    a = A(str(bdf))
    return (f"<interface type='hostdev' managed='yes'><source><address type='pci' domain='0x{a.domain:04x}' "
            f"bus='0x{a.bus:02x}' slot='0x{a.slot:02x}' function='0x{a.function:x}'/></source></interface>")


def hostdev_rows(host) -> list:
    return [r for r in audit(host) if r.path == "(hostdevs)"]


def refused(host, name: str, xml: str, *want: str, before=None) -> str:
    """Start ``xml``: exit 2, one line holding each of ``want``, nothing made (the tree as ``before``),
    the store's running domains and device records as they were, and one more ``(hostdevs)`` row,
    refused, holding the line."""
    before = tree(host) if before is None else before
    rows = len(hostdev_rows(host))
    def held():
        if not (host.state_dir / "state.db").exists():
            return {}, [], []
        s = store(host)
        return (s.active_domains(), sorted((r.id, r.owner) for r in s.vgpu_records()),
                sorted((r.bdf, r.owner) for r in s.passthrough_records()))

    running = held()
    rc, err = start(host, name, xml)
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"vgpuhost: error: domain {name!r}: "), err
    for w in want:
        assert w in err, (w, err)
    assert tree(host) == before
    assert held() == running                      # no domain recorded, no device record made or dropped
    new = hostdev_rows(host)[rows:]
    assert [(r.result, r.operation) for r in new] == [("refused", f"prepare {name}")], new
    assert new[0].value in err and new[0].actor.startswith(f"hook {name}")
    return err


# ---------------------------------------------------------------------------
# finding 3: GPU devices the metadata does not declare

def test_an_undeclared_managed_gpu_beside_a_declared_vgpu_is_refused_before_admission(make_host):
    """3a: one declared A40-8Q and a plain managed='yes' hostdev for a whole A40; the tenant's quota
    allows no passthrough.  Before: exit 0 and libvirt took the GPU.  Now refused, before admission
    (no admission row, no allocation), naming the GPU and the attach that declares it."""
    host = mixed(make_host)
    s = store(host)
    tenancy.add(s, tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=1))))
    xml = one_vgpu("vm", DOM1, [pci_hostdev(GPU_HI, managed=True)])
    err = refused(host, "vm", xml, f"<hostdev type='pci' managed='yes'> names NVIDIA GPU {GPU_HI} (3D controller",
                  NOT_DECLARED, f"'vgpuhost attach vm --passthrough {GPU_HI}'")
    assert mdevs(host) == {} and driver(host, GPU_HI) == "nvidia"
    assert not [r for r in audit(host) if r.path == "(admission)"] and not s.allocation_rows()
    # the same domain without the undeclared hostdev starts
    assert start(host, "vm", one_vgpu("vm", DOM1)) == (0, "") and list(mdevs(host)) == [MDEV1]
    assert "admission:" not in err and "quota" not in err


def test_a_function_in_a_gpus_iommu_group_is_part_of_the_gpu(make_host):
    """The A40's audio function: detaching it takes the GPU's whole group."""
    host = mixed(make_host)
    refused(host, "vm", one_vgpu("vm", DOM1, [pci_hostdev(AUDIO_LO, managed=True)]),
            f"names {AUDIO_LO} (HD audio, 10de:1aef), in the IOMMU group of NVIDIA GPU {GPU_LO}",
            f"--passthrough {GPU_LO}")


def test_a_non_nvidia_function_in_a_gpus_group_is_refused_too(make_host):
    """A SATA controller that shares the GPU's IOMMU group, in a domain with no vgpuhost metadata at all."""
    host = make_host("sata-shared-group")
    xml = domain_xml("vm", DOM1, hostdevs=[pci_hostdev(SATA_DISK, managed=True)])
    err = refused(host, "vm", xml, f"names {SATA_DISK} (SATA controller, 8086:a352), in the IOMMU group of NVIDIA "
                                   "GPU 0000:03:00.0", "goes to a VM only with the whole group")
    assert "--passthrough" not in err         # which host check would refuse here: the group is not viable


def test_an_unmanaged_hostdev_on_a_group_the_operator_bound_is_refused(make_host):
    """3b: 'passthrough prepare' bound the A40 (owner manual); a managed='no' hostdev for it that the
    metadata does not declare is counted nowhere: refused.  Declared, the domain uses it as it is."""
    host = mixed(make_host)
    pt_prepare(host, store(host), GPU_HI)
    assert driver(host, GPU_HI) == "vfio-pci"
    refused(host, "vm", one_vgpu("vm", DOM1, [pci_hostdev(GPU_HI, managed=False)]),
            f"<hostdev type='pci' managed='no'> names NVIDIA GPU {GPU_HI}",
            "bound or made for guests by a manual vgpuhost command (owner 'manual')", NOT_DECLARED)
    assert driver(host, GPU_HI) == "vfio-pci"
    ok = domain_xml("vm", DOM1, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1)], passthrough=[GPU_HI]),
                    [mdev_hostdev(MDEV1), pci_hostdev(GPU_HI)])
    assert start(host, "vm", ok) == (0, "")


def test_an_undeclared_hand_made_vgpu_is_refused(make_host):
    """3c: a tenant at 1/1 adds a second mdev hostdev naming a vGPU made by hand (the kernel's create
    file, no record) or with 'vgpuhost vgpu create' (owner manual): refused, the vGPU left as it is."""
    host = mixed(make_host)
    tenancy.add(store(host), tenancy.Tenant("team", quota=tenancy.Quota(L(vgpus=1))))
    Sysfs(host).write(f"{host.s.mdev_bus}/{GPU_LO}/mdev_supported_types/nvidia-566/create", MDEV2)
    assert cli_main(["--root", str(host.root), "vgpu", "create", "--profile", "A40-8Q", "--gpu", str(GPU_HI),
                     "--uuid", MDEV3]) == 0
    refused(host, "vm", one_vgpu("vm", DOM1, [mdev_hostdev(MDEV2)]),
            f"<hostdev type='mdev'> names vGPU {MDEV2} (on GPU {GPU_LO})", NOT_DECLARED,
            "'vgpuhost attach vm --profile PROFILE'")
    refused(host, "vm", one_vgpu("vm", DOM1, [mdev_hostdev(MDEV3)]),
            f"names vGPU {MDEV3} (A40-8Q on GPU {GPU_HI}), bound or made for guests by a manual vgpuhost command")
    assert set(mdevs(host)) == {MDEV2, MDEV3} and store(host).allocation_rows() == []


def test_devices_another_running_domain_holds_are_refused_by_name(make_host):
    """3d: alpha runs with an mdev, a VF and a passed-through GPU; beta names each in a hostdev its
    metadata does not declare (and one domain with no vgpuhost metadata at all): refused, naming alpha."""
    host = mixed(make_host)
    alpha = domain_xml("alpha", DOM1, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1),
                                                      VgpuRequest("L40S-4Q", vf=L40S_VF4)], passthrough=[GPU_LO]),
                       [mdev_hostdev(MDEV1), pci_hostdev(L40S_VF4), pci_hostdev(GPU_LO), pci_hostdev(AUDIO_LO)])
    assert start(host, "alpha", alpha) == (0, "")
    held = f"held by domain 'alpha' ({DOM1})"
    hint = "each domain needs its own device"
    refused(host, "beta", one_vgpu("beta", DOM2, [mdev_hostdev(MDEV1)], mdev=MDEV2),
            f"names vGPU {MDEV1} (A40-8Q on GPU {GPU_HI}), {held}", hint)
    refused(host, "beta", domain_xml("beta", DOM2, hostdevs=[mdev_hostdev(MDEV1)]), held, hint)
    refused(host, "beta", one_vgpu("beta", DOM2, [pci_hostdev(L40S_VF4)], mdev=MDEV2),
            f"names VF {L40S_VF4}", f"of NVIDIA GPU 0000:a1:00.0, {held}", hint)
    refused(host, "beta", one_vgpu("beta", DOM2, [pci_hostdev(GPU_LO, managed=True)], mdev=MDEV2),
            f"names NVIDIA GPU {GPU_LO}", held, hint)
    assert store(host).active_domains() == {DOM1: "alpha"}
    assert stop(host, "alpha", alpha) == (0, "") and mdevs(host) == {}


def test_an_interface_hostdev_naming_a_gpu_vf_is_refused(make_host):
    """``<interface type='hostdev'>`` names a PCI function as well: an L40S VF there is a GPU device."""
    host = mixed(make_host)
    refused(host, "vm", one_vgpu("vm", DOM1, [interface_hostdev(L40S_VF5)]),
            f"<interface type='hostdev'> names VF {L40S_VF5}", "of NVIDIA GPU 0000:a1:00.0", NOT_DECLARED)
    assert vf_type(host, L40S_VF5) == "0"


def test_non_gpu_hostdevs_pass_untouched(make_host):
    """An Intel iGPU, a USB device, an mdev that does not exist and nobody records: not GPU devices."""
    host = mixed(make_host)
    usb = ("<hostdev mode='subsystem' type='usb' managed='yes'><source><vendor id='0x046d'/>"
           "<product id='0xc52b'/></source></hostdev>")
    xml = one_vgpu("vm", DOM1, [pci_hostdev(IGPU, managed=True), usb, mdev_hostdev(MDEV3)])
    assert start(host, "vm", xml) == (0, "")
    assert list(mdevs(host)) == [MDEV1] and hostdev_rows(host) == []
    assert stop(host, "vm", xml) == (0, "")
    plain = domain_xml("plain", DOM2, hostdevs=[pci_hostdev(IGPU, managed=True), usb])
    assert start(host, "plain", plain) == (0, "") and hostdev_rows(host) == []


def test_a_domain_without_metadata_that_names_a_gpu_is_refused_and_creates_no_store_otherwise(make_host):
    host = mixed(make_host)
    assert start(host, "p", domain_xml("p", DOM1, hostdevs=[mdev_hostdev(MDEV1)])) == (0, "")
    assert not host.state_dir.exists()                    # nothing named a GPU device: no store made
    refused(host, "p", domain_xml("p", DOM1, hostdevs=[pci_hostdev(GPU_HI, managed=True)]),
            f"names NVIDIA GPU {GPU_HI}", f"--passthrough {GPU_HI}")


def test_declared_devices_still_start(make_host):
    """The rule refuses only what is not declared: a passthrough group with its audio function, a VF,
    an mdev, together, start as before."""
    host = mixed(make_host)
    xml = domain_xml("big", DOM1, Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1),
                                                  VgpuRequest("L40S-2Q", vf=L40S_VF5)], passthrough=[GPU_LO]),
                     [pci_hostdev(GPU_LO), pci_hostdev(AUDIO_LO), mdev_hostdev(MDEV1), pci_hostdev(L40S_VF5)])
    assert start(host, "big", xml) == (0, "") and hostdev_rows(host) == []
    assert driver(host, GPU_LO) == "vfio-pci" and list(mdevs(host)) == [MDEV1]


# ---------------------------------------------------------------------------
# finding 4: the allow-list covers devices made in advance

def test_the_allow_list_covers_a_vgpu_made_in_advance(make_host):
    host = mixed(make_host)
    allow = allow_path(host)
    allow.parent.mkdir(parents=True)
    allow.write_text(f"{GPU_HI}\n")
    assert cli_main(["--root", str(host.root), "vgpu", "create", "--profile", "A40-8Q", "--gpu", str(GPU_LO),
                     "--uuid", MDEV1, "--owner", DOM1]) == 0
    assert list(mdevs(host)) == [MDEV1]
    refused(host, "d", one_vgpu("d", DOM1),
            f"vGPU {MDEV1} (A40-8Q on GPU {GPU_LO}) exists already, on GPU {GPU_LO}, which is not in the hook "
            "allow-list", f"only: {GPU_HI}", f"'vgpuhost vgpu remove {MDEV1}'")
    assert list(mdevs(host)) == [MDEV1]                    # left as it is
    # removed, the start places it on the allowed GPU
    assert cli_main(["--root", str(host.root), "vgpu", "remove", MDEV1]) == 0
    assert start(host, "d", one_vgpu("d", DOM1)) == (0, "")
    from test_hook import mdev_gpu
    assert mdev_gpu(host, MDEV1) == GPU_HI


# ---------------------------------------------------------------------------
# through the installed dispatcher, as libvirt runs it

def test_refused_through_the_dispatcher(make_host, tmp_path):
    host = mixed(make_host)
    path = install(host, tmp_path)
    before = tree(host)
    proc = dispatch(path, ["vm", "prepare", "begin", "-"],
                    one_vgpu("vm", DOM1, [pci_hostdev(GPU_HI, managed=True)]).encode())
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and f"names NVIDIA GPU {GPU_HI}" in err, err
    assert tree(host) == before and [r.result for r in hostdev_rows(host)] == ["refused"]


# ---------------------------------------------------------------------------
# the parser: hostile XML

def _doc(devices: str) -> str:
    return (f"<domain type='kvm'><name>x</name><uuid>{DOM3}</uuid><devices>{devices}</devices></domain>")


def test_parser_reads_every_form_that_names_a_device():
    v = parse_domain(_doc(pci_hostdev(GPU_HI, managed=True) + interface_hostdev(L40S_VF4) + mdev_hostdev(MDEV1)
                          + "<interface type='network'><source network='default'/></interface>"
                          + "<hostdev mode='capabilities' type='storage'><source><block>/dev/sdb</block></source>"
                            "</hostdev>"))
    assert [(h.kind, h.device, h.managed, h.origin) for h in v.hostdevs] == [
        ("pci", str(GPU_HI), True, "hostdev"), ("pci", str(L40S_VF4), True, "interface"),
        ("mdev", MDEV1, None, "hostdev")]


@pytest.mark.parametrize("attrs, want", [
    ("domain='0' bus='0401' slot='0' function='0'", "out of range"),      # octal 0401 = 257 to libvirt
    ("domain='0' bus='-1' slot='0' function='0'", "invalid PCI address bus='-1'"),
    ("domain='0' bus='0x81 ' slot='0' function='0'", "invalid PCI address"),
    ("domain='0' bus='0x' slot='0' function='0'", "invalid PCI address"),
    ("domain='0' bus='0x81' slot='0' function='8'", "out of range"),
])
def test_parser_refuses_addresses_libvirt_would_read_otherwise(attrs, want):
    xml = _doc(f"<hostdev mode='subsystem' type='pci'><source><address {attrs}/></source></hostdev>")
    with pytest.raises(InputError, match=want):
        parse_domain(xml)


def test_parser_reads_numbers_as_libvirt_does():
    """``bus='010'`` is octal to libvirt (8): read as 10, the hostdev would name another device to vgpuhost;
    ``bus='0201'`` is the A40 at 0x81 to libvirt, and so to vgpuhost."""
    xml = _doc("<hostdev mode='subsystem' type='pci'><source><address domain='0' bus='010' slot=' +0X1f' "
               "function='07'/></source></hostdev>")
    (h,) = parse_domain(xml).hostdevs
    assert h.source == PciAddress(0, 8, 0x1f, 7)
    xml = _doc("<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0' bus='0201' "
               "slot='0' function='0'/></source></hostdev>")
    assert parse_domain(xml).pci_sources == [GPU_HI]


def test_parser_refuses_a_hostdev_with_two_source_addresses():
    two = (f"<hostdev mode='subsystem' type='pci'><source><address domain='0' bus='0x81' slot='0' function='0'/>"
           f"<address domain='0' bus='0x00' slot='2' function='0'/></source></hostdev>")
    with pytest.raises(InputError, match="names two source addresses"):
        parse_domain(_doc(two))
    with pytest.raises(InputError, match="names two source addresses"):
        parse_domain(_doc(f"<hostdev mode='subsystem' type='mdev'><source><address uuid='{MDEV1}'/>"
                          f"<address uuid='{MDEV2}'/></source></hostdev>"))


_libc = ctypes.CDLL(None)
_libc.strtoul.restype = ctypes.c_ulong
_libc.strtoul.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]


def _strtoul_uip(text: str):
    """libvirt's virStrToLong_uip on ``text``: strtoul base 0, the whole string, no '-'; None if refused."""
    raw = text.encode()
    if b"\0" in raw or b"-" in raw:
        return None
    end = ctypes.c_char_p()
    buf = ctypes.create_string_buffer(raw)
    value = _libc.strtoul(buf, ctypes.byref(end), 0)
    consumed = ctypes.cast(end, ctypes.c_void_p).value - ctypes.addressof(buf)
    if consumed == 0 or consumed != len(raw) or value > 0xFFFFFFFF:
        return None
    return value


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(alphabet=" \t+-0123456789abcdefxX", max_size=8),
                 st.integers(0, 0x1ff).map(lambda n: st.sampled_from([hex(n), oct(n).replace("o", ""), str(n)]))
                 .flatmap(lambda s: s)))
def test_property_address_numbers_match_libvirt(text):
    assert domxml._number(text) == _strtoul_uip(text), text


_SOURCE = st.sampled_from([
    "<address domain='0' bus='0x81' slot='0' function='0'/>", f"<address uuid='{MDEV1}'/>", "<address/>",
    "<address type='pci' bus='0x21' slot='0' function='4'/>", "<vendor id='0x1'/>", "",
])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hostdev", "interface", "hostdev mode='capabilities'"]),
                          st.sampled_from(["pci", "mdev", "usb", "hostdev", "network", ""]),
                          st.sampled_from(["yes", "no", "", "maybe"]),
                          st.lists(_SOURCE, max_size=2)), max_size=4))
def test_property_hostile_hostdevs_parse_or_are_refused_in_one_line(items):
    """Any mix of hostdev-like elements: parsed into typed values, or InputError; never another error,
    and every device parsed names a BDF or a UUID of the right kind."""
    parts = []
    for tag, kind, managed, sources in items:
        el = tag.split()[0]
        parts.append(f"<{tag} type='{kind}' managed='{managed}'><source>{''.join(sources)}</source></{el}>")
    try:
        view = parse_domain(_doc("".join(parts)))
    except InputError as e:
        assert "\n" not in e.one_line()
        return
    for h in view.hostdevs:
        assert h.kind in ("pci", "mdev")
        assert h.mdev_uuid is None if h.kind == "pci" else h.source is None
        assert h.source is None or isinstance(h.source, PciAddress)


def test_policy_classifies_without_io():
    """The pure rule over a hand-built view: an undeclared mdev nobody records and no NVIDIA parent holds
    is no GPU device; recorded, it is."""
    class Rec:
        id, gpu, owner, type_name = MDEV1, str(GPU_HI), "manual", "A40-8Q"

    class Inv:
        devices, groups, mdevs = {}, {}, ()

        def group_of(self, a):
            return None

    view = parse_domain(_doc(mdev_hostdev(MDEV1)))
    facts = dict(declared_pci=frozenset(), allow=None, passthrough_records=(), active_domains={})
    (v,) = hd.classify(Inv(), view, vgpu_records=(), **facts)
    assert v.outcome == hd.NOT_GPU
    (v,) = hd.classify(Inv(), view, vgpu_records=(Rec(),), **facts)
    assert v.outcome == hd.REFUSED and v.gpu == GPU_HI and "owner 'manual'" in v.line


def test_the_dispatcher_hands_a_domain_without_metadata_that_names_a_device_to_the_handler(make_host, tmp_path):
    """No vgpuhost metadata, a GPU named by a hostdev, or by an interface whose type is spelled with a
    character reference: both refused through the installed dispatcher (client or sh), not passed at exit 0.
    A domain naming no host device still starts no Python and leaves no store."""
    host = mixed(make_host)
    for client in (None, "none"):
        path = install(host, tmp_path / str(client), **({"client": client} if client else {}))
        before = tree(host)
        spelled = interface_hostdev(L40S_VF5).replace("type='hostdev'", "type='host&#100;ev'")
        for xml, want in [(domain_xml("p", DOM1, hostdevs=[pci_hostdev(GPU_HI, managed=True)]),
                           f"names NVIDIA GPU {GPU_HI}"),
                          (domain_xml("p", DOM1, hostdevs=[spelled]), f"<interface type='hostdev'> names VF {L40S_VF5}")]:
            proc = dispatch(path, ["p", "prepare", "begin", "-"], xml.encode())
            err = proc.stderr.decode()
            assert proc.returncode == 2 and err.count("\n") == 1 and want in err, (client, err)
            assert tree(host) == before
    n = len(hostdev_rows(host))
    assert n == 4
    proc = dispatch(path, ["p", "prepare", "begin", "-"], domain_xml("p", DOM2).encode())
    assert (proc.returncode, proc.stderr) == (0, b"") and len(hostdev_rows(host)) == n


# ---------------------------------------------------------------------------
# attach: early feedback by the same rule (a note; the hook refuses at start)

def test_attach_warns_of_an_undeclared_gpu_hostdev_the_hook_would_refuse(make_host, tmp_path):
    import libvirt
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.state import StateStore
    from vgpuhost.ops.attach import attach
    h = make_host("l40s-vendor-vfio")
    host = HostRoot(h.root, tmp_path / "state")
    s = StateStore(host.state_dir)
    conn = libvirt.open("test:///default")
    try:
        conn.defineXML("<domain type='test'><name>vgh-undeclared</name><memory>65536</memory><os><type>hvm</type>"
                       f"</os><devices>{pci_hostdev('0000:21:00.0', managed=True)}</devices></domain>")
        out = attach(host, s, "test:///default", "vgh-undeclared", profile="L40S-4Q", dry_run=True)
        (note,) = [n for n in out.notes if n.startswith("the qemu hook refuses every start of vgh-undeclared until")]
        assert ("<hostdev type='pci' managed='yes'> names NVIDIA GPU 0000:21:00.0" in note
                and "--passthrough 0000:21:00.0" in note), note
        assert "\n" not in note and out.devices[0].gpu == "0000:a1:00.0"
        conn.defineXML("<domain type='test'><name>vgh-clean</name><memory>65536</memory><os><type>hvm</type>"
                       "</os><devices/></domain>")
        clean = attach(host, s, "test:///default", "vgh-clean", profile="L40S-4Q", dry_run=True)
        assert not [n for n in clean.notes if n.startswith("the qemu hook refuses")], clean.notes
    finally:
        for name in ("vgh-undeclared", "vgh-clean"):
            try:
                conn.lookupByName(name).undefine()
            except libvirt.libvirtError:
                pass
        conn.close()


# ---------------------------------------------------------------------------
# through the agent: the same ops function, the same refusal

def test_the_agent_refuses_as_the_hook_does(make_host):
    from agentutil import AgentRun
    host = mixed(make_host)
    alpha = one_vgpu("alpha", DOM1)
    with AgentRun(host.root) as agent:
        status, doc = agent.call("POST", "/v1/hook/prepare", {"xml": alpha, "name": "alpha"})
        assert status == 200, doc
        before = tree(host)
        for xml, want in [(one_vgpu("vm", DOM2, [pci_hostdev(GPU_HI, managed=True)], mdev=MDEV2),
                           f"names NVIDIA GPU {GPU_HI}"),
                          (domain_xml("vm", DOM2, hostdevs=[mdev_hostdev(MDEV1)]),
                           f"names vGPU {MDEV1} (A40-8Q on GPU {GPU_LO}), held by domain 'alpha' ({DOM1})")]:
            status, doc = agent.call("POST", "/v1/hook/prepare", {"xml": xml, "name": "vm"})
            err = doc["error"]
            assert status != 200 and err["exit_code"] == 2 and want in err["line"], doc
            assert tree(host) == before
        assert [(r.result, r.operation) for r in hostdev_rows(host)] == [("refused", "prepare vm")] * 2
        assert store(host).active_domains() == {DOM1: "alpha"}
