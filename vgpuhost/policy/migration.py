"""Live migration of a domain with vGPUs: what a destination must offer, decided on plain values.

Owns: the request document a source sends a destination (:func:`parse_request`: untrusted JSON,
checked field by field), the vGPU manager compatibility rule (:func:`manager_refusal`), the
refusal lines (:class:`Refusal`) and the choice of a device on the destination
(:func:`choose_device`).  Must not: read the host, the state store or libvirt (callers in
:mod:`vgpuhost.ops.migrate` gather the facts).

Facts and their sources (docs/reference/libvirt.md#migration):

- a passed-through GPU cannot be live-migrated: vgpuhost refuses it, as libvirt does for a
  ``<hostdev>`` whose device has no VFIO migration support;
- vendor-VFIO migration (and classic mdev) needs the same vGPU type on the destination;
- the vGPU manager (the host driver) must be the same version on both hosts: Red Hat's
  documentation of vGPU live migration on KVM says migration fails when the driver versions
  differ; NVML's ``nvmlGetVgpuCompatibility`` reports a host-driver limit
  (``NVML_VGPU_COMPATIBILITY_LIMIT_HOST_DRIVER``) for the same reason.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..model.concepts import DeviceKind
from ..model.errors import InputError
from ..model.values import PciAddress, VgpuProfile, is_name, parse_uuid, record

_KEY_CHARS = frozenset("_.:+-")      # tenant and anti-affinity keys, as libvirt/domxml.py checks them

REQUEST_SCHEMA = "vgpuhost.migrate-request/v1"
CHECK_SCHEMA = "vgpuhost.migrate-check/v1"
MAX_DEVICES = 24

#: refusal codes (the ``--json`` document's ``refusals[].code``)
TYPE_MISSING = "type-missing"
MIG_PROFILE_BUSY = "mig-profile-busy"
PASSTHROUGH = "passthrough"
ADMISSION = "admission"
MANAGER_VERSION = "manager-version"
NO_DEVICE = "no-device"
RUNNING_TYPE = "running-type"
#: the kinds of a request's devices: a classic mdev, a vendor-VFIO VF, a passed-through GPU
KINDS = (DeviceKind.MDEV, "vf", DeviceKind.PASSTHROUGH)
CODES = (TYPE_MISSING, MIG_PROFILE_BUSY, PASSTHROUGH, ADMISSION, MANAGER_VERSION, NO_DEVICE, RUNNING_TYPE)


@record(frozen=True)
class Refusal:
    """One reason the destination cannot take the domain: ``code`` (:data:`CODES`), ``device`` (the mdev
    UUID, VF BDF or GPU it concerns; "" for the host), ``line`` (what is wrong), ``fix`` (what would fix it)."""

    code: str
    device: str
    line: str
    fix: str

    def text(self) -> str:
        return f"{self.line}; fix: {self.fix}"

    def as_dict(self) -> dict:
        return {"code": self.code, "device": self.device, "line": self.line, "fix": self.fix}


@record(frozen=True)
class Device:
    """One device of the migrating domain, as the source holds it: ``kind`` ``mdev`` / ``vf`` /
    ``passthrough``; ``device`` the mdev UUID, VF BDF or GPU BDF; ``profile`` the vGPU type name
    ("" for passthrough); ``gpu`` the source GPU's BDF (informative: the destination's differ)."""

    kind: str
    device: str
    profile: str
    gpu: str = ""

    @property
    def mig_backed(self) -> bool:
        p = VgpuProfile.try_parse(self.profile) if self.profile else None
        return bool(p is not None and p.mig_backed)


@record(frozen=True)
class Request:
    """What a source sends a destination (:data:`REQUEST_SCHEMA`): the domain's ``name`` and ``uuid``,
    its placement ``strategy`` and ``anti_affinity``, the source's binding (``tenant``, ``qos``: None when
    unbound), the source's vGPU manager version (``manager``: None when unread) and the ``devices``."""

    name: str
    uuid: str
    strategy: str
    anti_affinity: Optional[str]
    tenant: Optional[str]
    qos: Optional[str]
    manager: Optional[str]
    devices: Tuple[Device, ...]

    def as_dict(self) -> dict:
        return {"schema": REQUEST_SCHEMA, "name": self.name, "uuid": self.uuid, "strategy": self.strategy,
                "anti_affinity": self.anti_affinity, "tenant": self.tenant, "qos": self.qos,
                "manager_version": self.manager,
                "devices": [{"kind": d.kind, "device": d.device, "profile": d.profile, "gpu": d.gpu}
                            for d in self.devices]}


def _text(doc: dict, key: str, *, optional: bool = False, limit: int = 128) -> Optional[str]:
    v = doc.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > limit or not v.isprintable():
        raise InputError(f"migration request: {key!r} must be a non-empty string of at most {limit} printable "
                         "characters", hint="make the request with 'vgpuhost migrate request DOMAIN'")
    return v


def parse_request(doc: object) -> Request:
    """A :class:`Request` from the JSON document ``doc`` (untrusted: from stdin or another host).

    Raises InputError (exit 2) naming the first bad field."""
    if not isinstance(doc, dict) or doc.get("schema") != REQUEST_SCHEMA:
        raise InputError(f"not a migration request: expected a JSON object with \"schema\": \"{REQUEST_SCHEMA}\"",
                         hint="make it with 'vgpuhost migrate request DOMAIN' on the source host")
    uuid = parse_uuid(_text(doc, "uuid"))
    name = _text(doc, "name", limit=256)
    strategy = _text(doc, "strategy", limit=32)
    from ..model.kinds import PlacementStrategy
    if strategy not in PlacementStrategy.OFFERED:
        raise InputError(f"migration request: unknown strategy {strategy!r}",
                         hint="one of " + ", ".join(PlacementStrategy.OFFERED))
    key = _text(doc, "anti_affinity", optional=True, limit=64)
    tenant = _text(doc, "tenant", optional=True, limit=64)
    qos = _text(doc, "qos", optional=True, limit=32)
    for what, v in (("anti_affinity", key), ("tenant", tenant)):
        if v is not None and not is_name(v, _KEY_CHARS):
            raise InputError(f"migration request: {what} {v!r} is not a name", hint="letters, digits and _.:+-")
    manager = _text(doc, "manager_version", optional=True, limit=32)
    raw = doc.get("devices")
    if not isinstance(raw, list) or len(raw) > MAX_DEVICES:
        raise InputError(f"migration request: 'devices' must be a list of at most {MAX_DEVICES}",
                         hint="make the request with 'vgpuhost migrate request DOMAIN'")
    devices = []
    for i, d in enumerate(raw):
        if not isinstance(d, dict):
            raise InputError(f"migration request: devices[{i}] is not an object")
        kind = d.get("kind")
        if kind not in KINDS:
            raise InputError(f"migration request: devices[{i}].kind must be mdev, vf or passthrough")
        dev = _text(d, "device", limit=64)
        dev = parse_uuid(dev) if kind == "mdev" else str(PciAddress.parse(dev))
        profile = "" if kind == DeviceKind.PASSTHROUGH else str(VgpuProfile.parse(_text(d, "profile", limit=64)))
        gpu = d.get("gpu") or ""
        if gpu:
            gpu = str(PciAddress.parse(_text(d, "gpu", limit=16)))
        devices.append(Device(kind, dev, profile, gpu))
    return Request(name, uuid, strategy, key, tenant, qos, manager, tuple(devices))


def _version(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    if not text:
        return None
    parts = text.strip().split(".")
    if not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def manager_refusal(source: Optional[str], destination: Optional[str]) -> Optional[Refusal]:
    """The vGPU manager rule: both versions known and equal (module docstring), else a Refusal.

    ``source``/``destination``: the nvidia module's version on each host (``580.65.05``), None when
    it could not be read."""
    if _version(source) is None or _version(destination) is None:
        which = "source" if _version(source) is None else "destination"
        return Refusal(MANAGER_VERSION, "", f"the {which} host's vGPU manager version is unknown "
                                            f"(source {source or '?'}, destination {destination or '?'})",
                       "load the NVIDIA vGPU manager (its module 'nvidia' shows sys/module/nvidia/version) on "
                       f"the {which} host")
    if _version(source) != _version(destination):
        return Refusal(MANAGER_VERSION, "", f"vGPU manager {destination} on the destination differs from "
                                            f"{source} on the source; vGPU live migration on KVM needs the "
                                            "same version on both hosts",
                       f"install vGPU manager {source} on the destination (or upgrade both hosts to one version)")
    return None


def passthrough_refusal(d: Device) -> Refusal:
    return Refusal(PASSTHROUGH, d.device, f"GPU {d.device} is passed through: a passed-through GPU has no live "
                                          "migration (its state is in the device, which no driver saves)",
                   "shut the domain down and start it on the destination, or give it a vGPU instead")


def choose_device(offers: Sequence, req, *, keep: Optional[PciAddress] = None,
                  reserved: frozenset = frozenset()):
    """Where the destination makes one vGPU: ``(gpu, parent)`` PciAddresses, or ``(None, reason)``.

    ``offers``: :class:`vgpuhost.policy.placement.GpuOffer` values for the vGPU's type on the
    destination; ``req``: the :class:`vgpuhost.policy.placement.Request` (the domain's strategy and
    anti-affinity, owner the domain's UUID); ``keep``: the VF (or GPU, for a pinned mdev) the XML names,
    kept when it is still free there; ``reserved``: VF BDFs (strings) other incoming migrations reserve.
    """
    from dataclasses import replace
    from ..policy.placement import place
    adjusted = []
    for o in offers:
        parents = tuple(p for p in o.parents if str(p) not in reserved)
        adjusted.append(replace(o, parents=parents, available=min(o.available, len(parents)) if o.parents
                                else o.available))
    if keep is not None:
        for o in adjusted:
            if o.available > 0 and (o.gpu == keep or keep in o.parents) and req.owner not in o.owners:
                return o.gpu, (keep if keep in o.parents else (o.parents[0] if o.parents else None))
    decision = place(adjusted, req)
    if not decision.admitted:
        return None, decision.reason
    return decision.gpu, decision.parent


def type_refusal(d: Device, where: str, reason: str, *, known: bool = True) -> Refusal:
    """The destination does not offer ``d``'s vGPU type now (``reason``: placement's).  ``known``: the
    destination knows the type (its GPUs listed it, now or before): a MIG-backed one is then missing a
    free GPU instance; an unknown type is missing outright."""
    if d.mig_backed and not known:
        return Refusal(TYPE_MISSING, d.device, f"{d.profile} ({d.device}): {where} has never offered this "
                                               f"MIG-backed type ({reason})",
                       "a GPU of the same board in MIG mode with a GPU instance of its profile ('vgpuhost mig "
                       "apply'); the type must be the same on both hosts")
    if d.mig_backed:
        return Refusal(MIG_PROFILE_BUSY, d.device,
                       f"{d.profile} ({d.device}): no free GPU instance for this MIG-backed type on {where} "
                       f"({reason})",
                       "free a GPU instance of the same profile there ('vgpuhost mig show'), or make one "
                       "('vgpuhost mig apply')")
    return Refusal(TYPE_MISSING, d.device, f"{d.profile} ({d.device}): {where} cannot create this vGPU type now "
                                           f"({reason})",
                   "free a vGPU of that type there or pick a destination whose 'vgpuhost types --available' "
                   "lists it; the type must be the same on both hosts")


def running_type_refusal(name: str, device: str, running: str, asked: str) -> Refusal:
    """A right-sized vGPU (``resize="auto"``): it runs ``running`` on the source, the domain XML libvirt
    sends names ``asked``, and the destination makes what the XML names (it cannot know the running type,
    and the type is part of the migrated device's state)."""
    return Refusal(RUNNING_TYPE, device, f"{device} of {name} runs {running} (right-sized at its start) but its "
                                         f"XML asks {asked}: the destination makes the type the XML names",
                   f"migrate with 'virsh migrate --xml FILE', FILE its XML ('virsh dumpxml --migratable {name}') "
                   f"with profile=\"{running}\" on this vGPU in the vgpuhost metadata")


def summary(refusals: Sequence[Refusal]) -> Dict[str, List[str]]:
    """``{code: [device, ...]}`` of ``refusals``, for the text output's last line."""
    out: Dict[str, List[str]] = {}
    for r in refusals:
        out.setdefault(r.code, []).append(r.device)
    return out


#: the most refusals a check document from another host may hold (one per device, one per host rule)
MAX_REFUSALS = 2 * MAX_DEVICES + 4


def _answer_text(v: object, what: str, limit: int) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise InputError(f"the destination's answer: {what} is not a string of at most {limit} characters",
                         hint="the destination must run the same vgpuhost version ('vgpuhost --version')")
    return v


def parse_check(doc: object) -> dict:
    """The check document ``doc`` answered by another host (untrusted: read over ssh), checked against
    :data:`CHECK_SCHEMA`'s shape: ``ok`` a bool, at most :data:`MAX_DEVICES` devices and
    :data:`MAX_REFUSALS` refusals, every string of bounded length (a line or fix at most 2000
    characters), refusal codes among :data:`CODES`.  Returns a new dict holding only the schema's
    fields.  Strings are kept as sent: printers escape control characters.  Raises InputError naming
    the first bad field."""
    def bad(what: str) -> InputError:
        return InputError(f"the destination's answer: {what}",
                          hint="the destination must run the same vgpuhost version ('vgpuhost --version')")
    if not isinstance(doc, dict) or doc.get("schema") != CHECK_SCHEMA:
        raise bad(f"not a check document (\"schema\": \"{CHECK_SCHEMA}\" expected)")
    if not isinstance(doc.get("ok"), bool):
        raise bad("'ok' is not true or false")
    out: dict = {"schema": CHECK_SCHEMA, "ok": doc["ok"]}
    for key, limit in (("domain", 256), ("uuid", 64), ("destination", 256), ("tenant", 64)):
        out[key] = _answer_text(doc.get(key), key, limit)
    mv = doc.get("manager_version")
    if not isinstance(mv, dict):
        raise bad("'manager_version' is not an object")
    out["manager_version"] = {k: _answer_text(mv.get(k), f"manager_version.{k}", 32)
                              for k in ("source", "destination")}
    devices, refusals = doc.get("devices"), doc.get("refusals")
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
        raise bad(f"'devices' is not a list of at most {MAX_DEVICES}")
    if not isinstance(refusals, list) or len(refusals) > MAX_REFUSALS:
        raise bad(f"'refusals' is not a list of at most {MAX_REFUSALS}")
    out["devices"] = []
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            raise bad(f"devices[{i}] is not an object")
        out["devices"].append({k: _answer_text(d.get(k), f"devices[{i}].{k}", 64)
                               for k in ("device", "kind", "profile", "gpu", "parent")})
    out["refusals"] = []
    for i, r in enumerate(refusals):
        if not isinstance(r, dict) or r.get("code") not in CODES:
            raise bad(f"refusals[{i}] is not a refusal of a known code")
        out["refusals"].append({"code": r["code"], "device": _answer_text(r.get("device"), f"refusals[{i}].device", 64),
                                "line": _answer_text(r.get("line"), f"refusals[{i}].line", 2000),
                                "fix": _answer_text(r.get("fix"), f"refusals[{i}].fix", 2000)})
    if out["ok"] == bool(out["refusals"]):
        raise bad("'ok' disagrees with its refusals")
    return out
