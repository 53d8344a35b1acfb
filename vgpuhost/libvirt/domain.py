"""libvirt domain XML for vgpuhost's devices: hostdev snippets, and editing a domain document.

Owns: the hostdev form each device kind gets (the one policy module for it,
STYLE.md "no policy in XML classes"), rendering it from the package's
jinja2 templates, and editing a parsed domain document with lxml: adding
and removing hostdevs, replacing vgpuhost's metadata element, choosing a
free guest PCI slot and refusing guest-address collisions.  Must not: talk
to libvirt (that is :mod:`vgpuhost.virt`), touch the host, or define a
second metadata format (:mod:`vgpuhost.domxml` owns it).

Hostdev forms (docs/reference/libvirt.md):

- **PCI passthrough** of a whole GPU: one ``<hostdev type='pci'
  managed='no'>`` per endpoint of the GPU's IOMMU group (the GPU and its
  companions: HD audio, USB, UCSI), as
  :func:`vgpuhost.ops.passthrough.group_endpoints` gives them (the caller passes them in).  ``managed='no'``: the qemu
  hook binds the *whole group* to vfio-pci at ``prepare begin``, with
  vgpuhost's order (GPU first, companions after; release in reverse), its
  blocker checks (boot VGA, nvidia-persistenced, nvidia_drm, vGPUs on the
  GPU) and rollback of a half-bound group, as Proxmox does.  libvirt's
  ``managed='yes'`` would rebind only the listed functions, one by one,
  with none of that; both at once would have two owners racing over one
  device, so vgpuhost never writes ``managed='yes'``.  When the group has
  more than one endpoint the functions share one guest slot, as on the
  host (function numbers kept), with ``multifunction='on'`` on function 0.
- **Classic mdev** vGPU: ``<hostdev type='mdev' model='vfio-pci'>`` naming
  the mdev UUID; ``display='on'`` (needs a ``<graphics>`` device in the
  domain) and ``ramfb='on'`` (needs ``display='on'``; at most one device
  per domain: libvirt refuses a second).
- **Vendor-specific VFIO** (vGPU 17+, MIG-backed vGPUs included): the VF is
  a plain ``<hostdev type='pci' managed='no'>``: it stays on NVIDIA's
  driver, and ``managed='yes'`` fails with EINVAL (docs/reference/hardware.md#vendor-vfio).

Parsing uses lxml with a hardened parser (no entities resolved, no DTD, no
network, no huge trees) after :func:`vgpuhost.domxml.parse_domain` has
refused DOCTYPEs, oversize and over-deep documents.
"""

from __future__ import annotations

import copy
import difflib
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from lxml import etree

from ..model.errors import InputError, RefusedError
from ..model.values import PciAddress, parse_uuid
from . import domxml
from .templating import render as render_template

FIRST_GUEST_SLOT = 0x10        # where vgpuhost starts looking for a free slot on guest bus 0
LAST_GUEST_SLOT = 0x1F
GUEST_SLOTS = range(1, LAST_GUEST_SLOT + 1)   # slot 0 of bus 0 is the host bridge

NIL_UUID = "00000000-0000-0000-0000-000000000000"   # RFC 9562 nil UUID: names no device

TEMPLATE_PCI = "hostdev-pci.xml.j2"
TEMPLATE_MDEV = "hostdev-mdev.xml.j2"


def _parser() -> etree.XMLParser:
    return etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False,
                           remove_blank_text=True, dtd_validation=False, collect_ids=False)


# ---------------------------------------------------------------------------
# rendering (pure)

def _guest(slot: Optional[int], function: int, multifunction: bool) -> Optional[dict]:
    if slot is None:
        return None
    return {"domain": 0, "bus": 0, "slot": slot, "function": function, "multifunction": multifunction}


def check_guest_slot(slot: int) -> int:
    """A guest slot on bus 0 (1..0x1f); raises InputError."""
    if not isinstance(slot, int) or isinstance(slot, bool) or slot not in GUEST_SLOTS:
        shown = f"{slot:#04x}" if isinstance(slot, int) and not isinstance(slot, bool) else repr(slot)
        raise InputError(f"guest PCI slot {shown} is out of range",
                         hint=f"a slot on guest bus 0 from 0x01 to {LAST_GUEST_SLOT:#04x}, e.g. 0x10")
    return slot


def render_pci(address: PciAddress, *, guest_slot: Optional[int] = None, multifunction: bool = False,
               function: Optional[int] = None) -> str:
    """One ``<hostdev type='pci' managed='no'>`` for host function ``address``.

    ``guest_slot``: put it at ``0000:00:<slot>.<function>`` in the guest
    (``function`` defaults to the host function number).
    """
    if guest_slot is not None:
        check_guest_slot(guest_slot)
    fn = address.function if function is None else function
    return render_template(TEMPLATE_PCI, address=address, managed=False, rom_bar=None,
                           guest_address=_guest(guest_slot, fn, multifunction))


def render_passthrough(endpoints, guest_slot: Optional[int] = None) -> str:
    """Hostdevs for the endpoints of a GPU's IOMMU group, in the order given (GPU first), ``managed='no'``.

    ``endpoints``: the group's endpoints in bind order (``PciDevice`` values,
    as :func:`vgpuhost.ops.passthrough.group_endpoints` returns them: it
    decides which group may be passed through; this module only writes XML).
    With ``guest_slot`` all functions go to that guest slot on bus 0 with
    their host function numbers, ``multifunction='on'`` on function 0 when
    there is more than one.  Raises InputError for a guest slot out of range.
    """
    addrs = passthrough_functions(endpoints)
    multi = len(addrs) > 1
    return "".join(render_pci(a, guest_slot=guest_slot, multifunction=multi and a.function == 0)
                   for a in addrs)


def passthrough_functions(endpoints) -> List[PciAddress]:
    """The endpoints' addresses, GPU first then by function (the bind order of group_endpoints)."""
    return [d.address for d in endpoints]


def render_mdev(uuid: str, display: bool = False, ramfb: bool = False, guest_slot: Optional[int] = None) -> str:
    """A classic mdev ``<hostdev type='mdev' model='vfio-pci'>`` for mdev ``uuid``.

    ``guest_slot``: put it at guest ``0000:00:<slot>.0``.  Raises InputError
    for an invalid UUID and for ``ramfb`` without ``display`` (QEMU's
    vfio-pci shows a ramfb only with display=on).
    """
    uuid = parse_uuid(uuid)
    if uuid == NIL_UUID:
        raise InputError(f"the nil UUID {uuid} cannot name an mdev",
                         hint="leave --uuid out for a new one, or give a real UUID")
    if ramfb and not display:
        raise InputError("--ramfb needs --display (QEMU's vfio-pci shows a ramfb only with display=on)",
                         hint="add --display, or drop --ramfb")
    if guest_slot is not None:
        check_guest_slot(guest_slot)
    return render_template(TEMPLATE_MDEV, uuid=uuid, display=bool(display), ramfb=bool(ramfb),
                           guest_address=_guest(guest_slot, 0, False))


def render_vf(vf: PciAddress, guest_slot: Optional[int] = None) -> str:
    """A vendor-VFIO VF (vGPU 17+) as ``<hostdev type='pci' managed='no'>`` (docs/reference/hardware.md#vendor-vfio)."""
    return render_pci(vf, guest_slot=guest_slot)


def wrap_in_domain(snippet: str, *, name: str = "vgpuhost-render", graphics: bool = True) -> str:
    """A minimal valid domain document holding ``snippet`` in ``<devices>`` (for schema checks)."""
    gfx = "<graphics type='vnc' port='-1'/>" if graphics else ""
    return (f"<domain type='kvm'><name>{name}</name><memory unit='KiB'>65536</memory>"
            f"<os><type arch='x86_64'>hvm</type></os><devices>{gfx}{snippet}</devices></domain>")


# ---------------------------------------------------------------------------
# editing a domain document

class DomainDoc:
    """A parsed domain document (lxml) with the edits attach/detach make.

    Build with :meth:`parse`; ``view`` is the :class:`~vgpuhost.domxml.DomainView`
    read from the same bytes (metadata validated).  Every edit is in memory;
    :meth:`to_xml` gives the document to define.
    """

    def __init__(self, root: etree._Element, view: domxml.DomainView):
        self.root = root
        self.view = view

    @classmethod
    def parse(cls, xml: "str | bytes") -> "DomainDoc":
        """Raises InputError for anything :func:`vgpuhost.domxml.parse_domain` refuses."""
        data = xml.encode("utf-8") if isinstance(xml, str) else xml
        view = domxml.parse_domain(data)         # refuses DOCTYPE, entities, oversize, deep nesting
        try:
            root = etree.fromstring(data, _parser())
        except etree.XMLSyntaxError as e:        # pragma: no cover - domxml refused it already
            raise InputError(f"domain XML is not well-formed: {e}") from None
        return cls(root, view)

    # --- reading ---------------------------------------------------------------
    @property
    def devices(self) -> etree._Element:
        devs = self.root.find("devices")
        if devs is None:
            devs = etree.SubElement(self.root, "devices")
        return devs

    def hostdevs(self) -> List[etree._Element]:
        return [h for h in self.root.findall("devices/hostdev") if h.get("mode", "subsystem") == "subsystem"]

    def graphics_count(self) -> int:
        return len(self.root.findall("devices/graphics"))

    def ramfb_devices(self) -> List[str]:
        """mdev UUIDs whose hostdev has ``ramfb='on'``."""
        out = []
        for h in self.hostdevs():
            if h.get("type") == "mdev" and h.get("ramfb") == "on":
                a = h.find("source/address")
                out.append(a.get("uuid", "?") if a is not None else "?")
        return out

    def guest_slots_used(self) -> List[int]:
        """Slots on guest PCI domain 0, bus 0 that any device claims."""
        return sorted({s for (d, b, s, _f) in self.view.guest_addresses if d == 0 and b == 0})

    def guest_address_users(self, slot: int) -> List[str]:
        """What sits at guest ``0000:00:<slot>.*``: one description per device."""
        out = []
        for addr in self.root.iter("address"):
            if addr.get("type") != "pci" or addr.getparent() is None:
                continue
            dev = addr.getparent()
            if dev.getparent() is None or dev.getparent().tag != "devices":
                continue
            try:
                d, b, s = (int(addr.get(k, "0"), 0) for k in ("domain", "bus", "slot"))
            except ValueError:
                continue
            if (d, b, s) == (0, 0, slot):
                kind = dev.get("type") or dev.get("model") or ""
                out.append(f"<{dev.tag}{' ' + kind if kind else ''}>")
        return out

    def free_guest_slot(self, start: int = FIRST_GUEST_SLOT) -> int:
        """The first slot on guest bus 0 from ``start`` no device claims; raises RefusedError."""
        used = set(self.guest_slots_used())
        for s in range(start, LAST_GUEST_SLOT + 1):
            if s not in used:
                return s
        raise RefusedError(f"no free guest PCI slot on bus 0 from {start:#04x} to {LAST_GUEST_SLOT:#04x}",
                           hint="pass --guest-slot with a free slot ('virsh dumpxml' shows the ones in use)")

    def require_free_slot(self, slot: int) -> None:
        """Refuse (RefusedError) when any device sits at guest ``0000:00:<slot>``."""
        check_guest_slot(slot)
        users = self.guest_address_users(slot)
        if users:
            raise RefusedError(f"guest PCI slot 0000:00:{slot:02x} is taken by {', '.join(users)}",
                               hint="pick another --guest-slot, or leave it out to let vgpuhost choose")

    # --- editing ---------------------------------------------------------------
    def add_hostdevs(self, snippet: str) -> List[etree._Element]:
        """Append the ``<hostdev>`` elements of ``snippet`` to ``<devices>``; returns them."""
        frag = etree.fromstring(f"<x>{snippet}</x>".encode("utf-8"), _parser())
        added = []
        for el in list(frag):
            if el.tag != "hostdev":            # pragma: no cover - our templates only
                raise InputError(f"not a hostdev: <{el.tag}>")
            self.devices.append(el)
            added.append(el)
        return added

    def remove_hostdevs(self, match: Callable[[etree._Element], bool]) -> int:
        """Remove every subsystem hostdev ``match`` accepts; the number removed."""
        n = 0
        for h in self.hostdevs():
            if match(h):
                h.getparent().remove(h)
                n += 1
        return n

    def set_metadata(self, meta: Optional[domxml.Metadata]) -> None:
        """Replace vgpuhost's ``<metadata>`` element (``None`` or an empty one: remove it)."""
        md = self.root.find("metadata")
        if md is not None:
            for old in md.findall(f"{{{domxml.NS}}}domain"):
                md.remove(old)
        if meta is None or meta.empty:
            if md is not None and len(md) == 0:
                self.root.remove(md)
            return
        el = etree.fromstring(meta.validate().to_xml().encode("utf-8"), _parser())
        if md is None:
            md = etree.Element("metadata")
            anchor = None
            for tag in ("name", "uuid", "genid", "title", "description"):
                found = self.root.find(tag)
                if found is not None:
                    anchor = found
            if anchor is not None:
                anchor.addnext(md)
            else:
                self.root.insert(0, md)
        md.append(el)

    def to_xml(self) -> str:
        return normalise(self.root)


def metadata_for_api(meta: domxml.Metadata) -> str:
    """vgpuhost's element without namespace or prefix, as libvirt's ``setMetadata`` wants it.

    libvirt puts the element and its children in the namespace and prefix
    given beside it; a snippet that declares the prefix itself is refused
    ("failed to create a new XML namespace").
    """
    el = etree.fromstring(meta.validate().to_xml().encode("utf-8"), _parser())
    for e in el.iter():
        e.tag = etree.QName(e).localname
    etree.cleanup_namespaces(el)
    return etree.tostring(el, encoding="unicode")


def normalise(doc: "etree._Element | str | bytes") -> str:
    """A document re-serialised with two-space indentation (comparable, diffable)."""
    if not isinstance(doc, etree._Element):
        data = doc.encode("utf-8") if isinstance(doc, str) else doc
        doc = etree.fromstring(data, _parser())
    root = copy.deepcopy(doc)
    etree.indent(root, space="  ")
    return etree.tostring(root, encoding="unicode") + "\n"


def diff(before: str, after: str, name: str = "domain") -> str:
    """A unified diff of two domain documents, both normalised first."""
    a = normalise(before).splitlines(keepends=True)
    b = normalise(after).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"{name} (now)", f"{name} (after)"))


# ---------------------------------------------------------------------------
# matching hostdevs

def hostdev_source(h: etree._Element) -> Tuple[str, Optional[str]]:
    """``('pci', 'dddd:bb:ss.f')``, ``('mdev', uuid)`` or ``(type, None)`` for one hostdev element."""
    kind = h.get("type", "")
    a = h.find("source/address")
    if a is None:
        return kind, None
    if kind == "mdev":
        return kind, (a.get("uuid") or "").lower() or None
    if kind == "pci":
        try:
            return kind, str(PciAddress(*(int(a.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function"))))
        except (ValueError, TypeError):
            return kind, None
    return kind, None


def matches_any(sources: Iterable[str]) -> Callable[[etree._Element], bool]:
    """A hostdev matcher for mdev UUIDs / PCI BDFs in ``sources``."""
    wanted = {s.lower() for s in sources}
    return lambda h: hostdev_source(h)[1] in wanted


def describe_hostdevs(doc: DomainDoc) -> Sequence[str]:
    return [f"{k} {s}" for k, s in (hostdev_source(h) for h in doc.hostdevs()) if s]
