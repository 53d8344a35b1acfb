"""vgpuhost's domain metadata and the safe domain-XML readers (expat in domxml, lxml in domain).

Round trips (examples and hypothesis) and hostile documents: DOCTYPE/XXE,
billion laughs, truncation, deep nesting, oversize, unknown metadata,
path-like values in UUID and BDF fields.  Each hostile document must be
refused with one InputError line, never expanded or followed.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from vgpuhost.libvirt import domain, domxml
from vgpuhost.libvirt.domxml import NS, Metadata, VgpuRequest, parse_domain
from vgpuhost.model.errors import InputError, RefusedError
from vgpuhost.model.values import PciAddress, VgpuProfile

DOM_UUID = "6695eb01-f6a4-8304-79aa-97f2502e193f"
U1 = "4b20d080-1b54-4048-85b3-a6a62d165c01"


def doc(metadata: str = "", devices: str = "", *, head: str = "") -> str:
    return (f"{head}<domain type='kvm'><name>vm1</name><uuid>{DOM_UUID}</uuid>"
            f"<metadata>{metadata}</metadata><devices>{devices}</devices></domain>")


def meta_xml(inner: str = "", attrs: str = 'version="1" strategy="first-fit"') -> str:
    return f'<vgpuhost:domain xmlns:vgpuhost="{NS}" {attrs}>{inner}</vgpuhost:domain>'


# --- round trips -----------------------------------------------------------------

def test_readme_example_round_trips():
    m = Metadata("best-fit", "team-a", "web",
                 [VgpuRequest("A100-2Q", uuid=U1), VgpuRequest("L40S-4Q", vf=PciAddress.parse("0000:c1:00.5")),
                  VgpuRequest("A40-8Q", uuid="2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a",
                              gpu=PciAddress.parse("0000:81:00.0"))],
                 [PciAddress.parse("0000:41:00.0")])
    v = parse_domain(doc(m.to_xml()))
    assert v.metadata == m and v.uuid == DOM_UUID and v.name == "vm1"


def test_no_metadata_reads_as_none_and_other_namespaces_are_ignored():
    v = parse_domain(doc('<app:x xmlns:app="https://example.org/app/1" a="1"><app:y/></app:x>'))
    assert v.metadata is None


def test_domain_doc_set_metadata_replaces_and_removes():
    d = domain.DomainDoc.parse(doc(meta_xml('<vgpuhost:passthrough gpu="0000:41:00.0"/>')))
    m = Metadata("spread", vgpus=[VgpuRequest("A40-8Q", uuid=U1)])
    d.set_metadata(m)
    again = parse_domain(d.to_xml())
    assert again.metadata == m
    assert len(etree.fromstring(d.to_xml().encode()).findall(f"metadata/{{{NS}}}domain")) == 1
    d.set_metadata(Metadata())                      # empty: the element (and an empty <metadata>) goes
    assert parse_domain(d.to_xml()).metadata is None and "<metadata" not in d.to_xml()


def test_set_metadata_creates_metadata_after_uuid():
    d = domain.DomainDoc.parse(f"<domain type='kvm'><name>a</name><uuid>{DOM_UUID}</uuid><devices/></domain>")
    d.set_metadata(Metadata(passthrough=[PciAddress.parse("0000:41:00.0")]))
    assert [c.tag for c in d.root][:3] == ["name", "uuid", "metadata"]


_name = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.:+-]{0,20}\Z")
_board = st.from_regex(r"\A[A-Z0-9]{1,12}\Z")      # as VgpuProfile.parse spells a one-word board: upper case
_profile = (st.builds(VgpuProfile, _board, st.integers(0, 192), st.sampled_from("QBAC"))    # time-sliced
            | st.builds(VgpuProfile, _board, st.integers(0, 192), st.sampled_from("QBAC"), st.integers(1, 8),
                        st.booleans()))                                        # MIG-backed (any series), ME
_bdf = st.builds(PciAddress, st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F),
                 st.integers(0, 7))
_uuid = st.uuids().map(str)


@st.composite
def metadata(draw):
    vgpus = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            vgpus.append(VgpuRequest(draw(_profile), uuid=draw(_uuid), gpu=draw(st.none() | _bdf)))
        else:
            vgpus.append(VgpuRequest(draw(_profile), vf=draw(_bdf)))
    pts = draw(st.lists(_bdf, max_size=3, unique=True))
    devices = [v.device for v in vgpus] + [str(p) for p in pts]
    if len(set(devices)) != len(devices):
        from hypothesis import reject
        reject()
    return Metadata(draw(st.sampled_from(domxml.STRATEGIES)), draw(st.none() | _name), draw(st.none() | _name),
                    vgpus, pts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(metadata())
def test_metadata_round_trip_property(m):
    assert parse_domain(doc(m.to_xml())).metadata == m
    d = domain.DomainDoc.parse(doc())
    d.set_metadata(m)
    assert parse_domain(d.to_xml()).metadata == (m if not m.empty else None)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=string.printable + "ü<>&'\"", max_size=40))
def test_tenant_values_never_break_the_document(text):
    """Any text either validates as a tenant and round-trips, or is refused; never injected."""
    m = Metadata(tenant=text, passthrough=[PciAddress.parse("0000:41:00.0")])
    try:
        m.validate()
    except InputError:
        return
    assert parse_domain(doc(m.to_xml())).metadata.tenant == text


# --- hostile documents ---------------------------------------------------------------

XXE = ('<?xml version="1.0"?><!DOCTYPE domain [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
       f"<domain><name>&x;</name><uuid>{DOM_UUID}</uuid></domain>")
LAUGHS = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "lol"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
          '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>'
          f"<domain><name>&d;</name><uuid>{DOM_UUID}</uuid></domain>")
PARAM = ('<?xml version="1.0"?><!DOCTYPE d [<!ENTITY % p SYSTEM "http://203.0.113.1/x.dtd"> %p;]>'
         f"<domain><uuid>{DOM_UUID}</uuid></domain>")

HOSTILE = {
    "xxe": (XXE, "DOCTYPE"),
    "billion-laughs": (LAUGHS, "DOCTYPE"),
    "parameter-entity": (PARAM, "DOCTYPE"),
    "doctype-only": (f"<!DOCTYPE domain><domain><uuid>{DOM_UUID}</uuid></domain>", "DOCTYPE"),
    "truncated": (doc()[:-12], "not well-formed"),
    "empty": ("", "not well-formed"),
    "not-xml": ("{\"domain\": 1}", "not well-formed"),
    "deep": ("<domain>" + "<a>" * 100 + "</a>" * 100 + "</domain>", "nests deeper"),
    "oversize": (doc(devices="<!--" + "x" * (domxml.MAX_XML_BYTES + 10) + "-->"),
                 f"domain XML is over {domxml.MAX_XML_BYTES} bytes; vgpuhost reads at most"),
    "wrong-root": (f"<network><uuid>{DOM_UUID}</uuid></network>", "not a libvirt domain document"),
    "no-uuid": ("<domain><name>x</name></domain>", "has no <uuid>"),
    "bad-uuid": ("<domain><uuid>../../etc</uuid></domain>", "invalid <uuid>"),
    "unknown-attr": (doc(meta_xml('<vgpuhost:passthrough gpu="0000:41:00.0" rom="x"/>')), "unknown attribute 'rom'"),
    "unknown-root-attr": (doc(meta_xml(attrs='version="1" owner="evil"')), "unknown attribute 'owner'"),
    "unknown-element": (doc(meta_xml('<vgpuhost:script>rm</vgpuhost:script>')), "unknown element <script>"),
    "future-version": (doc(meta_xml(attrs='version="2"')), "version '2' is not supported"),
    "bad-strategy": (doc(meta_xml(attrs='strategy="random"')), "unknown strategy"),
    "traversal-uuid": (doc(meta_xml('<vgpuhost:vgpu profile="A40-8Q" uuid="../../../sys/x"/>')), "invalid mdev UUID"),
    "traversal-vf": (doc(meta_xml('<vgpuhost:vgpu profile="L40S-4Q" vf="../0000:21:00.4"/>')), "invalid PCI address"),
    "traversal-gpu": (doc(meta_xml('<vgpuhost:passthrough gpu="0000:41:00.0/../../x"/>')), "invalid PCI address"),
    "traversal-profile": (doc(meta_xml('<vgpuhost:vgpu profile="../../A40" uuid="' + U1 + '"/>')),
                          "profile= is not a vGPU type name"),
    "vgpu-both-ids": (doc(meta_xml(f'<vgpuhost:vgpu profile="A40-8Q" uuid="{U1}" vf="0000:21:00.4"/>')),
                      "exactly one of uuid= or vf="),
    "vgpu-no-id": (doc(meta_xml('<vgpuhost:vgpu profile="A40-8Q"/>')), "exactly one of uuid= or vf="),
    "duplicate": (doc(meta_xml('<vgpuhost:passthrough gpu="0000:41:00.0"/>' * 2)), "names 0000:41:00.0 twice"),
    "two-elements": (doc(meta_xml() + meta_xml()), "two vgpuhost metadata elements"),
    "too-many": (doc(meta_xml("".join(f'<vgpuhost:passthrough gpu="0000:{b:02x}:00.0"/>' for b in range(9)))),
                 "at most 8"),
    "tenant-newline": (doc(meta_xml(attrs='tenant="a&#10;b"')), "invalid tenant"),
    "mdev-hostdev-uuid": (doc(devices='<hostdev mode="subsystem" type="mdev" model="vfio-pci"><source>'
                                      '<address uuid="../../x"/></source></hostdev>'), "invalid mdev UUID"),
    "pci-address-range": (doc(devices='<hostdev mode="subsystem" type="pci"><source><address domain="0x0" '
                                      'bus="0x100" slot="0x0" function="0x0"/></source></hostdev>'), "out of range"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_documents_are_refused_in_one_line(case):
    data, text = HOSTILE[case]
    for reader in (parse_domain, domain.DomainDoc.parse):
        with pytest.raises(InputError) as err:
            reader(data)
        line = err.value.one_line()
        assert text in line, line
        assert "\n" not in line and len(line) < 400 and "root:" not in line


@pytest.mark.parametrize("name", ["custom.profile", "A40-8X", "A40-Ada-1-8Q", "A40-8Q\n<x>", "a" * 300, ""])
def test_a_profile_that_is_no_vgpu_type_name_is_refused_in_one_line_naming_the_domain(name):
    """The metadata's ``profile=`` is parsed once into a VgpuProfile where the XML is read: a name
    VgpuProfile refuses is refused there, in one line naming the domain and what to do, the text not echoed."""
    from xml.sax.saxutils import quoteattr
    data = doc(meta_xml(f'<vgpuhost:vgpu profile={quoteattr(name)} uuid="{U1}"/>'))
    for reader in (parse_domain, domain.DomainDoc.parse):
        with pytest.raises(InputError) as err:
            reader(data)
        line = err.value.one_line()
        assert "domain 'vm1'" in line and "vgpuhost types" in line, line
        assert "\n" not in line and (not name or name not in line)
    with pytest.raises(InputError):
        VgpuRequest(name, uuid=U1)


def test_parsed_metadata_carries_the_profile_as_a_value():
    view = parse_domain(doc(meta_xml(f'<vgpuhost:vgpu profile="a100-1-5cme" uuid="{U1}"/>')))
    (v,) = view.metadata.vgpus
    assert v.profile == VgpuProfile("A100", 5, "C", 1, True) and str(v.profile) == "A100-1-5CME"
    assert 'profile="A100-1-5CME"' in view.metadata.to_xml()


def test_lxml_parser_never_resolves_entities_or_fetches():
    """Even fed straight to domain's lxml parser (bypassing domxml), an XXE stays unexpanded."""
    root = etree.fromstring(XXE.encode(), domain._parser())
    assert "root:" not in (root.findtext("name") or "")
    laughs = etree.fromstring(LAUGHS.encode(), domain._parser())
    assert "lol" not in (laughs.findtext("name") or "")
    with pytest.raises(etree.XMLSyntaxError):          # huge_tree=False: libxml2's depth limit holds
        etree.fromstring(b"<a>" + b"<b>" * 300000 + b"</b>" * 300000 + b"</a>", domain._parser())


# --- guest PCI slots ----------------------------------------------------------------------

def addr(slot, fn=0, bus=0):
    return f'<address type="pci" domain="0x0000" bus="0x{bus:02x}" slot="0x{slot:02x}" function="0x{fn:x}"/>'


def test_free_guest_slot_skips_used_ones_on_bus_0_only():
    devs = (f"<controller type='pci' index='0' model='pci-root'/><watchdog model='i6300esb'>{addr(0x10)}</watchdog>"
            f"<interface type='network'><source network='default'/>{addr(0x11, 3)}</interface>"
            f"<sound model='ich9'>{addr(0x12, bus=1)}</sound>")
    d = domain.DomainDoc.parse(doc(devices=devs))
    assert d.guest_slots_used() == [0x10, 0x11]
    assert d.free_guest_slot() == 0x12
    with pytest.raises(RefusedError) as err:
        d.require_free_slot(0x11)
    assert "0000:00:11 is taken by <interface network>" in err.value.message
    d.require_free_slot(0x12)


def test_no_free_slot_is_a_refusal():
    devs = "".join(f"<watchdog model='i6300esb'>{addr(s)}</watchdog>" for s in range(0x10, 0x20))
    with pytest.raises(RefusedError) as err:
        domain.DomainDoc.parse(doc(devices=devs)).free_guest_slot()
    assert "--guest-slot" in err.value.one_line()


def test_hostdev_sources_and_ramfb_are_read():
    devs = (domain.render_mdev(U1, display=True, ramfb=True) +
            domain.render_pci(PciAddress.parse("0000:41:00.1"), guest_slot=0x10))
    d = domain.DomainDoc.parse(doc(devices=devs))
    assert domain.describe_hostdevs(d) == [f"mdev {U1}", "pci 0000:41:00.1"]
    assert d.ramfb_devices() == [U1]
    assert d.view.mdev_uuids == [U1] and d.view.pci_sources == [PciAddress.parse("0000:41:00.1")]
    assert d.remove_hostdevs(domain.matches_any([U1.upper()])) == 1
    assert domain.describe_hostdevs(d) == ["pci 0000:41:00.1"]


@pytest.mark.parametrize("twice", ["<uuid>11111111-2222-4333-8444-0000000000a2</uuid>", "<name>other</name>"])
def test_a_second_name_or_uuid_is_refused_at_start_and_read_at_release(twice):
    """libvirt reads the first <uuid> and never writes two: a document with a second one is hand-made to
    have vgpuhost record another owner than libvirt's domain, so prepare refuses it; release, which
    frees what the store says, still reads the identity."""
    xml = ("<domain type='kvm'><name>vm1</name><uuid>11111111-2222-4333-8444-0000000000a1</uuid>"
           f"{twice}<devices/></domain>")
    with pytest.raises(InputError) as e:
        parse_domain(xml)
    element = "uuid" if "uuid" in twice else "name"
    assert e.value.one_line().startswith(f"domain XML has more than one <{element}>")
    assert "0000000000a2" not in e.value.one_line() and "other" not in e.value.one_line()
    assert domxml.parse_domain_identity(xml).uuid is not None
