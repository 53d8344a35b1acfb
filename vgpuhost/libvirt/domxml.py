"""vgpuhost's domain metadata, and a safe reader of libvirt domain XML.

Owns: the metadata format vgpuhost keeps in a domain's ``<metadata>``
(docs/reference/libvirt.md: one top-level element per application namespace), its
strict validation, and reading what the qemu hook and ``attach`` need from a
domain document: name, UUID, the host devices it names (``<hostdev>`` of type
pci and mdev, ``<interface type='hostdev'>``), guest PCI addresses in use.  Must
not: touch files or libvirt; import anything heavy (the qemu hook imports
this module on every GPU domain start, so it uses the stdlib's expat only).

The metadata element (namespace :data:`NS`, prefix :data:`PREFIX`)::

    <vgpuhost:domain xmlns:vgpuhost="https://vgpuhost.dev/xmlns/domain/1"
                     version="1" strategy="best-fit" tenant="team-a" anti-affinity="web" qos="burstable">
      <vgpuhost:vgpu profile="A100-2Q" uuid="4b20d080-1b54-4048-85b3-a6a62d165c01"/>
      <vgpuhost:vgpu profile="L40S-4Q" vf="0000:c1:00.5"/>
      <vgpuhost:passthrough gpu="0000:41:00.0"/>
    </vgpuhost:domain>

- ``vgpu`` with ``uuid``: a classic mdev; the hostdev names that UUID and
  the hook creates the mdev at ``prepare begin`` on a GPU chosen then by the
  domain's ``strategy`` (optionally pinned with ``gpu="BDF"``).
- ``vgpu`` with ``vf``: vendor-specific VFIO (vGPU 17+); the VF is chosen at
  attach time (the hostdev must name it) and the hook sets its vGPU type.
- ``passthrough``: the whole GPU's IOMMU group; the hostdevs are
  ``managed='no'`` and the hook binds the group to vfio-pci.
- ``qos`` (optional): the domain's QoS class (``guaranteed``,
  ``burstable``, ``best-effort``), overriding its tenant's default.
- ``resize`` (optional): ``auto`` asks that each vGPU get the smaller
  profile ``advise`` proposes at the domain's next start (same board and
  series; admission and the tenant's quota still decide; never a running
  VM; docs/guide/domains.md).  A request, not a claim: the metadata is the
  tenant's to write.

OpenStack: the reader also keeps Nova's ``<nova:instance><nova:owner>
<nova:project uuid="...">NAME</nova:project>`` (any namespace version under
``http://openstack.org/xmlns/libvirt/nova/``) as ``DomainView.nova_project``
= ``(NAME, UUID)``, for the operator's optional project -> tenant mapping.

Parsing never expands entities, never loads a DTD or anything from the
network (a document with a DOCTYPE is refused outright: libvirt never
writes one), and caps size and depth.
"""

from __future__ import annotations

import pyexpat as expat     # the C module xml.parsers.expat re-exports (its three package modules: 0.15 ms a hook start)

from ..model.errors import InputError
from ..model.kinds import PlacementStrategy, QosClass
from ..model.values import PciAddress, VgpuProfile, is_name, parse_uuid

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Dict, List, Optional, Tuple
    GuestAddress = Tuple[int, int, int, int]       # (domain, bus, slot, function) on the guest's PCI bus

NS = "https://vgpuhost.dev/xmlns/domain/1"
PREFIX = "vgpuhost"
VERSION = "1"
MAX_XML_BYTES = 4 * 1024 * 1024      # libvirt domain XML is KiB; 4 MiB is generous
MAX_DEPTH = 64
MAX_VGPUS = 16
MAX_PASSTHROUGH = 8
STRATEGIES = PlacementStrategy.OFFERED
DEFAULT_STRATEGY = PlacementStrategy.DEFAULT
QOS_CLASSES = QosClass.ALL
RESIZE_MODES = ("auto",)         # resize="auto": right-sizing at start (absent: the profile as asked)
NOVA_NS = "http://openstack.org/xmlns/libvirt/nova/"          # + version (1.0, 1.1, 1.2)
MAX_NOVA_TEXT = 255

# Names are checked by hand, not with ``re``: the qemu hook reads this module in a new process on every
# domain start, and ``import re`` cost it about 2 ms (see vgpuhost.model.values).
_KEY_CHARS = frozenset("_.:+-")        # tenant, anti-affinity key: ^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}\Z


class VgpuRequest:
    """One ``<vgpuhost:vgpu>``: ``profile`` and exactly one of ``uuid`` (mdev) or ``vf`` (VF BDF).

    ``profile``: a :class:`VgpuProfile`; given as its name (``"A40-8Q"``, as code that builds metadata
    by hand writes it) it is parsed here (InputError when it is not a vGPU type name).
    """

    __slots__ = ("profile", "uuid", "vf", "gpu")

    def __init__(self, profile: "VgpuProfile | str", uuid: Optional[str] = None, vf: Optional[PciAddress] = None,
                 gpu: Optional[PciAddress] = None):
        self.profile: VgpuProfile = VgpuProfile.parse(profile) if isinstance(profile, str) else profile
        self.uuid, self.vf, self.gpu = uuid, vf, gpu

    def __eq__(self, other) -> bool:
        return isinstance(other, VgpuRequest) and self._key() == other._key()

    def _key(self):
        return (self.profile, self.uuid, self.vf, self.gpu)

    def __repr__(self) -> str:
        return f"VgpuRequest(profile={str(self.profile)!r}, uuid={self.uuid!r}, vf={self.vf}, gpu={self.gpu})"

    @property
    def device(self) -> str:
        """The device's name in the host: the mdev UUID or the VF's BDF."""
        return self.uuid if self.uuid else str(self.vf)


class Metadata:
    """What a domain asked vgpuhost for (one per domain; see the module docstring).

    ``strategy``: placement strategy at start; ``tenant``/``anti_affinity``:
    short names (letters, digits, ``_.:+-``, at most 64); ``vgpus``: at most
    16; ``passthrough``: GPU BDFs, at most 8; ``qos``: a QoS class
    overriding the tenant's (None: the tenant's).
    """

    __slots__ = ("strategy", "tenant", "anti_affinity", "vgpus", "passthrough", "qos", "resize")

    def __init__(self, strategy: str = DEFAULT_STRATEGY, tenant: Optional[str] = None,
                 anti_affinity: Optional[str] = None, vgpus: Optional[List[VgpuRequest]] = None,
                 passthrough: Optional[List[PciAddress]] = None, qos: Optional[str] = None,
                 resize: Optional[str] = None):
        self.strategy, self.tenant, self.anti_affinity = strategy, tenant, anti_affinity
        self.vgpus: List[VgpuRequest] = list(vgpus or [])
        self.passthrough: List[PciAddress] = list(passthrough or [])
        self.qos = qos
        self.resize = resize

    def __eq__(self, other) -> bool:
        return isinstance(other, Metadata) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __repr__(self) -> str:
        return ("Metadata(" + ", ".join(f"{a}={getattr(self, a)!r}" for a in self.__slots__) + ")")

    @property
    def empty(self) -> bool:
        return not self.vgpus and not self.passthrough

    def to_xml(self) -> str:
        """The metadata element, namespace declared on it (for ``<metadata>`` and defineXML).

        libvirt's ``setMetadata`` refuses a snippet that declares its prefix;
        :func:`vgpuhost.domain.metadata_for_api` gives the unprefixed form it wants.
        """
        from xml.sax.saxutils import quoteattr   # here, not at the top: it pulls in urllib (~30 ms on the hook path)
        attrs = f' version="{VERSION}" strategy={quoteattr(self.strategy)}'
        if self.tenant:
            attrs += f" tenant={quoteattr(self.tenant)}"
        if self.anti_affinity:
            attrs += f" anti-affinity={quoteattr(self.anti_affinity)}"
        if self.qos:
            attrs += f" qos={quoteattr(self.qos)}"
        if self.resize:
            attrs += f" resize={quoteattr(self.resize)}"
        lines = [f'<{PREFIX}:domain xmlns:{PREFIX}="{NS}"{attrs}>']
        for v in self.vgpus:
            a = f"profile={quoteattr(str(v.profile))}"
            a += f' uuid="{v.uuid}"' if v.uuid else f' vf="{v.vf}"'
            if v.gpu is not None:
                a += f' gpu="{v.gpu}"'
            lines.append(f"  <{PREFIX}:vgpu {a}/>")
        for g in self.passthrough:
            lines.append(f'  <{PREFIX}:passthrough gpu="{g}"/>')
        lines.append(f"</{PREFIX}:domain>")
        return "\n".join(lines) + "\n"

    def validate(self) -> "Metadata":
        """Check every field (as :func:`parse_domain` does); returns self, raises InputError."""
        _check_choice("strategy", self.strategy, STRATEGIES)
        if self.tenant is not None:
            _check_name("tenant", self.tenant)
        if self.anti_affinity is not None:
            _check_name("anti-affinity", self.anti_affinity)
        if self.qos is not None:
            _check_choice("qos", self.qos, QOS_CLASSES)
        if self.resize is not None:
            _check_choice("resize", self.resize, RESIZE_MODES)
        if len(self.vgpus) > MAX_VGPUS:
            raise InputError(f"vgpuhost metadata asks for {len(self.vgpus)} vGPUs; at most {MAX_VGPUS}")
        if len(self.passthrough) > MAX_PASSTHROUGH:
            raise InputError(f"vgpuhost metadata asks for {len(self.passthrough)} pass-through GPUs; "
                             f"at most {MAX_PASSTHROUGH}")
        seen = set()
        for v in self.vgpus:
            if (v.uuid is None) == (v.vf is None):
                raise InputError(f"vgpuhost metadata: vGPU {v.profile} needs exactly one of uuid= or vf=")
            if v.device in seen:
                raise InputError(f"vgpuhost metadata names {v.device} twice")
            seen.add(v.device)
        for g in self.passthrough:
            if str(g) in seen:
                raise InputError(f"vgpuhost metadata names {g} twice")
            seen.add(str(g))
        return self


class Hostdev:
    """One host device the domain names: a ``<hostdev mode='subsystem'>`` of type ``pci`` or ``mdev``, or
    an ``<interface type='hostdev'>`` (an SR-IOV network VF, which libvirt assigns as a PCI hostdev).

    ``kind``: ``pci`` or ``mdev``; ``source``: the host BDF (pci) or
    ``mdev_uuid``; ``managed``: the attribute as written (pci only; absent = False, libvirt's default);
    ``guest``: the guest PCI address when the XML gives one; ``origin``: ``hostdev`` or ``interface``,
    the element that named it.
    """

    __slots__ = ("kind", "managed", "source", "mdev_uuid", "model", "guest", "multifunction", "origin")

    def __init__(self, kind: str, managed: Optional[bool] = None, source: Optional[PciAddress] = None,
                 mdev_uuid: Optional[str] = None, model: Optional[str] = None,
                 guest: Optional[GuestAddress] = None, multifunction: bool = False, origin: str = "hostdev"):
        self.kind, self.managed, self.source, self.mdev_uuid = kind, managed, source, mdev_uuid
        self.model, self.guest, self.multifunction, self.origin = model, guest, multifunction, origin

    @property
    def element(self) -> str:
        """The element as the domain wrote it, for messages: ``<hostdev type='pci'>``, ``<interface type='hostdev'>``."""
        return "<interface type='hostdev'>" if self.origin == "interface" else f"<hostdev type='{self.kind}'>"

    @property
    def device(self) -> str:
        """What it names: the BDF or the mdev UUID ('?' when the XML gives no source address)."""
        return str(self.source) if self.source is not None else (self.mdev_uuid or "?")

    def __repr__(self) -> str:
        return ("Hostdev(" + ", ".join(f"{a}={getattr(self, a)!r}" for a in self.__slots__) + ")")


class DomainView:
    """What vgpuhost reads from a domain document.

    ``metadata`` is None when the domain has no vgpuhost element;
    ``guest_addresses``: every guest PCI address any device claims.
    """

    __slots__ = ("name", "uuid", "id", "metadata", "hostdevs", "guest_addresses", "nova_project")

    def __init__(self):
        self.nova_project: Optional[Tuple[str, Optional[str]]] = None     # (name, UUID) from Nova's metadata
        self.name: Optional[str] = None
        self.uuid: Optional[str] = None
        self.id: Optional[str] = None
        self.metadata: Optional[Metadata] = None
        self.hostdevs: List[Hostdev] = []
        self.guest_addresses: List[GuestAddress] = []

    @property
    def mdev_uuids(self) -> List[str]:
        return [h.mdev_uuid for h in self.hostdevs if h.kind == "mdev" and h.mdev_uuid]

    @property
    def pci_sources(self) -> List[PciAddress]:
        return [h.source for h in self.hostdevs if h.kind == "pci" and h.source is not None]


# ---------------------------------------------------------------------------
# parsing

class _Refused(Exception):
    pass


def parse_domain(data: "bytes | str") -> DomainView:
    """Read a libvirt domain document (``virsh dumpxml``, the hook's stdin).

    Raises InputError with one line for: more than :data:`MAX_XML_BYTES`,
    a DOCTYPE or entity declaration, malformed or truncated XML, nesting
    deeper than :data:`MAX_DEPTH`, a root other than ``<domain>``, a missing
    or invalid ``<uuid>``, a second ``<name>`` or ``<uuid>``, a host device with two source addresses
    or a PCI address number libvirt would not read (numbers are read as libvirt reads them:
    ``0x`` hex, a leading ``0`` octal, else decimal), an invalid mdev UUID, and invalid vgpuhost
    metadata (unknown element or attribute, bad profile/UUID/BDF/strategy, duplicates, over the limits).
    ``hostdevs``: every ``<hostdev mode='subsystem'>`` of type ``pci`` or ``mdev`` and every
    ``<interface type='hostdev'>`` (:class:`Hostdev`), in document order.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > MAX_XML_BYTES:
        raise InputError(f"domain XML is over {MAX_XML_BYTES} bytes; vgpuhost reads at most {MAX_XML_BYTES}",
                         hint="a libvirt domain document is a few KiB: check what fed this input")
    return _Reader().run(data)


def parse_domain_identity(data: "bytes | str") -> DomainView:
    """The domain's ``name``, ``uuid`` and ``id`` only: what ``release end`` needs.

    Release frees what the state store says the domain's UUID holds, so it
    must not depend on the rest of the document (issue 12 #2): vgpuhost's
    metadata may be gone or changed by then (``virsh metadata --live``), even
    to something :func:`parse_domain` refuses.  Everything but the identity
    is skipped unread; the same document-level refusals apply (size, DOCTYPE,
    entities, malformed XML, nesting, root element, missing or invalid
    ``<uuid>``).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) > MAX_XML_BYTES:
        raise InputError(f"domain XML is over {MAX_XML_BYTES} bytes; vgpuhost reads at most {MAX_XML_BYTES}",
                         hint="a libvirt domain document is a few KiB: check what fed this input")
    return _IdentityReader().run(data)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def valid_key(value: object) -> bool:
    """``value`` is a valid tenant or anti-affinity key: letters, digits and ``_.:+-``, starting with a
    letter or digit, at most 64 characters (the rule ``anti-affinity=`` and ``tenant=`` follow)."""
    return isinstance(value, str) and is_name(value, _KEY_CHARS)


def _check_name(what: str, value: str) -> None:
    if not is_name(value, _KEY_CHARS):
        raise InputError(f"vgpuhost metadata: invalid {what} {_show(value)}",
                         hint="letters, digits and _.:+- only, at most 64 characters")


def _check_choice(what: str, value: str, choices) -> None:
    if value not in choices:
        raise InputError(f"vgpuhost metadata: unknown {what} {_show(value)}", hint="one of " + ", ".join(choices))


_DIGITS = {8: frozenset("01234567"), 10: frozenset("0123456789"), 16: frozenset("0123456789abcdefABCDEF")}


def _number(raw: str) -> Optional[int]:
    """``raw`` read as libvirt reads a PCI address attribute (``virStrToLong_uip``: strtoul with base 0):
    leading white space and one ``+`` skipped, ``0x``/``0X`` hex, a leading ``0`` octal, else decimal;
    None for anything else (a sign ``-``, trailing characters, no digits).  The same number libvirt
    reads, so a hostdev cannot name one device to libvirt and another to vgpuhost (``bus='010'`` is 8)."""
    t = raw.lstrip(" \t\n\v\f\r")
    if t.startswith("+"):
        t = t[1:]
    base = 10
    if t[:2] in ("0x", "0X"):
        t, base = t[2:], 16
    elif len(t) > 1 and t[0] == "0":
        t, base = t[1:], 8
    if not t or len(t) > 16 or set(t) - _DIGITS[base]:
        return None
    return int(t, base)


def _hex(attrs: Dict[str, str], key: str, limit: int) -> int:
    raw = attrs.get(key, "0")
    value = _number(raw)
    if value is None:
        raise InputError(f"domain XML: invalid PCI address {key}={_show(raw)}")
    if not 0 <= value <= limit:
        raise InputError(f"domain XML: PCI address {key}={_show(raw)} out of range")
    return value


def _pci(attrs: Dict[str, str]) -> GuestAddress:
    return (_hex(attrs, "domain", 0xFFFF), _hex(attrs, "bus", 0xFF), _hex(attrs, "slot", 0x1F),
            _hex(attrs, "function", 7))


_META_ROOT = f"{NS} domain"
_META_VGPU = f"{NS} vgpu"
_META_PT = f"{NS} passthrough"
_META_ATTRS = {_META_ROOT: {"version", "strategy", "tenant", "anti-affinity", "qos", "resize"},
               _META_VGPU: {"profile", "uuid", "vf", "gpu"}, _META_PT: {"gpu"}}


class _Reader:
    """One pass of expat over the document; collects a DomainView."""

    #: refuse a second ``<name>`` or ``<uuid>``: libvirt reads the first and never writes two, so a
    #: document with two was written by hand to make vgpuhost record another owner than libvirt's domain
    ONE_IDENTITY = True

    def __init__(self):
        self.view = DomainView()
        self.stack: List[str] = []
        self.text: List[str] = []
        self.hostdev: Optional[Hostdev] = None
        self.meta: Optional[Metadata] = None
        self.metas = 0
        self.nova: Optional[List[str]] = None          # text of <nova:project> while inside it
        self.nova_uuid: Optional[str] = None

    def run(self, data: bytes) -> DomainView:
        nul = data.find(b"\0")
        if nul >= 0:
            raise InputError(f"domain XML holds a NUL byte (at offset {nul})",
                             hint="libvirt never writes one; refusing the document")
        p = expat.ParserCreate(namespace_separator=" ")
        p.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        p.StartDoctypeDeclHandler = self._doctype
        p.EntityDeclHandler = self._entity
        p.ExternalEntityRefHandler = self._external
        p.StartElementHandler = self._start
        p.EndElementHandler = self._end
        p.CharacterDataHandler = self._chars
        try:
            p.Parse(data, True)
        except _Refused as e:
            raise InputError(str(e), hint="libvirt never writes these; refusing the document") from None
        except expat.ExpatError as e:
            what = expat.ErrorString(e.code) if e.code else str(e)
            raise InputError(f"domain XML is not well-formed: {what} at line {e.lineno}",
                             hint="pass the complete document (virsh dumpxml NAME)") from None
        v = self.view
        if v.uuid is None:
            raise InputError("domain XML has no <uuid>", hint="pass the complete document (virsh dumpxml NAME)")
        if self.meta is not None:
            v.metadata = self.meta.validate()
        return v

    # --- refusals -----------------------------------------------------------
    def _doctype(self, *args):
        raise _Refused("domain XML has a DOCTYPE")

    def _entity(self, *args):
        raise _Refused("domain XML declares an entity")

    def _external(self, *args):
        raise _Refused("domain XML references an external entity")

    # --- elements -------------------------------------------------------------
    def _depth_checked(self, name: str) -> int:
        """The depth element ``name`` opens at; InputError past MAX_DEPTH or for a root that is not <domain>."""
        depth = len(self.stack)
        if depth >= MAX_DEPTH:
            raise InputError(f"domain XML nests deeper than {MAX_DEPTH} elements")
        if depth == 0 and name != "domain":
            raise InputError(f"not a libvirt domain document (root element <{name.split(' ')[-1]}>)",
                             hint="pass the output of 'virsh dumpxml NAME'")
        return depth

    def _start(self, name: str, attrs: Dict[str, str]) -> None:
        depth = self._depth_checked(name)
        parent = self.stack[-1] if self.stack else ""
        self.stack.append(name)
        self.text = []
        if depth == 0:
            self.view.id = attrs.get("id")
        elif depth == 2 and parent == "metadata" and name == _META_ROOT:
            self._meta_root(attrs)
        elif (depth == 4 and name.startswith(NOVA_NS) and name.endswith(" project")
              and parent.startswith(NOVA_NS) and parent.endswith(" owner")
              and self.stack[2].startswith(NOVA_NS) and self.stack[2].endswith(" instance")
              and self.stack[1] == "metadata" and self.view.nova_project is None):
            self.nova, self.nova_uuid = [], attrs.get("uuid")
        elif name in (_META_VGPU, _META_PT):
            self._meta_child(name, attrs, parent)
        elif name.startswith(NS + " "):
            raise InputError(f"vgpuhost metadata: unknown element <{name.split(' ', 1)[1]}>",
                             hint=f"vgpuhost {VERSION} knows <domain>, <vgpu> and <passthrough>")
        elif depth == 2 and parent == "devices" and name == "hostdev":
            self._hostdev(attrs)
        elif depth == 2 and parent == "devices" and name == "interface" and attrs.get("type") == "hostdev":
            # an SR-IOV VF given to the guest as a NIC: libvirt assigns it as a PCI hostdev
            self.hostdev = Hostdev("pci", managed=attrs.get("managed", "no") == "yes", origin="interface")
        elif parent == "source" and name == "address" and self.hostdev is not None and depth == 4:
            h = self.hostdev
            if h.source is not None or h.mdev_uuid is not None:
                # libvirt reads one; two would let the document name one device to it and another to us
                raise InputError(f"domain XML: a {h.element} names two source addresses",
                                 hint="libvirt writes one per device; pass the document 'virsh dumpxml NAME' prints")
            if h.kind == "mdev":
                h.mdev_uuid = _mdev_uuid(attrs.get("uuid", ""))
            else:
                d, b, s, f = _pci(attrs)
                h.source = PciAddress(d, b, s, f)
        elif name == "address" and attrs.get("type") == "pci" and depth == 3 and self.stack[1] == "devices":
            addr = _pci(attrs)
            self.view.guest_addresses.append(addr)
            if self.hostdev is not None and parent == "hostdev":
                self.hostdev.guest = addr
                self.hostdev.multifunction = attrs.get("multifunction") == "on"

    def _end(self, name: str) -> None:
        depth = len(self.stack) - 1
        if depth == 1 and name in ("name", "uuid"):
            text = "".join(self.text).strip()
            if self.ONE_IDENTITY and getattr(self.view, name) is not None:
                raise InputError(f"domain XML has more than one <{name}>",
                                 hint="libvirt writes one; pass the document 'virsh dumpxml NAME' prints")
            if name == "name":
                self.view.name = text
            else:
                try:
                    self.view.uuid = parse_uuid(text)
                except InputError:
                    raise InputError(f"domain XML has an invalid <uuid> {_show(text)}") from None
        elif depth == 2 and name in ("hostdev", "interface") and self.hostdev is not None:
            self.view.hostdevs.append(self.hostdev)
            self.hostdev = None
        elif depth == 4 and self.nova is not None:
            text = "".join(self.nova).strip()[:MAX_NOVA_TEXT]
            uuid = (self.nova_uuid or "").strip()[:MAX_NOVA_TEXT] or None
            self.view.nova_project = (text, uuid)
            self.nova = None
        self.stack.pop()
        self.text = []

    def _chars(self, data: str) -> None:
        if len(self.stack) == 2:
            self.text.append(data)
        elif self.nova is not None and len(self.stack) == 5:
            self.nova.append(data)

    # --- pieces ---------------------------------------------------------------
    def _hostdev(self, attrs: Dict[str, str]) -> None:
        if attrs.get("mode", "subsystem") != "subsystem" or attrs.get("type") not in ("pci", "mdev"):
            return
        managed = None
        if attrs.get("type") == "pci":
            managed = attrs.get("managed", "no") == "yes"
        self.hostdev = Hostdev(attrs["type"], managed=managed, model=attrs.get("model"))

    def _meta_root(self, attrs: Dict[str, str]) -> None:
        self.metas += 1
        if self.metas > 1:
            raise InputError("domain XML holds two vgpuhost metadata elements")
        _known(_META_ROOT, attrs)
        version = attrs.get("version", VERSION)
        if version != VERSION:
            raise InputError(f"vgpuhost metadata version {_show(version)} is not supported (this vgpuhost "
                             f"reads version {VERSION})", hint="upgrade vgpuhost on this host")
        self.meta = Metadata(strategy=attrs.get("strategy", DEFAULT_STRATEGY), tenant=attrs.get("tenant"),
                             anti_affinity=attrs.get("anti-affinity"), qos=attrs.get("qos"),
                             resize=attrs.get("resize"))

    def _meta_child(self, name: str, attrs: Dict[str, str], parent: str) -> None:
        if parent != _META_ROOT or self.meta is None:
            raise InputError(f"vgpuhost metadata: <{name.split(' ', 1)[1]}> outside <vgpuhost:domain>")
        _known(name, attrs)
        if name == _META_PT:
            if "gpu" not in attrs:
                raise InputError("vgpuhost metadata: <passthrough> without gpu=")
            self.meta.passthrough.append(PciAddress.parse(attrs["gpu"]))
            return
        if "profile" not in attrs:
            raise InputError("vgpuhost metadata: <vgpu> without profile=")
        req = VgpuRequest(_profile(attrs["profile"], self.view.name))
        if "uuid" in attrs:
            req.uuid = _mdev_uuid(attrs["uuid"])
        if "vf" in attrs:
            req.vf = PciAddress.parse(attrs["vf"])
        if "gpu" in attrs:
            req.gpu = PciAddress.parse(attrs["gpu"])
        self.meta.vgpus.append(req)


class _IdentityReader(_Reader):
    """A :class:`_Reader` that keeps only ``<domain id=>``, ``<name>`` and ``<uuid>``.  A repeated one
    is not refused (the last is kept): release must free what the store says, whatever the document."""

    ONE_IDENTITY = False

    def _start(self, name: str, attrs: Dict[str, str]) -> None:
        depth = self._depth_checked(name)
        self.stack.append(name)
        self.text = []
        if depth == 0:
            self.view.id = attrs.get("id")


def _known(element: str, attrs: Dict[str, str]) -> None:
    unknown = sorted(set(attrs) - _META_ATTRS[element])
    if unknown:
        raise InputError(f"vgpuhost metadata: unknown attribute {unknown[0]!r} on <{element.split(' ', 1)[1]}>",
                         hint="allowed: " + ", ".join(sorted(_META_ATTRS[element])))


def _profile(text: str, domain: Optional[str]) -> VgpuProfile:
    """``profile=`` of a ``<vgpuhost:vgpu>`` parsed once, here; InputError in one line naming the domain
    (when its ``<name>`` came first), never the text: whoever may define a domain wrote it."""
    p = VgpuProfile.try_parse(text)
    if p is None:
        whose = f"domain {_show(domain)}" if domain else "the domain"
        raise InputError(f"vgpuhost metadata of {whose}: a <vgpu> profile= is not a vGPU type name",
                         hint="set it to a type 'vgpuhost types' lists (e.g. A40-8Q): 'vgpuhost attach' writes it")
    return p


def _mdev_uuid(text: str) -> str:
    try:
        return parse_uuid(text)
    except InputError:
        raise InputError(f"invalid mdev UUID {_show(text)} in the domain XML",
                         hint="an mdev is named by an 8-4-4-4-12 UUID") from None
