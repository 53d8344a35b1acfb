"""attach / detach: give a libvirt domain a GPU, a vGPU or a VF, and take it back.

Owns: checking a request against this host's inventory, the state store and
every defined domain; building the new persistent definition (hostdevs and
vgpuhost's metadata element together) and defining it in ONE libvirt call,
so a domain is never half-changed; the refusals; choosing the VF of a
vendor-VFIO vGPU at attach time; the audit rows.  Must not: import libvirt
(:mod:`vgpuhost.virt` does), spell XML by hand (:mod:`vgpuhost.domain` and
:mod:`vgpuhost.domxml` do), or write sysfs except through vgpu/passthrough.

What is decided when (the qemu hook does the rest at ``prepare begin``):

- passthrough: the GPU's whole IOMMU group goes in as ``managed='no'``
  hostdevs; the hook binds the group (vgpuhost.domain explains why).
- classic mdev: the mdev UUID is chosen now (uuid4) and written in the
  hostdev and the metadata; the hook creates the mdev at start, on a GPU
  chosen then by the domain's strategy (or the ``--gpu`` pin).
- vendor-specific VFIO (vGPU 17+, MIG-backed included): the hostdev must
  name a VF, so the VF is chosen now by placement over free VFs, excluding
  VFs any defined domain already names, VFs with a vGPU type set, and GPUs
  any defined domain passes through (:func:`passed_through`: vgpuhost's
  metadata, or a hostdev naming a function of the GPU's slot or IOMMU
  group, hand-written ones included); the hook sets the VF's vGPU type at
  start.

Refusals (RefusedError, exit 2) leave the definition byte-for-byte as it
was: the same device twice; a GPU another domain holds (a vGPU is never
placed on a GPU a defined domain passes through); two vGPUs on one
physical GPU in one domain (pinned, or VFs of one PF), or more vGPUs than
GPUs that offer them (one vGPU per VM per physical GPU, docs/reference/hardware.md#field-lessons);
a taken guest slot; a second ramfb; display without graphics; a running
domain (``--live`` is supported for classic mdev only: the mdev is created
now and hot-plugged; a passthrough group or a VF must be prepared before
qemu starts, so those need the domain stopped).
"""

from __future__ import annotations

import uuid as _uuid
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple

from lxml import etree

from ..io import virt
from ..io.hostroot import HostRoot
from ..io.locks import file_lock
from ..io.process import actor as actor_name
from ..io.state import StateStore, utcnow
from ..io.sysfs import Sysfs
from ..libvirt import domxml
from ..libvirt.domain import (
    DomainDoc, check_guest_slot, diff, matches_any, metadata_for_api, render_mdev, render_passthrough, render_vf
)
from ..model.errors import DeviceError, InputError, RefusedError, VgpuhostError
from ..model.kinds import Backend, Owner
from ..model.values import PciAddress, VgpuProfile, json_flag, json_text, parse_device_id, parse_uuid
from ..observe.inventory import BACKEND_MDEV, Inventory, discover
from ..policy import hostdevs
from ..policy.iommu import group_endpoints, sriov_blockers
from ..policy.offers import offers, resolve_profile, seen_rows
from ..policy.placement import OFFERED, Request, place
from .devices import load_allow
from .health import in_service
from .passthrough import release
from .tenancy import admit_domain, bind, scheduler_policies
from .vgpu import create, remove

KIND_PASSTHROUGH = "passthrough"
KIND_MDEV = Backend.MDEV
KIND_VF = Backend.VENDOR_VFIO
LOCK = "libvirt-domains"        # one lock: VF reservations span every domain

SCHEMA_ATTACH = "vgpuhost.attach/v1"
SCHEMA_DETACH = "vgpuhost.detach/v1"


def passthrough_hostdevs(inv: Inventory, gpu: PciAddress, guest_slot: Optional[int] = None) -> str:
    """The hostdevs that pass ``gpu`` through: every endpoint of its IOMMU group, GPU first, ``managed='no'``.

    With ``guest_slot`` all functions go to that guest slot on bus 0 with
    their host function numbers (``multifunction='on'`` on function 0 when
    there is more than one).  Raises InputError/RefusedError as
    :func:`vgpuhost.ops.passthrough.group_endpoints` does (not a GPU, a VF,
    IOMMU off, a group that is not viable).
    """
    _, endpoints, _ = group_endpoints(inv, gpu)
    return render_passthrough(endpoints, guest_slot)


@dataclass
class DeviceEntry:
    """One device vgpuhost attached: ``kind`` passthrough|mdev|vendor-vfio, ``id`` the GPU BDF,
    mdev UUID or VF BDF, ``functions`` the host PCI functions given to the guest."""

    kind: str
    id: str
    profile: Optional[str] = None
    gpu: Optional[str] = None
    functions: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AttachOutcome:
    """What attach/detach did (or, with ``dry_run``, would do)."""

    action: str                     # attach | detach
    domain: str
    uuid: str
    uri: str
    changed: bool
    dry_run: bool
    live: bool = False
    devices: List[DeviceEntry] = field(default_factory=list)
    hostdevs: str = ""              # the hostdev XML added (attach) or removed (detach)
    metadata: str = ""              # vgpuhost's metadata element after the change ("" = none)
    reason: str = ""                # placement decision (vendor-VFIO VF)
    diff: str = ""                  # unified diff of the persistent definition
    released: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"schema": SCHEMA_ATTACH if self.action == "attach" else SCHEMA_DETACH,
                "action": self.action, "domain": self.domain, "uuid": self.uuid, "uri": self.uri,
                "changed": self.changed, "dry_run": self.dry_run, "live": self.live,
                "devices": [d.as_dict() for d in self.devices], "hostdevs": self.hostdevs,
                "metadata": self.metadata, "reason": self.reason, "diff": self.diff,
                "released": self.released, "notes": self.notes}


# ---------------------------------------------------------------------------
# what other domains hold

@dataclass
class _Other:
    name: str
    uuid: str
    view: domxml.DomainView

    @property
    def meta(self) -> domxml.Metadata:
        return self.view.metadata or domxml.Metadata()


def _others(conn, me_uuid: str) -> List[_Other]:
    out = []
    for d in conn.domains():
        if d.uuid == me_uuid:
            continue
        try:
            view = domxml.parse_domain(d.inactive_xml() if d.is_persistent() else d.live_xml())
        except InputError as e:
            raise RefusedError(f"cannot read what domain {d.name} holds: {e.message}",
                               hint="fix that domain's definition first (virsh edit); nothing was changed") from None
        out.append(_Other(d.name, d.uuid, view))
    return out


def _gpu_functions(inv: Inventory, gpu: PciAddress) -> Set[PciAddress]:
    """The host functions that give ``gpu`` to a guest when a hostdev names one of them: the GPU,
    the other functions of its slot and the endpoints of its IOMMU group.  VFs are left out (a VF
    carries a vGPU: :func:`_reserved_vfs`), and so are bridges."""
    out = {gpu}
    for a, d in inv.devices.items():
        if a.slot_address == gpu.slot_address and not d.is_vf and not d.is_bridge:
            out.add(a)
    group = inv.group_of(gpu)
    for m in (group.members if group is not None else ()):
        d = inv.devices.get(m)
        if d is not None and not d.is_vf and not d.stays_in_group:
            out.add(m)
    return out


def passed_through(inv: Inventory, views: Sequence[Tuple[str, domxml.DomainView]]) -> Dict[PciAddress, str]:
    """``{GPU: domain name}`` of every GPU a defined domain passes through.

    A GPU is passed through when vgpuhost's metadata names it, or when any
    ``<hostdev type='pci'>`` names the GPU or another function of its slot
    or IOMMU group, whoever wrote it (``managed='yes'`` by hand included):
    once that domain starts, the GPU is off NVIDIA's driver and offers no
    vGPUs.  The first view that holds a GPU names it.
    """
    funcs = {g.address: _gpu_functions(inv, g.address) for g in inv.gpus}
    out: Dict[PciAddress, str] = {}
    for name, v in views:
        for g in (v.metadata.passthrough if v.metadata else ()):
            out.setdefault(g, name)
        sources = set(v.pci_sources)
        for g, fs in funcs.items():
            if sources & fs:
                out.setdefault(g, name)
    return out


def _reserved_vfs(views: Sequence[Tuple[str, domxml.DomainView]]) -> Dict[str, str]:
    """``{BDF: domain name}`` of every VF or PCI function a domain names (metadata or hostdev)."""
    out: Dict[str, str] = {}
    for name, v in views:
        for src in v.pci_sources:
            out.setdefault(str(src), name)
        if v.metadata:
            for r in v.metadata.vgpus:
                if r.vf is not None:
                    out.setdefault(str(r.vf), name)
    return out


# ---------------------------------------------------------------------------
# one vGPU per VM per physical GPU

def gpus_offering(inv: Inventory, records, seen, profile: str) -> Set[PciAddress]:
    """GPUs that list, listed (seen rows) or hold (records) vGPU type ``profile``."""
    want = profile.lower()
    out = {t.gpu for t in inv.vgpu_types if t.name.lower() == want}
    out |= {PciAddress.parse(row[0]) for row in seen if str(row[2]).lower() == want}
    out |= {PciAddress.parse(r.gpu) for r in records if r.type_name.lower() == want}
    return {g for g in out if inv.gpu(g) is not None}


def _vf_gpu(inv: Inventory, vf: PciAddress) -> Optional[PciAddress]:
    d = inv.devices.get(vf)
    return d.physfn if d is not None else None


def _candidates(inv: Inventory, records, seen, req: domxml.VgpuRequest,
                excluded: "frozenset[PciAddress] | Set[PciAddress]" = frozenset()) -> Set[PciAddress]:
    """The GPUs ``req`` can sit on: its VF's PF, its pinned GPU, or every GPU offering its type
    except ``excluded`` (GPUs a domain passes through)."""
    if req.vf is not None:
        g = req.gpu or _vf_gpu(inv, req.vf)
        return {g} if g is not None else set()
    if req.gpu is not None:
        return {req.gpu}
    return gpus_offering(inv, records, seen, str(req.profile)) - set(excluded)


def _matching(cands: List[Set[PciAddress]]) -> bool:
    """Whether every vGPU can get its own GPU (bipartite matching, augmenting paths)."""
    owner: Dict[PciAddress, int] = {}

    def assign(i: int, seen: Set[PciAddress]) -> bool:
        for g in sorted(cands[i]):
            if g in seen:
                continue
            seen.add(g)
            if g not in owner or assign(owner[g], seen):
                owner[g] = i
                return True
        return False

    return all(assign(i, set()) for i in range(len(cands)))


def check_one_per_gpu(inv: Inventory, records, seen, domain: str, existing: Sequence[domxml.VgpuRequest],
                      new: domxml.VgpuRequest, excluded: "frozenset[PciAddress] | Set[PciAddress]" = frozenset()
                      ) -> None:
    """Refuse when ``new`` cannot sit on a physical GPU of its own beside ``existing`` (docs/reference/hardware.md#field-lessons).

    ``excluded``: GPUs that defined domains pass through (they offer no vGPUs
    once those start).  Raises RefusedError naming the GPUs.
    """
    mine = _candidates(inv, records, seen, new, excluded)
    if not mine:
        gone = sorted(_candidates(inv, records, seen, new) & set(excluded))
        raise RefusedError(f"every GPU that offers {new.profile} ({', '.join(map(str, gone))}) is "
                           "passed through by a defined domain", hint="detach the passthrough first")
    if len(mine) == 1:
        g = next(iter(mine))
        for r in existing:
            c = _candidates(inv, records, seen, r, excluded)
            if c == {g}:
                raise RefusedError(
                    f"domain {domain} already has vGPU {r.device} ({r.profile}) on GPU {g}: NVIDIA allows one "
                    "vGPU per VM per physical GPU", hint="pin the new vGPU to another GPU (--gpu), or detach "
                    f"{r.device} first")
    # a vGPU whose type no GPU here offers cannot take a GPU here: it does not compete
    cands = [c for c in (_candidates(inv, records, seen, r, excluded) for r in existing) if c] + [mine]
    if not _matching(cands):
        gpus = sorted(set().union(*cands))
        raise RefusedError(
            f"domain {domain} would hold {len(cands)} vGPUs, but the GPUs that offer them ("
            f"{', '.join(map(str, gpus)) or 'none'}) can give it only one each (one vGPU per VM per "
            "physical GPU)", hint="use one larger profile instead, or a host with more GPUs")


# ---------------------------------------------------------------------------
# the request: parsed once, shared by click, the agent's JSON and attach()

#: the JSON body's keys (``POST /v1/domains/{domain}/attach``, openapi.yaml) -> (field, kind, limit):
#: kind ``text`` (a string of at most ``limit`` characters), ``flag`` (true/false) or ``slot`` (a number)
_JSON_FIELDS: Tuple[Tuple[str, str, str, int], ...] = (
    ("profile", "profile", "text", 128), ("passthrough", "passthrough", "text", 32),
    ("gpu", "gpu", "text", 32), ("vgpu_uuid", "uuid", "text", 64), ("tenant", "tenant", "text", 128),
    ("strategy", "strategy", "text", 32), ("anti_affinity", "anti_affinity", "text", 256),
    ("qos", "qos", "text", 32), ("display", "display", "flag", 0), ("ramfb", "ramfb", "flag", 0),
    ("guest_slot", "guest_slot", "slot", 0), ("live", "live", "flag", 0), ("resize", "resize", "text", 16))


@dataclass(frozen=True)
class AttachRequest:
    """What ``vgpuhost attach`` asks for, checked: exactly one of a vGPU (``profile``, or a pooled
    vGPU's ``uuid``) or a whole GPU (``passthrough``).

    ``profile`` is the parsed vGPU type name, ``gpu``/``passthrough`` parsed BDFs, ``uuid`` a lower-case mdev UUID, ``guest_slot`` a slot
    on guest bus 0 (1..0x1f).  Built only by :meth:`parse` (keywords), :meth:`from_options` (click's
    strings) and :meth:`from_json` (the agent's body), which raise InputError with one line.
    """

    profile: Optional[VgpuProfile] = None
    passthrough: Optional[PciAddress] = None
    gpu: Optional[PciAddress] = None
    uuid: Optional[str] = None
    tenant: Optional[str] = None
    strategy: Optional[str] = None
    anti_affinity: Optional[str] = None
    qos: Optional[str] = None
    display: bool = False
    ramfb: bool = False
    guest_slot: Optional[int] = None
    live: bool = False
    resize: Optional[str] = None        # "auto": right-size at each start (the domain's metadata resize=)

    #: the JSON body's keys, in openapi.yaml's order
    JSON_KEYS = tuple(k for k, _, _, _ in _JSON_FIELDS)

    @classmethod
    def parse(cls, *, profile: "Optional[VgpuProfile | str]" = None, passthrough: "Optional[PciAddress | str]" = None,
              gpu: "Optional[PciAddress | str]" = None, uuid: Optional[str] = None, tenant: Optional[str] = None,
              strategy: Optional[str] = None, anti_affinity: Optional[str] = None, qos: Optional[str] = None,
              display: bool = False, ramfb: bool = False, guest_slot: Optional[int] = None,
              live: bool = False, resize: Optional[str] = None) -> "AttachRequest":
        """The request from Python values (names and BDFs as text or parsed); raises InputError on the first
        bad one."""
        if uuid is not None:
            # the pool model: name one existing vGPU a layout pre-created; the hook lends it to the
            # domain at 'prepare begin' and gives it back at 'release end'
            uuid = parse_uuid(uuid)
            if passthrough is not None:
                raise InputError("--uuid names a vGPU; it does not go with --passthrough")
            if live:
                raise InputError("--uuid names a vGPU the hook lends at the domain's start; it does not go with --live")
        elif (profile is None) == (passthrough is None):
            raise InputError("give exactly one of --profile NAME or --passthrough BDF")
        if strategy is not None and strategy not in OFFERED:
            raise InputError(f"unknown placement strategy {strategy!r}", hint="one of " + ", ".join(OFFERED))
        domxml.Metadata(strategy or domxml.DEFAULT_STRATEGY, tenant, anti_affinity, qos=qos, resize=resize).validate()
        if resize is not None and passthrough is not None:
            raise InputError("--resize applies to vGPUs, not to a passed-through GPU", hint="drop --resize")
        if isinstance(passthrough, str):
            passthrough = PciAddress.parse(passthrough)
        if isinstance(gpu, str):
            gpu = PciAddress.parse(gpu)
        if guest_slot is not None:
            check_guest_slot(guest_slot)
        if passthrough is not None:
            if display or ramfb:
                raise InputError("--display and --ramfb apply to classic mdev vGPUs, not to a passed-through GPU")
            if gpu is not None:
                raise InputError("--gpu pins a vGPU; for passthrough name the GPU in --passthrough")
        elif isinstance(profile, str):
            profile = VgpuProfile.parse(profile)
        if ramfb and not display:
            raise InputError("--ramfb needs --display (QEMU's vfio-pci shows a ramfb only with display=on)",
                             hint="add --display, or drop --ramfb")
        if ramfb and live:
            # QEMU makes a ramfb vGPU a 'vfio-pci-nohotplug' device (docs/reference/libvirt.md#display)
            raise InputError("--ramfb cannot go with --live: QEMU's ramfb vGPU is a vfio-pci-nohotplug device, "
                             "which exists only from the domain's start", hint="drop --live and attach it while the "
                                                                              "domain is stopped, or drop --ramfb")
        return cls(profile, passthrough, gpu, uuid, tenant, strategy, anti_affinity, qos, bool(display),
                   bool(ramfb), guest_slot, bool(live), resize)

    @classmethod
    def from_options(cls, *, guest_slot: Optional[str] = None, **options) -> "AttachRequest":
        """The request from click's options (``guest_slot`` hex text, ``0x10``; the others as :meth:`parse`)."""
        return cls.parse(guest_slot=parse_guest_slot(guest_slot), **options)

    @classmethod
    def from_json(cls, body: Optional[Dict[str, object]]) -> "AttachRequest":
        """The request from the agent's JSON body (:data:`JSON_KEYS`; other keys are the route's business).

        Raises InputError naming the first key of the wrong type, then as :meth:`parse`."""
        body = body or {}
        values: Dict[str, object] = {}
        for key, name, kind, limit in _JSON_FIELDS:
            if kind == "flag":
                value = json_flag(key, body.get(key, False))
            elif (value := body.get(key)) is None:
                continue
            elif kind == "slot" and (not isinstance(value, int) or isinstance(value, bool)):
                raise InputError(f"{key!r} must be a whole number (a slot on guest bus 0)")
            elif kind == "text":
                value = json_text(body, key, limit)
            values[name] = value
        return cls.parse(**values)

    def to_json(self) -> Dict[str, object]:
        """The JSON body :meth:`from_json` reads back as this request (the CLI forwards it to the agent)."""
        out: Dict[str, object] = {}
        for key, name, kind, _ in _JSON_FIELDS:
            value = getattr(self, name)
            out[key] = str(value) if isinstance(value, (PciAddress, VgpuProfile)) else value
        return out


def parse_guest_slot(text: Optional[str]) -> Optional[int]:
    """``--guest-slot`` as click gives it (hex text, ``0x10``) -> the slot (1..0x1f), None for None.

    Raises InputError naming the option."""
    if text is None:
        return None
    try:
        value = int(text, 16)
    except ValueError:
        raise InputError(f"invalid --guest-slot {text[:32]!r}", hint="a hex slot on guest bus 0, e.g. 0x10") from None
    return check_guest_slot(value)


# ---------------------------------------------------------------------------
# attach

def backend_of(inv: Inventory, gpus: Set[PciAddress], name: str) -> str:
    """The one vGPU backend (``mdev`` / ``vendor-vfio``) the GPUs offering type ``name`` use.

    Raises RefusedError when none serves it, InputError when both backends do (pin a GPU).
    """
    backends = {inv.gpu(g).vgpu_backend for g in gpus if inv.gpu(g) is not None}
    backends.discard(None)
    if not backends:
        raise RefusedError(f"no GPU here serves {name} as a vGPU now", hint="'vgpuhost host check' says why")
    if len(backends) > 1:
        raise InputError(f"{name} is offered on both classic mdev and vendor-VFIO GPUs here",
                         hint="pin the GPU with --gpu BDF")
    return backends.pop()


def _metadata_with(meta: Optional[domxml.Metadata], *, strategy, tenant, anti_affinity,
                   notes: List[str], qos: Optional[str] = None, resize: Optional[str] = None) -> domxml.Metadata:
    m = domxml.Metadata(meta.strategy, meta.tenant, meta.anti_affinity, list(meta.vgpus),
                        list(meta.passthrough), meta.qos, meta.resize) if meta else domxml.Metadata()
    for attr, value in (("strategy", strategy), ("tenant", tenant), ("anti_affinity", anti_affinity),
                        ("qos", qos), ("resize", resize)):
        if value is not None and getattr(m, attr) != value:
            if meta is not None and getattr(meta, attr) is not None and not meta.empty:
                notes.append(f"{attr.replace('_', '-')} of the domain changes from {getattr(m, attr)} to {value}")
            setattr(m, attr, value)
    return m


def attach(host: HostRoot, store: StateStore, conn_uri: Optional[str], domain: str,
           request: Optional[AttachRequest] = None, *, dry_run: bool = False, actor: Optional[str] = None,
           **options) -> AttachOutcome:
    """Give ``domain`` the vGPU or the GPU ``request`` asks for; one define call.

    ``conn_uri``: libvirt URI (None: ``$LIBVIRT_DEFAULT_URI`` or qemu:///system).
    ``options``: instead of ``request``, its fields as keywords (:meth:`AttachRequest.parse`).
    Admission (issue 13) is asked whether the domain, with the new device,
    would start now: a refusal raises RefusedError before anything changes.
    Raises InputError (bad or unknown input: an unknown profile is refused
    before anything is read from libvirt), RefusedError (see the module
    docstring; nothing changed), HostEnvironmentError (libvirt unreachable),
    DeviceError (a live mdev could not be created or hot-plugged: rolled back).
    """
    if request is None:
        request = AttachRequest.parse(**options)
    elif options:
        raise TypeError(f"attach() takes a request or its fields, not both ({sorted(options)[0]!r})")
    req = _with_pooled(store, request)

    host.require_host()
    # GPUs out of service (unhealthy or cordoned) offer nothing: no VF reserved or vGPU placed there (issue 27)
    found = discover(Sysfs(host))
    inv = in_service(found, store)
    records = store.vgpu_records()
    seen = list(store.seen_types()) + seen_rows(inv)
    kind, name = _device_kind(inv, records, seen, req)

    uri = virt.default_uri(conn_uri)
    lock = nullcontext() if dry_run else file_lock(store.state_dir, LOCK)
    with virt.open_connection(uri) as conn, lock:
        dom = conn.lookup(domain)
        out = AttachOutcome("attach", dom.name, dom.uuid, uri, changed=True, dry_run=dry_run)
        out.live = _live_or_not(dom, req, kind, name, out)

        before = dom.inactive_xml()
        doc = DomainDoc.parse(before)
        meta = _metadata_with(doc.view.metadata, strategy=req.strategy, tenant=req.tenant,
                              anti_affinity=req.anti_affinity, notes=out.notes, qos=req.qos, resize=req.resize)
        scene = _Scene(inv, records, seen, doc, dom.name, dom.uuid, meta, _others(conn, dom.uuid))
        if kind == KIND_PASSTHROUGH:
            snippet, entry = _attach_passthrough(scene, req, out)
        elif kind == KIND_MDEV:
            snippet, entry = _attach_mdev(scene, req, name)
            if req.gpu is not None and req.gpu in inv.out_of_service:
                out.notes.append(f"the qemu hook refuses every start of {dom.name} while {req.gpu} is out of "
                                 f"service ({inv.out_of_service[req.gpu]}): pin another GPU, or repair it and "
                                 f"run 'vgpuhost gpu uncordon {req.gpu}'")
        else:
            snippet, entry = _attach_vf(scene, req, name, out, offers)
        out.devices.append(entry)
        out.hostdevs = snippet
        doc.add_hostdevs(snippet)
        doc.set_metadata(meta)
        after = doc.to_xml()
        out.metadata = meta.to_xml()
        out.diff = diff(before, after, dom.name)
        # the operator's binding (issue 28): --tenant/--qos bind the domain, checked before anything changes
        binding = _binding(store, dom, req, out, actor)
        # early feedback by the hook's rule (issue 28): a GPU device the domain names but does not declare
        # makes the hook refuse each start; attach still makes the change asked for, and says so
        out.notes += undeclared_notes(host, store, inv, domxml.parse_domain(after))
        # early feedback: would the domain be admitted at its next start? (the hook decides with authority)
        # (an mdev vGPU pinned to a GPU out of service was noted above: admission judges the host as it is)
        pinned_out = kind == KIND_MDEV and req.gpu is not None and req.gpu in inv.out_of_service
        admit_domain(store, domxml.parse_domain(after), found if pinned_out else inv, audit=False, binding=binding,
                     policies=lambda gpus: scheduler_policies(host, gpus))
        if not dry_run:
            _define(host, store, dom, conn, after, entry, snippet, meta, out, actor or actor_name())
            if binding is not None:
                bind(store, dom.uuid, binding[1], qos=binding[2], name=dom.name, actor=actor or actor_name())
        return out


def _binding(store: StateStore, dom, req: AttachRequest, out: AttachOutcome, actor: Optional[str]):
    """The binding row ``attach --tenant T [--qos C]`` will record for ``dom`` (``--qos`` alone: the
    domain's binding with that class), checked now (:func:`vgpuhost.ops.tenancy.bind`: an unknown tenant
    or a class stronger than the tenant's raise, nothing changed); None when nothing is bound: neither
    given, ``--qos`` on an unbound domain (its metadata asks), or no tenant declared on this host (tenancy
    not in use: the metadata records the name, a note says it is not bound)."""
    if req.tenant is None and req.qos is None:
        return None
    old = store.binding(dom.uuid)
    tenant = req.tenant if req.tenant is not None else (old[1] if old is not None else None)
    if tenant is None:
        return None
    if req.tenant is not None and not store.tenant_rows():
        out.notes.append(f"tenant {tenant} is not bound: no tenant is declared on this host (the metadata only "
                         f"asks); 'vgpuhost tenant add {tenant}' then 'vgpuhost tenant bind {dom.name} {tenant}'")
        return None
    qos = req.qos if req.qos is not None else (old[2] if old is not None and old[1].lower() == tenant.lower()
                                               else None)
    done = bind(store, dom.uuid, tenant, qos=qos, name=dom.name, dry_run=True)
    if done["changed"]:
        out.notes.append(f"domain {dom.name} {'would be' if out.dry_run else 'is'} bound to tenant {done['tenant']}"
                         + (f" with QoS class {qos}" if qos else "") + " (the state store's binding)")
    return (dom.uuid, done["tenant"], qos, actor or actor_name(), utcnow())


def undeclared_notes(host: HostRoot, store: StateStore, inv: Inventory, view: domxml.DomainView) -> List[str]:
    """One note (``the qemu hook refuses every start of NAME until this is fixed: ...``) per hostdev of ``view`` that the qemu hook's ``prepare begin`` would
    refuse (:func:`vgpuhost.policy.hostdevs.classify`: a GPU device the metadata does not declare, a
    declared vGPU made in advance on a GPU the allow-list leaves out); empty when it would refuse none.
    The allow-list is left out when it cannot be read (the hook then refuses every GPU domain, and
    ``hook status`` says why)."""
    try:
        allow = load_allow(host)
    except VgpuhostError:
        allow = None
    verdicts = hostdevs.classify(inv, view, declared_pci=hostdevs.declared_functions(view, inv), allow=allow,
                                 vgpu_records=store.vgpu_records(), passthrough_records=store.passthrough_records(),
                                 active_domains=store.active_domains())
    return [f"the qemu hook refuses every start of {view.name} until this is fixed: {v.line}; {v.hint}"
            for v in verdicts if v.outcome == hostdevs.REFUSED]


def _with_pooled(store: StateStore, req: AttachRequest) -> AttachRequest:
    """``req`` with the profile and GPU of the pooled vGPU it names (``--uuid``), checked against the
    state store's record; ``req`` itself when it names none.  Raises InputError, RefusedError."""
    if req.uuid is None:
        return req
    uuid = req.uuid
    pooled = next((r for r in store.vgpu_records() if r.id == uuid), None)
    if pooled is None or pooled.backend != BACKEND_MDEV:
        raise InputError(f"no classic mdev vGPU {uuid} recorded by vgpuhost",
                         hint="'vgpuhost vgpu list' shows the vGPUs; a layout's are owned by 'layout'")
    if pooled.owner != Owner.LAYOUT:
        raise RefusedError(f"vGPU {uuid} is owned by {pooled.owner}, not by the layout's pool",
                           hint="--uuid names a vGPU 'vgpuhost apply' pre-created (owner layout)")
    profile = VgpuProfile.parse(pooled.type_name)
    if req.profile is not None and req.profile != profile:
        raise InputError(f"vGPU {uuid} is a {pooled.type_name}, not a {req.profile}",
                         hint=f"leave --profile out, or give --profile {pooled.type_name}")
    if req.gpu is not None and str(req.gpu) != pooled.gpu:
        raise InputError(f"vGPU {uuid} is on {pooled.gpu}, not on {req.gpu}", hint="leave --gpu out")
    return replace(req, profile=profile, gpu=PciAddress.parse(pooled.gpu))


def _device_kind(inv: Inventory, records, seen, req: AttachRequest) -> Tuple[str, Optional[str]]:
    """``(kind, vGPU type name as the devices spell it)`` of what ``req`` asks for on this host
    (name None for passthrough).  Raises InputError (no such GPU or profile), RefusedError."""
    if req.gpu is not None and inv.gpu(req.gpu) is None:
        raise InputError(f"no NVIDIA GPU at {req.gpu}", hint="'vgpuhost gpus' lists them")
    if req.passthrough is not None:
        if inv.gpu(req.passthrough) is None:
            raise InputError(f"no NVIDIA GPU at {req.passthrough}", hint="'vgpuhost gpus' lists them")
        return KIND_PASSTHROUGH, None
    name = resolve_profile(inv, records, str(req.profile), req.gpu, seen)
    offering = gpus_offering(inv, records, seen, name)
    if req.gpu is not None:
        offering &= {req.gpu}
    kind = KIND_MDEV if backend_of(inv, offering, name) == BACKEND_MDEV else KIND_VF
    if kind == KIND_VF and (req.display or req.ramfb):
        raise InputError(f"--display and --ramfb apply to classic mdev vGPUs; {name} is a vendor-VFIO "
                         "vGPU (a PCI VF), whose display NVIDIA's guest driver provides")
    return kind, name


def _live_or_not(dom, req: AttachRequest, kind: str, name: Optional[str], out: AttachOutcome) -> bool:
    """Whether the device is hot-plugged too: ``req.live`` on a running domain.  Raises RefusedError
    for a transient domain, a running one without ``--live``, and ``--live`` for anything but an mdev."""
    if not dom.is_persistent():
        raise RefusedError(f"domain {dom.name} is transient: attach changes the persistent definition",
                           hint="define it first (virsh define), then attach")
    active = dom.is_active()
    if active and not req.live:
        raise RefusedError(f"domain {dom.name} is running: vgpuhost changes the definition of a stopped "
                           "domain", hint="stop it first (virsh shutdown), or pass --live for a classic "
                                          "mdev vGPU")
    if req.live and kind != KIND_MDEV:
        what = "a passed-through GPU" if kind == KIND_PASSTHROUGH else f"a vendor-VFIO vGPU ({name})"
        raise RefusedError(f"--live is supported for classic mdev vGPUs only, not {what}: its device "
                           "must be prepared before qemu starts", hint="stop the domain first")
    if req.live and not active:
        out.notes.append(f"{dom.name} is not running: --live has nothing to hot-plug; the definition changes")
        return False
    return req.live


def _define(host: HostRoot, store: StateStore, dom, conn, after: str, entry: DeviceEntry, snippet: str,
            meta: domxml.Metadata, out: AttachOutcome, act: str) -> None:
    """Hot-plug (``out.live``), define ``after``, read it back, audit.  Raises DeviceError."""
    if out.live:
        _hotplug_mdev(host, store, dom, entry, snippet, meta, act)
    try:
        conn.define(after)
    except VgpuhostError as e:
        if not out.live:
            raise
        raise DeviceError(f"{entry.profile} {entry.id} is plugged into the running {dom.name}, but defining "
                          f"it failed: {e.message}", hint="the vGPU goes when the domain stops (the hook "
                          "releases it by owner); attach it again while the domain is stopped") from e
    _verify(dom, entry, added=True)
    if out.live:
        try:
            dom.set_live_metadata(metadata_for_api(meta), domxml.PREFIX, domxml.NS)
        except VgpuhostError as e:
            out.notes.append(f"the running domain's metadata was not updated ({e.message}); the hook "
                             "still releases the vGPU by owner at stop")
    store.audit(actor=act, operation=f"attach {dom.name}", path="libvirt:defineXML",
                value=f"{dom.uuid} +{entry.kind} {entry.id}" + (f" ({entry.profile})" if entry.profile else ""))


@dataclass(frozen=True)
class _Scene:
    """What one attach has read before it picks the device: the inventory, vgpuhost's vGPU records and the
    types seen (as placement takes them), the domain's document, name and UUID, its metadata (which the
    attach extends), and the other defined domains."""

    inv: Inventory
    records: list
    seen: object
    doc: DomainDoc
    dname: str
    duuid: str
    meta: domxml.Metadata
    others: List[_Other]


def _attach_passthrough(scene: _Scene, req: AttachRequest, out: AttachOutcome) -> Tuple[str, DeviceEntry]:
    """Pass ``req.passthrough`` (a whole GPU and its IOMMU group) through; RefusedError when another domain,
    a vGPU or a blocker holds it."""
    inv, records, seen, doc, dname, meta, others = (scene.inv, scene.records, scene.seen, scene.doc, scene.dname,
                                                    scene.meta, scene.others)
    gpu, guest_slot = req.passthrough, req.guest_slot
    _, endpoints, _ = group_endpoints(inv, gpu)          # not viable / IOMMU off -> RefusedError
    funcs = [d.address for d in endpoints]
    g = inv.gpu(gpu)
    vfs = set(g.vfs)
    if gpu in meta.passthrough:
        raise RefusedError(f"{gpu} is already passed through to {dname}", hint="nothing to do")
    if gpu in inv.out_of_service:       # the hook would refuse every start (docs/guide/failures.md)
        raise RefusedError(f"cannot pass {gpu} through to {dname}: {gpu} is out of service "
                           f"({inv.out_of_service[gpu]})", hint=f"use another GPU, or repair it and run 'vgpuhost "
                           f"gpu uncordon {gpu}'; the domain definition was not changed")
    mine = set(doc.view.pci_sources)
    clash = [a for a in funcs if a in mine]
    if clash:
        raise RefusedError(f"domain {dname} already has a hostdev for {clash[0]} (not attached by vgpuhost)",
                           hint="remove it (virsh detach-device --config) and attach the GPU with vgpuhost")
    for r in meta.vgpus:
        if r.gpu == gpu or (r.vf is not None and r.vf in vfs):
            raise RefusedError(f"domain {dname} already has vGPU {r.device} on {gpu}: a GPU is either passed "
                               "through or shared", hint=f"detach {r.device} first")
    group_funcs = _gpu_functions(inv, gpu)
    for o in others:
        if gpu in o.meta.passthrough:
            raise RefusedError(f"{gpu} is already given to domain {o.name}",
                               hint=f"detach it there first (vgpuhost detach {o.name} {gpu})")
        by_hand = [a for a in o.view.pci_sources if a in group_funcs]
        if by_hand:
            raise RefusedError(f"{gpu} is already given to domain {o.name}: its hostdev for {by_hand[0]} was not "
                               "attached by vgpuhost", hint=f"remove that hostdev from {o.name} first (virsh edit "
                               f"{o.name}, or virsh detach-device {o.name} FILE --config)")
        named = [str(s) for s in o.view.pci_sources if s in vfs]
        named += [str(r.vf) for r in o.meta.vgpus if r.vf is not None and r.vf in vfs]
        named += [r.device for r in o.meta.vgpus if r.gpu == gpu]
        held = list(dict.fromkeys(named))            # a VF is in the metadata and in a hostdev
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            raise RefusedError(f"{gpu} carries vGPUs of domain {o.name} ({', '.join(held[:3])}{more}): a GPU "
                               "is either passed through or shared", hint=f"detach them from {o.name} first")
    views = [(dname, doc.view)] + [(o.name, o.view) for o in others]
    passed = set(passed_through(inv, views)) | set(meta.passthrough) | {gpu}
    # vGPUs whose type no GPU here offers cannot take a GPU here anyway: they do not count
    own = [(r, _candidates(inv, records, seen, r, passed)) for r in meta.vgpus
           if _candidates(inv, records, seen, r)]
    if own and (not all(c for _, c in own) or not _matching([c for _, c in own])):
        stuck = next((r for r, c in own if not c), own[0][0])
        raise RefusedError(f"passing {gpu} through would leave domain {dname}'s vGPU {stuck.device} "
                           f"({stuck.profile}) without a GPU of its own", hint=f"detach {stuck.device} first")
    blocked = sriov_blockers([d for d in endpoints if d.driver != "vfio-pci"])
    if blocked:     # the hook's prepare would refuse it at every start (issue 12 #4c): refuse it now
        raise RefusedError(f"{gpu} cannot be passed through to {dname}: " + "; ".join(blocked),
                           hint="then attach it again; the domain definition was not changed")
    busy = [m.uuid for m in inv.mdevs if m.parent == gpu or m.parent in vfs]
    busy += [str(v.vf) for v in inv.vf_vgpus if v.gpu == gpu and v.type_id]
    if busy:
        out.notes.append(f"{gpu} carries vGPUs now ({', '.join(busy[:4])}): {dname} will not start until they "
                         "are removed")
    if guest_slot is not None:
        doc.require_free_slot(guest_slot)
        slot = guest_slot
    elif len(funcs) > 1:
        slot = doc.free_guest_slot()
    else:
        slot = None
    if len(funcs) > 1:
        out.notes.append(f"IOMMU group of {gpu}: {len(funcs)} functions ({', '.join(map(str, funcs))}) at guest "
                         f"slot 0000:00:{slot:02x}, as on the host; the qemu hook binds them to vfio-pci at start")
    else:
        out.notes.append("the qemu hook binds the GPU to vfio-pci at start (managed='no')")
    meta.passthrough.append(gpu)
    return (render_passthrough(endpoints, slot),
            DeviceEntry(KIND_PASSTHROUGH, str(gpu), gpu=str(gpu), functions=[str(a) for a in funcs]))


def _attach_mdev(scene: _Scene, req: AttachRequest, name: str) -> Tuple[str, DeviceEntry]:
    """A classic mdev vGPU of type ``name`` (a new UUID, or the pool's ``req.uuid``); RefusedError when the
    domain's display, ramfb or GPUs do not allow it."""
    inv, records, seen, doc, dname, meta, others = (scene.inv, scene.records, scene.seen, scene.doc, scene.dname,
                                                    scene.meta, scene.others)
    gpu, display, ramfb, guest_slot, uuid = req.gpu, req.display, req.ramfb, req.guest_slot, req.uuid
    if display and doc.graphics_count() == 0:
        raise RefusedError(f"--display needs a graphics device in domain {dname} (libvirt: display='on' needs "
                           "<graphics>)", hint="add one (virsh edit: <graphics type='vnc'/>), or drop --display")
    if ramfb:
        have = doc.ramfb_devices()
        if have:
            raise RefusedError(f"domain {dname} already has a ramfb on mdev {have[0]}: libvirt allows one "
                               "ramfb device per domain", hint="drop --ramfb")
    passed = passed_through(inv, [(dname, doc.view)] + [(o.name, o.view) for o in others])
    if gpu is not None:
        if passed.get(gpu) == dname:
            raise RefusedError(f"{gpu} is passed through to {dname}: a GPU is either passed through or shared")
        if gpu in passed:
            raise RefusedError(f"{gpu} is passed through to domain {passed[gpu]}: it offers no vGPUs",
                               hint="pin another GPU, or leave --gpu out")
    if uuid is not None:                # a pooled vGPU (--uuid): no other domain may name it
        for o in others:
            if uuid in o.view.mdev_uuids:
                raise RefusedError(f"vGPU {uuid} is attached to domain {o.name} already",
                                   hint="each domain needs its own device: name another of the pool's vGPUs")
        if uuid in doc.view.mdev_uuids:
            raise RefusedError(f"vGPU {uuid} is attached to {dname} already")
    uuid = uuid or str(_uuid.uuid4())
    vgpu = domxml.VgpuRequest(name, uuid=uuid, gpu=gpu)
    check_one_per_gpu(inv, records, seen, dname, meta.vgpus, vgpu, set(passed))
    if guest_slot is not None:
        doc.require_free_slot(guest_slot)
    meta.vgpus.append(vgpu)
    return (render_mdev(uuid, display=display, ramfb=ramfb, guest_slot=guest_slot),
            DeviceEntry(KIND_MDEV, uuid, profile=name, gpu=str(gpu) if gpu else None))


def _attach_vf(scene: _Scene, req: AttachRequest, name: str, out: AttachOutcome,
               offers_fn) -> Tuple[str, DeviceEntry]:
    """A VF of type ``name`` reserved for the domain (vendor VFIO: the hook sets its type at start), placed
    by the metadata's strategy among the VFs no defined domain reserves; RefusedError when none fits."""
    inv, records, seen, doc, dname, duuid, meta, others = (scene.inv, scene.records, scene.seen, scene.doc,
                                                           scene.dname, scene.duuid, scene.meta, scene.others)
    gpu, guest_slot = req.gpu, req.guest_slot
    views = [(dname, doc.view)] + [(o.name, o.view) for o in others]
    reserved = _reserved_vfs(views)
    passed = passed_through(inv, views)         # by vgpuhost or by a hand-written hostdev
    free_now = {v.vf for v in inv.vf_vgpus if not v.type_id}
    mine_on: Set[PciAddress] = set()
    for r in meta.vgpus:
        c = _candidates(inv, records, seen, r)
        if len(c) == 1:
            mine_on |= c
    keys_on: Dict[PciAddress, Set[str]] = {}
    for o in others:
        key = o.meta.anti_affinity
        if not key:
            continue
        for r in o.meta.vgpus:
            c = _candidates(inv, records, seen, r)
            if len(c) == 1:
                keys_on.setdefault(next(iter(c)), set()).add(key)
    adjusted = []
    for o in offers_fn(inv, records, name, seen):
        g = inv.gpu(o.gpu)
        free = tuple(p for p in o.parents if str(p) not in reserved)
        pending = sum(1 for vf in (g.vfs if g else ()) if str(vf) in reserved and vf in free_now)
        avail = max(0, min(o.available - pending, len(free)))
        note = o.note
        if o.gpu in passed:
            avail, free, note = 0, (), f"passed through to domain {passed[o.gpu]}"
        elif o.gpu in inv.out_of_service:
            avail, free, note = 0, (), f"out of service: {inv.out_of_service[o.gpu]}"
        elif o.available > 0 and avail == 0:
            note = f"its free VFs are reserved by defined domains ({pending} pending)"
        owners = o.owners | ({duuid} if o.gpu in mine_on else frozenset())
        adjusted.append(replace(o, parents=free, available=avail, owners=frozenset(owners),
                                keys=frozenset(o.keys | keys_on.get(o.gpu, set())), note=note))
    decision = place(adjusted, Request(name, duuid, meta.strategy, None, meta.anti_affinity, gpu))
    if not decision.admitted:
        raise RefusedError(f"cannot reserve a VF for {name}: {decision.reason}",
                           hint="'vgpuhost types --available' shows what fits; detach a vGPU from a stopped "
                                "domain to free its VF")
    vf = decision.parent
    vgpu = domxml.VgpuRequest(name, vf=vf)
    check_one_per_gpu(inv, records, seen, dname, meta.vgpus, vgpu, set(passed))
    if guest_slot is not None:
        doc.require_free_slot(guest_slot)
    meta.vgpus.append(vgpu)
    out.reason = decision.reason
    out.notes.append(f"VF {vf} of {decision.gpu} is reserved for {dname}; the qemu hook sets its vGPU type at start")
    return render_vf(vf, guest_slot), DeviceEntry(KIND_VF, str(vf), profile=name, gpu=str(decision.gpu))


def _hotplug_mdev(host: HostRoot, store: StateStore, dom, entry: DeviceEntry, snippet: str,
                  meta: domxml.Metadata, actor: str) -> None:
    """Create the mdev now (owner: the domain) and hot-plug it; on failure remove it again."""
    made = create(host, store, profile=entry.profile, gpu=PciAddress.parse(entry.gpu) if entry.gpu else None,
                  uuid=entry.id, strategy=meta.strategy, owner=dom.uuid, anti_affinity=meta.anti_affinity,
                  actor=actor)
    entry.gpu = made.gpu
    try:
        dom.attach_live(snippet, what=f"{entry.profile} vGPU {entry.id}")
    except VgpuhostError as e:
        try:
            remove(host, store, entry.id, owner=dom.uuid, actor=actor, while_running=True)
            undone = "the mdev was removed again"
        except VgpuhostError as e2:
            undone = f"removing the mdev again failed too: {e2.message}"
        # e.message already says "hot-plugging <what> into <domain>: <libvirt's reason>"
        raise DeviceError(f"{e.message}; {undone}; the definition is unchanged",
                          hint="attach it without --live while the domain is stopped") from e
    store.audit(actor=actor, operation=f"attach {dom.name} --live", path="libvirt:attachDeviceFlags",
                value=f"{dom.uuid} +mdev {entry.id}")


def _verify(dom, entry: DeviceEntry, *, added: bool) -> None:
    """Read the definition back: never report a change libvirt did not keep (docs/reference/hardware.md#field-lessons)."""
    v = domxml.parse_domain(dom.inactive_xml())
    names = {str(s) for s in v.pci_sources} | set(v.mdev_uuids)
    meta = v.metadata or domxml.Metadata()
    in_meta = {r.device for r in meta.vgpus} | {str(g) for g in meta.passthrough}
    present = entry.id in in_meta and (entry.id in names or any(f in names for f in entry.functions))
    if present != added:
        raise DeviceError(f"libvirt accepted the definition of {dom.name} but reads back "
                          f"{'without' if added else 'still with'} {entry.kind} {entry.id}",
                          hint="check 'virsh dumpxml --inactive' and the libvirt daemon's log")


# ---------------------------------------------------------------------------
# detach

def _device_id(text: str) -> str:
    return parse_device_id(text, "device", "an mdev UUID, a VF's BDF or a passed-through GPU's BDF (dddd:bb:ss.f)")


def _passthrough_sources(host: HostRoot, doc: DomainDoc, meta: domxml.Metadata, gpu: PciAddress) -> List[str]:
    """The host functions a passed-through ``gpu`` put in the domain: its IOMMU group's endpoints
    when this host knows them, else every PCI hostdev of the GPU's slot except the domain's VFs."""
    vfs = {str(r.vf) for r in meta.vgpus if r.vf is not None}
    try:
        _, endpoints, _ = group_endpoints(discover(Sysfs(host)), gpu)
        return [str(d.address) for d in endpoints]
    except (VgpuhostError, OSError):
        return [str(s) for s in doc.view.pci_sources if s.slot_address == gpu.slot_address and str(s) not in vfs]


def detach(host: HostRoot, store: StateStore, conn_uri: Optional[str], domain: str, *,
           device: Optional[str] = None, all: bool = False, dry_run: bool = False,   # noqa: A002
           actor: Optional[str] = None) -> AttachOutcome:
    """Take ``device`` (mdev UUID, VF BDF or GPU BDF), or ``all`` of vgpuhost's devices, from ``domain``.

    Removes the hostdevs and the metadata entries in one define call, then
    releases what vgpuhost still holds for the domain on this host (a vGPU
    recorded with the domain as owner; a group bound for it).  Refuses a
    running domain (RefusedError) and a hostdev vgpuhost did not attach.
    Raises DeviceError (exit 3) when the definition changed but a release
    failed, naming what is still held.
    """

    if (device is None) == (not all):
        raise InputError("give a DEVICE (mdev UUID, VF or GPU BDF) or --all")
    dev_id = _device_id(device) if device is not None else None
    uri = virt.default_uri(conn_uri)
    lock = nullcontext() if dry_run else file_lock(store.state_dir, LOCK)
    with virt.open_connection(uri) as conn, lock:
        dom = conn.lookup(domain)
        if not dom.is_persistent():
            raise RefusedError(f"domain {dom.name} is transient: detach changes the persistent definition")
        if dom.is_active():
            raise RefusedError(f"domain {dom.name} is running: vgpuhost detaches from a stopped domain",
                               hint="stop it first (virsh shutdown); its vGPUs are released when it stops")
        out = AttachOutcome("detach", dom.name, dom.uuid, uri, changed=True, dry_run=dry_run)
        before = dom.inactive_xml()
        doc = DomainDoc.parse(before)
        meta = doc.view.metadata or domxml.Metadata()
        meta = domxml.Metadata(meta.strategy, meta.tenant, meta.anti_affinity, list(meta.vgpus),
                               list(meta.passthrough), meta.qos, meta.resize)
        targets: List[DeviceEntry] = []
        for r in list(meta.vgpus):
            if all or r.device == dev_id:
                targets.append(DeviceEntry(KIND_MDEV if r.uuid else KIND_VF, r.device, profile=str(r.profile),
                                           gpu=str(r.gpu) if r.gpu else None, functions=[r.device]))
                meta.vgpus.remove(r)
        for g in list(meta.passthrough):
            if all or str(g) == dev_id:
                targets.append(DeviceEntry(KIND_PASSTHROUGH, str(g), gpu=str(g),
                                           functions=_passthrough_sources(host, doc, meta, g)))
                meta.passthrough.remove(g)
        if not targets:
            if all:
                out.changed = False
                out.notes.append(f"{dom.name} has no devices attached by vgpuhost: nothing to do")
                return out
            present = {s.lower() for s in (str(x) for x in doc.view.pci_sources)} | set(doc.view.mdev_uuids)
            if dev_id in present:
                raise RefusedError(f"{dev_id} in domain {dom.name} was not attached by vgpuhost (no metadata entry)"
                                   ": left alone", hint="remove it with virsh detach-device --config")
            known = [r.device for r in meta.vgpus] + [str(g) for g in meta.passthrough]
            raise InputError(f"domain {dom.name} has no device {dev_id}",
                             hint=("attached by vgpuhost: " + ", ".join(known)) if known else
                             "vgpuhost attached nothing to it")
        sources = [f for t in targets for f in t.functions]
        removed_xml = [h for h in doc.hostdevs() if matches_any(sources)(h)]
        out.hostdevs = "".join(etree.tostring(h, encoding="unicode") for h in removed_xml)
        doc.remove_hostdevs(matches_any(sources))
        doc.set_metadata(meta)
        out.metadata = "" if meta.empty else meta.to_xml()
        out.devices = targets
        after = doc.to_xml()
        out.diff = diff(before, after, dom.name)
        if dry_run:
            return out
        act = actor or actor_name()
        conn.define(after)
        for t in targets:
            _verify(dom, t, added=False)
        store.audit(actor=act, operation=f"detach {dom.name}", path="libvirt:defineXML",
                    value=f"{dom.uuid} " + " ".join(f"-{t.kind} {t.id}" for t in targets))
        failures = _release(host, store, dom.uuid, targets, out, act)
        if failures:
            raise DeviceError(f"detached {', '.join(t.id for t in targets)} from {dom.name}, but releasing "
                              + "; ".join(failures) + " failed",
                              hint="'vgpuhost vgpu list' and 'vgpuhost audit' show what is still held")
        return out


def _release(host: HostRoot, store: StateStore, owner: str, targets: List[DeviceEntry], out: AttachOutcome,
             actor: str) -> List[str]:
    """Release what vgpuhost still holds for ``owner`` on this host; failures as text."""
    failures = []
    recs = {r.id: r for r in store.vgpu_records(owner=owner)}
    held = {r.gpu for r in store.passthrough_records() if getattr(r, "owner", None) == owner}
    for t in targets:
        try:
            if t.kind in (KIND_MDEV, KIND_VF) and t.id in recs:
                remove(host, store, t.id, owner=owner, actor=actor, while_running=True)
                out.released.append(t.id)
            elif t.kind == KIND_PASSTHROUGH and t.id in held:
                release(host, store, PciAddress.parse(t.id), owner=owner, actor=actor, while_running=True)
                out.released.append(t.id)
        except VgpuhostError as e:
            failures.append(f"{t.id} ({e.message})")
    return failures
