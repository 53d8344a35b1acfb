"""`vgpuhost` commands: render, attach and detach (libvirt domains).

Registered on the main group by cli/main.py: every click command in
``COMMANDS`` becomes a top-level command.  ``render`` needs only the host
root; ``attach``/``detach`` talk to libvirt at ``--connect URI`` (default
``$LIBVIRT_DEFAULT_URI``, then ``qemu:///system``), through the agent when
its admin socket answers (:mod:`.agentcall`).  ``--json`` documents:
``vgpuhost.render/v1``, ``vgpuhost.attach/v1``, ``vgpuhost.detach/v1``.
"""

from __future__ import annotations

import uuid as _uuid
from typing import List
from urllib.parse import quote

import click

from ..io.state import StateStore
from ..io.virt import default_uri
from ..libvirt.domain import FIRST_GUEST_SLOT, render_mdev, render_passthrough, render_vf
from ..libvirt.domxml import RESIZE_MODES
from ..model.concepts import DeviceKind, QosClass
from ..model.errors import InputError, RefusedError
from ..model.kinds import PlacementStrategy
from ..model.values import PciAddress, parse_uuid
from ..observe.inventory import BACKEND_MDEV
from ..observe.ownable import devices_vgpuhost_may_own
from ..ops.attach import AttachRequest, attach, backend_of, detach, gpus_offering, parse_guest_slot
from ..policy.iommu import group_endpoints
from ..policy.offers import offers, resolve_profile, seen_rows
from ..policy.placement import Request, place
from .agentcall import forward
from .common import current, emit

COMMANDS: List[click.Command] = []

SCHEMA_RENDER = "vgpuhost.render/v1"


# --- render ------------------------------------------------------------------

@click.command("render")
@click.option("--profile", metavar="NAME", help="A vGPU type as the devices name it (A40-8Q, L40S-4Q).")
@click.option("--passthrough", metavar="BDF", help="A whole GPU: every function of its IOMMU group.")
@click.option("--gpu", metavar="BDF", help="vGPU: only on this GPU (vendor VFIO: where the VF is chosen).")
@click.option("--uuid", metavar="UUID", help="Classic mdev: the mdev UUID (default: a new one).")
@click.option("--display", is_flag=True, help="Classic mdev: display='on' (the domain needs <graphics>).")
@click.option("--ramfb", is_flag=True, help="Classic mdev: ramfb='on' (needs --display; one per domain).")
@click.option("--guest-slot", metavar="SLOT", help="Guest PCI slot on bus 0 (hex, e.g. 0x10).")
def render_cmd(profile, passthrough, gpu, uuid, display, ramfb, guest_slot) -> None:
    """Print the hostdev XML vgpuhost would attach (a snippet for <devices>).

    Passthrough: one managed='no' hostdev per function of the GPU's IOMMU
    group; the functions share one guest slot (0x10 unless --guest-slot).
    Classic mdev: type='mdev' model='vfio-pci' with a fresh UUID.  Vendor
    VFIO: the first free VF by placement (attach also skips VFs other domains
    reserve).
    """

    ctx = current()
    if (profile is None) == (passthrough is None):
        raise InputError("give exactly one of --profile NAME or --passthrough BDF")
    slot = parse_guest_slot(guest_slot)
    doc = {"schema": SCHEMA_RENDER, "kind": None, "profile": None, "device": None, "gpu": None,
           "functions": [], "reason": "", "xml": ""}
    if passthrough is not None:
        if display or ramfb or uuid or gpu:
            raise InputError("--display, --ramfb, --uuid and --gpu apply to vGPUs, not to --passthrough")
        addr = PciAddress.parse(passthrough)
        inv = ctx.inventory()
        if inv.gpu(addr) is None:
            raise InputError(f"no NVIDIA GPU at {addr}", hint="'vgpuhost gpus' lists them")
        _, endpoints, _ = group_endpoints(inv, addr)
        if slot is None and len(endpoints) > 1:
            slot = FIRST_GUEST_SLOT
        xml = render_passthrough(endpoints, slot)
        doc.update(kind=DeviceKind.PASSTHROUGH, device=str(addr), gpu=str(addr),
                   functions=[str(d.address) for d in endpoints], xml=xml)
    else:
        if uuid is not None:
            uuid = parse_uuid(uuid)
        if ramfb and not display:
            raise InputError("--ramfb needs --display (QEMU's vfio-pci shows a ramfb only with display=on)",
                             hint="add --display, or drop --ramfb")
        pin = PciAddress.parse(gpu) if gpu else None
        inv = ctx.inventory()
        if pin is not None and inv.gpu(pin) is None:
            raise InputError(f"no NVIDIA GPU at {pin}", hint="'vgpuhost gpus' lists them")
        store = StateStore(ctx.host.state_dir, create=False)
        records = store.vgpu_records()
        seen = list(store.seen_types()) + seen_rows(inv)
        name = resolve_profile(inv, records, profile, pin, seen)
        offering = gpus_offering(inv, records, seen, name)
        if pin is not None:
            offering &= {pin}
        backend = backend_of(inv, offering, name)
        if backend == BACKEND_MDEV:
            u = uuid or str(_uuid.uuid4())
            xml = render_mdev(u, display=display, ramfb=ramfb, guest_slot=slot)
            doc.update(kind=DeviceKind.MDEV, profile=name, device=u, gpu=str(pin) if pin else None, xml=xml)
        else:
            if display or ramfb or uuid:
                raise InputError(f"--display, --ramfb and --uuid apply to classic mdev vGPUs; {name} is a "
                                 "vendor-VFIO vGPU (a PCI VF)")
            decision = place(offers(inv, records, name, seen), Request(name, gpu=pin))
            if not decision.admitted:
                raise RefusedError(f"no free VF for {name}: {decision.reason}")
            xml = render_vf(decision.parent, slot)
            doc.update(kind=DeviceKind.VENDOR_VFIO, profile=name, device=str(decision.parent), gpu=str(decision.gpu),
                       functions=[str(decision.parent)], reason=decision.reason, xml=xml)
    emit(ctx, doc, doc["xml"].rstrip("\n"))


COMMANDS.append(render_cmd)


# --- attach / detach ------------------------------------------------------------

def _text(out) -> str:
    lines = []
    verb = {"attach": ("would attach", "attached", "to"), "detach": ("would detach", "detached", "from")}[out.action]
    for d in out.devices:
        what = {DeviceKind.PASSTHROUGH: f"GPU {d.id} (passthrough, {len(d.functions)} function"
                               f"{'s' if len(d.functions) != 1 else ''})",
                DeviceKind.MDEV: f"{d.profile} vGPU (classic mdev {d.id})",
                DeviceKind.VENDOR_VFIO: f"{d.profile} vGPU (vendor-VFIO VF {d.id})"}[d.kind]
        head = verb[0] if out.dry_run else verb[1]
        lines.append(f"{head} {what} {verb[2]} {out.domain} ({out.uuid})" + (" live" if out.live else ""))
    if not out.devices:
        lines.append(f"no change: {out.domain} ({out.uuid})")
    if out.reason:
        lines.append(f"placement: {out.reason}")
    if out.released:
        lines.append("released: " + ", ".join(out.released))
    lines += [f"note: {n}" for n in out.notes]
    if out.dry_run and out.diff:
        lines.append("definition diff:")
        lines.append(out.diff.rstrip("\n"))
    return "\n".join(lines)


def _forward(ctx, action: str, domain: str, body: dict):
    """attach/detach through the agent when it answers (None: do it here).  The agent connects to
    the libvirt URI this command would use (``--connect``, else ``$LIBVIRT_DEFAULT_URI``, else
    qemu:///system), so both ways reach the same libvirt; a URI the agent does not take (it names
    them in ``GET /v1/agent``) is used here, in the caller's own process."""
    uri = default_uri(ctx.connect)
    if uri.startswith("test:"):         # libvirt's test driver lives in each process: only here
        return None
    # the agent connects only to its own URI and the local qemu ones; any other stays here, as the caller
    return forward(ctx, "POST", f"/v1/domains/{quote(domain, safe='')}/{action}", {**body, "uri": uri},
                   accept=lambda info: uri in (info.get("libvirt_uris") or ()))


def _emit_outcome(ctx, out) -> None:
    emit(ctx, out.as_dict(), _text(out))


@click.command("attach")
@click.argument("domain")
@click.option("--profile", metavar="NAME", help="A vGPU of this type (A40-8Q, L40S-4Q, H200X-1-18C).")
@click.option("--passthrough", metavar="BDF", help="The whole GPU at BDF (every function of its IOMMU group).")
@click.option("--gpu", metavar="BDF", help="vGPU: pin it to this GPU.")
@click.option("--uuid", metavar="UUID", help="Name one existing vGPU of the layout's pool (classic mdev); "
                                             "the hook lends it to the domain at each start.")
@click.option("--tenant", metavar="T", help="Bind the domain to tenant T (the state store's binding, audited) and "
                                             "record the name in its metadata.")
@click.option("--strategy", type=click.Choice(PlacementStrategy.OFFERED),
              help="Placement strategy of the domain's vGPUs (default: first-fit, or as recorded).  "
                   "headroom may refuse a vGPU that fits, and says so (docs/performance.md).")
@click.option("--anti-affinity", metavar="KEY", help="No two vGPUs with KEY on one GPU.")
@click.option("--qos", type=click.Choice(QosClass.values()),
              help="The domain's QoS class (default: its tenant's; at most the tenant's, bound with it).")
@click.option("--display", is_flag=True, help="Classic mdev: display='on' (the domain needs <graphics>).")
@click.option("--ramfb", is_flag=True, help="Classic mdev: ramfb='on' (needs --display; one per domain).")
@click.option("--guest-slot", metavar="SLOT", help="Guest PCI slot on bus 0 (hex, e.g. 0x10); refused when taken.")
@click.option("--live", is_flag=True, help="Classic mdev only: create it now and hot-plug it into the running domain.")
@click.option("--resize", type=click.Choice(RESIZE_MODES),
              help="auto: at each start the domain's vGPUs get the smaller profile 'advise' proposes from their "
                   "metered use (same board and series, within the tenant's quota; audited; never a running VM).")
@click.option("--dry-run", is_flag=True, help="Print the definition diff; change nothing.")
def attach_cmd(domain, dry_run, **options) -> None:
    """Give DOMAIN (name or UUID) a vGPU or a whole GPU: hostdev and metadata in one define."""
    ctx = current()
    req = AttachRequest.from_options(**options)
    if not dry_run:
        out = _forward(ctx, "attach", domain, req.to_json())
        if out is not None:
            _emit_outcome(ctx, out)
            return
    store = StateStore(ctx.host.state_dir, create=not dry_run, owned=lambda: _owned(ctx.host))
    out = attach(ctx.host, store, ctx.connect, domain, req, dry_run=dry_run)
    _emit_outcome(ctx, out)


@click.command("detach")
@click.argument("domain")
@click.argument("device", required=False)
@click.option("--all", "all_", is_flag=True, help="Every device vgpuhost attached to DOMAIN.")
@click.option("--dry-run", is_flag=True, help="Print the definition diff; change nothing.")
def detach_cmd(domain, device, all_, dry_run) -> None:
    """Take DEVICE (mdev UUID, VF BDF or GPU BDF), or --all, from stopped DOMAIN and release it."""
    if device is not None and all_:
        raise InputError("give a DEVICE or --all, not both")
    ctx = current()
    if not dry_run:
        out = _forward(ctx, "detach", domain, {"device": device, "all": all_})
        if out is not None:
            _emit_outcome(ctx, out)
            return
    store = StateStore(ctx.host.state_dir, create=not dry_run, owned=lambda: _owned(ctx.host))
    out = detach(ctx.host, store, ctx.connect, domain, device=device, all=all_, dry_run=dry_run)
    _emit_outcome(ctx, out)


COMMANDS += [attach_cmd, detach_cmd]


def _owned(host):
    return devices_vgpuhost_may_own(host)
