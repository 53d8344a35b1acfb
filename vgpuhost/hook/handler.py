"""libvirt's qemu hook: make a domain's GPU devices exist at start, give them back at stop.

Owns: the hook handler (:func:`main`), run by the dispatcher
``hooks/qemu`` that ``vgpuhost hook install`` places in
``/etc/libvirt/hooks/qemu.d/``; deciding, from a domain document nobody
vouches for, which devices vgpuhost may touch (:func:`check_request`); the
operator allow-list ``etc/vgpuhost/hook.allow`` (:func:`load_allow`); and
installing, removing and inspecting the dispatcher (:func:`install`,
:func:`uninstall`, :func:`status`).
Must not: call libvirt (a hook that calls back into libvirtd deadlocks it,
REFERENCE.md §8); import click, lxml, yaml, jinja2 or libvirt (the hook runs
on every GPU domain start: ``python -X importtime`` keeps it lean); start a
child process; print more than one line.

libvirt facts (REFERENCE.md §8): argv is ``<domain name> <operation>
<sub-operation> <extra>``, stdin the domain XML.  ``prepare begin`` runs
before libvirt prepares hostdevs: the mdev must exist and the group be on
vfio-pci by then.  A non-zero exit of ``prepare`` aborts the start and
libvirt shows the hook's stderr to the user.  ``release end`` runs after
every stop, and also after a start that failed (even in ``prepare``):
release must cope with a start that never happened.  There is no timeout
in libvirt: the hook arms its own (``signal.alarm``).

What ``prepare begin`` does, for a domain whose ``<metadata>`` holds
vgpuhost's element (:mod:`vgpuhost.domxml`):

1. reads and validates the XML (expat, no DTD or entities, 4 MiB cap);
2. checks every request against the host and the domain's own hostdevs
   (:func:`check_request`) and against the records (held by another
   domain?), and resolves every profile name, all before any write;
3. records the domain as started (``StateStore.domain_started``);
4. binds each ``passthrough`` group (owner = the domain UUID; a group the
   operator bound for guests, owner ``manual`` or ``layout``, is used as it
   is and never released by the domain), then creates each vGPU: a classic
   mdev with the UUID its hostdev names, placed now by the domain's
   strategy, or the vGPU type on the VF its hostdev names;
5. on any failure removes what *this* invocation made and exits non-zero
   with one line.

``release end`` removes the vGPUs and releases the groups the domain's UUID
owns (owner-guarded: a late release never frees the next owner's device)
and forgets the domain; nothing recorded is a no-op.

Exit codes: 0 done or nothing to do; 2 refused or bad input (nothing
changed); 3 a device operation failed or the hook timed out (what this
invocation made was undone); 4 internal error.
"""

from __future__ import annotations

import os
import signal
import sys

from ..libvirt.domxml import MAX_XML_BYTES, DomainView, parse_domain
from ..model.errors import EXIT_DEVICE, EXIT_INPUT, EXIT_OK, DeviceError, InputError, RefusedError, VgpuhostError
from ..io.hostroot import HostRoot
from ..io.process import actor as actor_name
from ..model.values import PciAddress

TYPE_CHECKING = False
if TYPE_CHECKING:   # only for annotations: never imported on the hook path
    from typing import BinaryIO, Dict, FrozenSet, List, Optional, TextIO, Tuple
    from ..observe.inventory import Inventory
    from ..io.state import StateStore

EXIT_INTERNAL = 4
ENV_TIMEOUT = "VGPUHOST_HOOK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60
MAX_TIMEOUT_S = 3600
#: the dispatcher's coreutils ``timeout`` backstop: TERM this long after the handler's own alarm, then KILL
BACKSTOP_EXTRA_S = 30
BACKSTOP_KILL_S = 5
ALLOW_FILE = ("vgpuhost", "hook.allow")       # under <root>/etc
MAX_ALLOW_BYTES = 64 * 1024
HOOK_NAME = "vgpuhost"                        # the file in qemu.d
MARKER = "# vgpuhost-hook: written by 'vgpuhost hook install'"
ACTS = {("prepare", "begin"): "prepare", ("release", "end"): "release"}


class HookTimeout(Exception):
    """The handler ran past its timeout (``signal.alarm``) or was sent SIGTERM.

    Not a VgpuhostError on purpose: it unwinds through the ``except
    BaseException`` rollback paths of passthrough and of :func:`prepare`.
    """


# ---------------------------------------------------------------------------
# entry points

def run() -> None:
    """``python -m vgpuhost.hook NAME OP SUBOP EXTRA`` and the dispatcher's entry: exits with main's code.

    Exits with ``os._exit`` once stdout and stderr are flushed: everything
    the hook wrote is committed by then (SQLite transactions, kernel
    writes, renames), and skipping the interpreter's teardown (module and
    object finalisation) saves milliseconds on every domain start and stop.
    """
    code = main(sys.argv[1:], sys.stdin.buffer)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: List[str], stdin: BinaryIO, stderr: Optional[TextIO] = None,
         host: Optional[HostRoot] = None) -> int:
    """Handle one hook call: ``argv`` = ``[domain name, operation, sub-operation, extra]``.

    Only ``prepare begin`` and ``release end`` act (and read ``stdin``, at
    most :data:`MAX_XML_BYTES` + 1 bytes); every other call returns 0 at
    once.  Failures print one line on ``stderr`` (default ``sys.stderr``)
    and return the exit code (module docstring); nothing raises.
    """
    err = stderr if stderr is not None else sys.stderr
    if len(argv) < 3:
        _say(err, "usage: vgpuhost-hook DOMAIN OPERATION SUB-OPERATION [EXTRA] (the domain XML on stdin)")
        return EXIT_INPUT
    name, act = argv[0], ACTS.get((argv[1], argv[2]))
    if act is None:
        return EXIT_OK
    timeout_s = _timeout_s()
    armed = {"live": True}
    old = _arm(timeout_s, armed)
    try:
        host = host or HostRoot.from_env()
        view = parse_domain(stdin.read(MAX_XML_BYTES + 1))
        name = view.name or name
        actor = actor_name(f"hook {_printable(name, 80)}", with_uid=False)
        if act == "prepare":
            prepare(host, view, actor=actor)
        else:
            release(host, view, actor=actor)
        armed["live"] = False               # done: a signal arriving now changes nothing
        return EXIT_OK
    except HookTimeout as e:
        _say(err, f"vgpuhost: error: domain {name!r}: {e}; what this start had made was undone; "
                  "check 'vgpuhost audit' and whether another vgpuhost operation holds a lock")
        return EXIT_DEVICE
    except VgpuhostError as e:
        _say(err, f"vgpuhost: error: domain {name!r}: {e.one_line()}")
        return e.exit_code
    except Exception as e:      # sqlite3.Error, OSError, a bug: still one line
        if type(e).__module__ == "sqlite3":
            _say(err, f"vgpuhost: error: domain {name!r}: the state store is unusable ({e}); move "
                      "state.db aside (vgpuhost starts a new one) or restore it from a backup")
            return EXIT_INPUT
        if isinstance(e, OSError):
            _say(err, f"vgpuhost: error: domain {name!r}: {e.strerror or e}"
                      f"{': ' + str(e.filename) if e.filename else ''}; check the path and its permissions")
            return EXIT_INPUT
        _say(err, f"vgpuhost: internal error in the qemu hook: {type(e).__name__}: {e} (report it; "
                  f"'python -m vgpuhost.hook NAME {argv[1]} {argv[2]} -' with the domain XML on stdin reproduces it)")
        return EXIT_INTERNAL
    finally:
        armed["live"] = False
        _disarm(old)


def _say(err: TextIO, line: str) -> None:
    try:
        err.write(_printable(line, 2000) + "\n")
        err.flush()
    except (OSError, ValueError):
        pass


def _printable(text: str, limit: int) -> str:
    """One line: control characters escaped, length capped (libvirt shows it to the user)."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[:limit] + "..."


def _timeout_s() -> int:
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        value = int(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = DEFAULT_TIMEOUT_S
    return min(max(value, 1), MAX_TIMEOUT_S)


def _arm(timeout_s: int, armed: dict):
    """SIGALRM after ``timeout_s`` and SIGTERM both raise :class:`HookTimeout` while ``armed['live']``;
    returns what to restore."""
    def on_alarm(signum, frame):
        if armed["live"]:
            raise HookTimeout(f"the vgpuhost hook timed out after {timeout_s} s")

    def on_term(signum, frame):
        if armed["live"]:
            raise HookTimeout("the vgpuhost hook was terminated (SIGTERM)")

    try:
        old = (signal.signal(signal.SIGALRM, on_alarm), signal.signal(signal.SIGTERM, on_term))
    except ValueError:          # not the main thread (tests calling main from a thread): no timeout
        return None
    signal.alarm(timeout_s)
    return old


def _disarm(old) -> None:
    if old is None:
        return
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old[0])
    signal.signal(signal.SIGTERM, old[1])


# ---------------------------------------------------------------------------
# the operator allow-list

def allow_path(host: HostRoot):
    """``<root>/etc/vgpuhost/hook.allow``."""
    return host.etc(*ALLOW_FILE)


def load_allow(host: HostRoot) -> Optional[FrozenSet[PciAddress]]:
    """The GPUs the hook may act on: None = every NVIDIA GPU (no file, or a ``*`` line).

    Format: one GPU BDF (``0000:41:00.0``, the physical GPU: it covers its
    IOMMU-group companions, the vGPUs placed on it and its VFs) per line,
    ``#`` starts a comment, blank lines are ignored, ``*`` allows every
    NVIDIA GPU.  A file with no entry allows none.  The list only narrows:
    a BDF that is not an NVIDIA GPU is never acted on, listed or not.
    Raises InputError (``file:line: ...``) for a bad line and
    HostEnvironmentError when the file cannot be read; the hook then
    refuses (fails closed).
    """
    from ..model.errors import HostEnvironmentError
    path = allow_path(host)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_ALLOW_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HostEnvironmentError(f"cannot read the hook allow-list {host.relative(path)}: {e.strerror}",
                                   hint="make it readable by root, or remove it to allow every NVIDIA GPU") from None
    if len(data) > MAX_ALLOW_BYTES:
        raise InputError(f"{host.relative(path)} is over {MAX_ALLOW_BYTES} bytes",
                         hint="one GPU BDF per line; a host has a few GPUs")
    out = set()
    for n, raw in enumerate(data.decode("ascii", "backslashreplace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "*":
            return None
        if not PciAddress.is_valid(line):
            raise InputError(f"{host.relative(path)}:{n}: {_printable(line, 60)!r} is not a GPU's PCI address",
                             hint="one full BDF per line (0000:41:00.0), '*' for every NVIDIA GPU, '#' comments")
        out.add(PciAddress.parse(line))
    return frozenset(out)


# ---------------------------------------------------------------------------
# trust: what a domain document may make vgpuhost do

class Checked:
    """What :func:`check_request` admitted: passthrough GPUs with their endpoints, vGPU requests."""

    __slots__ = ("passthrough", "vgpus", "allowed", "pooled")

    def __init__(self):
        self.passthrough: List[Tuple[PciAddress, List[PciAddress]]] = []
        self.vgpus: list = []                              # domxml.VgpuRequest, in metadata order
        self.allowed: Optional[FrozenSet[PciAddress]] = None
        self.pooled: set = set()       # passthrough GPUs the operator bound (owner manual/layout): used as they are


def check_request(inv: "Inventory", view: DomainView, allow: Optional[FrozenSet[PciAddress]]) -> Checked:
    """Decide whether the domain's vgpuhost metadata may be acted on, before anything is touched.

    Pure: reads ``inv`` and ``view`` only.  The XML is untrusted (whoever may
    define a domain wrote it), so vgpuhost acts only on devices it would offer
    for guests: NVIDIA GPUs (vendor 0x10de, display class 0x03xx), their
    IOMMU-group companions (:func:`vgpuhost.passthrough.group_endpoints`: a
    group holding a storage or network controller is refused) and VFs of
    NVIDIA GPUs; each narrowed by ``allow`` (None = all).  The metadata must
    match the domain's own hostdevs: each mdev UUID an mdev hostdev, each VF
    and every endpoint of a passthrough group a ``managed='no'`` PCI
    hostdev (a ``managed='yes'`` one on a group vgpuhost binds is refused:
    never both).  Raises InputError / RefusedError naming the device.
    """
    meta = view.metadata
    out = Checked()
    out.allowed = allow
    if meta is None:
        return out
    pci = {}
    for h in view.hostdevs:
        if h.kind == "pci" and h.source is not None:
            pci[h.source] = h
    mdevs = set(view.mdev_uuids)

    def allowed(gpu: PciAddress, what: str) -> None:
        if allow is not None and gpu not in allow:
            raise RefusedError(f"{what}: GPU {gpu} is not in the hook allow-list (etc/vgpuhost/hook.allow)",
                               hint=f"add {gpu} to that file if guests may use it, or change the domain")

    def need_unmanaged(bdf: PciAddress, what: str, vf: bool = False) -> None:
        h = pci.get(bdf)
        if h is None:
            raise RefusedError(f"{what}: the domain has no <hostdev type='pci' managed='no'> for {bdf}",
                               hint="attach the device with 'vgpuhost attach', which writes hostdev and "
                                    "metadata together")
        if h.managed:
            why = ("a vGPU VF stays on NVIDIA's driver, and managed='yes' would have libvirt rebind it"
                   if vf else "vgpuhost binds the whole IOMMU group itself (never both)")
            raise RefusedError(f"{what}: the hostdev for {bdf} is managed='yes', but {why}",
                               hint="set managed='no' on it ('vgpuhost attach' does)")

    def nvidia_gpu(bdf: PciAddress, what: str):
        g = inv.gpu(bdf)
        if g is not None:
            return g
        dev = inv.devices.get(bdf)
        if dev is None:
            raise InputError(f"{what}: no PCI device at {bdf} on this host",
                             hint="'vgpuhost gpus' lists the GPUs; fix the domain's metadata")
        raise RefusedError(f"{what}: {bdf} is a {dev.class_name} ({dev.ids}), not an NVIDIA GPU: vgpuhost "
                           "gives guests NVIDIA GPUs only", hint="remove it from the domain's vgpuhost metadata")

    whole = set()
    if meta.passthrough:
        from ..ops.passthrough import group_endpoints
    for gpu in meta.passthrough:
        what = f"passthrough {gpu}"
        nvidia_gpu(gpu, what)
        allowed(gpu, what)
        _, endpoints, _ = group_endpoints(inv, gpu)       # refuses a group with a foreign endpoint
        for d in endpoints:
            need_unmanaged(d.address, what)
        whole.add(gpu)
        out.passthrough.append((gpu, [d.address for d in endpoints]))
    for req in meta.vgpus:
        if req.uuid is not None:
            what = f"vGPU {req.uuid}"
            if req.uuid not in mdevs:
                raise RefusedError(f"{what}: the domain has no <hostdev type='mdev'> with that UUID",
                                   hint="attach vGPUs with 'vgpuhost attach', which writes hostdev and "
                                        "metadata together")
            if req.gpu is not None:
                nvidia_gpu(req.gpu, what)
                allowed(req.gpu, what)
                if req.gpu in whole:
                    raise RefusedError(f"{what}: GPU {req.gpu} is also passed through to this domain",
                                       hint="a passed-through GPU carries no vGPUs")
        else:
            what = f"vGPU on VF {req.vf}"
            dev = inv.devices.get(req.vf)
            if dev is None:
                raise InputError(f"{what}: no PCI device at {req.vf} on this host",
                                 hint="'vgpuhost gpus' lists the GPUs and their VFs; fix the domain's metadata")
            parent = inv.gpu(dev.physfn) if dev.physfn is not None else None
            if parent is None:
                raise RefusedError(f"{what}: {req.vf} is a {dev.class_name} ({dev.ids}), not a VF of an "
                                   "NVIDIA GPU", hint="remove it from the domain's vgpuhost metadata")
            allowed(parent.address, what)
            if parent.address in whole:
                raise RefusedError(f"{what}: its GPU {parent.address} is also passed through to this domain",
                                   hint="a passed-through GPU carries no vGPUs")
            if req.gpu is not None and req.gpu != parent.address:
                raise InputError(f"{what}: the VF belongs to {parent.address}, the metadata says gpu={req.gpu}")
            need_unmanaged(req.vf, what, vf=True)
        out.vgpus.append(req)
    return out


def _holder_text(store: "StateStore", owner: str) -> str:
    if owner == "manual":
        return "a manual vgpuhost command (owner 'manual')"
    if owner == "layout":
        return "vgpuhost's declarative layout (owner 'layout')"
    name = store.active_domains().get(owner)
    return f"domain {name!r} ({owner})" if name else f"domain {owner}"


POOL_OWNERS = ("manual", "layout")      # vgpuhost.placement.POOL_OWNERS (not imported: hook path)


def check_holders(inv: "Inventory", store: "StateStore", view: DomainView, checked: Checked) -> None:
    """Refuse a device another owner holds (naming it) or one vgpuhost did not make (foreign).

    A passthrough group the operator bound (``vgpuhost passthrough prepare``
    or a layout: owner ``manual`` / ``layout``) is there for guests: it is
    used as it is, never taken over or released by the domain
    (``checked.pooled``), provided every function is on vfio-pci.
    """
    me = view.uuid
    records = {r.id: r for r in store.vgpu_records()}
    present = {m.uuid for m in inv.mdevs}
    taken_vfs = {str(v.vf): v.type_id for v in inv.vf_vgpus if v.type_id}
    for req in checked.vgpus:
        dev = req.device
        rec = records.get(dev)
        if rec is not None and rec.owner != me:
            raise RefusedError(f"vGPU {dev} is held by {_holder_text(store, rec.owner)}",
                               hint="each domain needs its own device: re-attach with a new one "
                                    "('vgpuhost detach' then 'vgpuhost attach')")
        if rec is None and (dev in present or dev in taken_vfs):
            what = f"an mdev {dev} exists" if dev in present else f"VF {dev} holds vGPU type {taken_vfs[dev]}"
            raise RefusedError(f"{what} that vgpuhost did not create: left alone",
                               hint="remove it with the tool that made it, or attach another device")
    if checked.passthrough:
        pt = {}
        for r in store.passthrough_records():
            pt[r.bdf] = r.owner
        for gpu, endpoints in checked.passthrough:
            for bdf in endpoints:
                owner = pt.get(str(bdf))
                if owner is None or owner == me:
                    continue
                if owner in POOL_OWNERS:
                    loose = [str(b) for b in endpoints if inv.devices[b].driver != "vfio-pci"]
                    if loose:
                        raise RefusedError(f"passthrough {gpu}: IOMMU group of {gpu} is held by "
                                           f"{_holder_text(store, owner)} but {', '.join(loose)} is not on "
                                           "vfio-pci", hint=f"run 'vgpuhost passthrough prepare {gpu}' again, or "
                                                            f"release it ('vgpuhost passthrough release {gpu}')")
                    checked.pooled.add(gpu)
                    break
                raise RefusedError(f"passthrough {gpu}: IOMMU group of {gpu} is held by "
                                   f"{_holder_text(store, owner)}",
                                   hint="it is given back when that domain stops")


# ---------------------------------------------------------------------------
# prepare begin / release end

def prepare(host: HostRoot, view: DomainView, *, actor: str) -> List[str]:
    """Make every device the domain's metadata names exist; returns what this call changed.

    All or nothing: on any failure what this call made is removed again
    (owner-guarded) before the error propagates.  Idempotent: devices the
    domain already holds (a retried start) are kept as they are.
    """
    meta = view.metadata
    if meta is None or meta.empty:
        return []
    from ..observe.inventory import discover
    from ..io.state import StateStore
    from ..io.sysfs import Sysfs
    inv = discover(Sysfs(host))
    checked = check_request(inv, view, load_allow(host))
    store = StateStore(host.state_dir)
    check_holders(inv, store, view, checked)
    if checked.vgpus:
        from ..ops import vgpu
        _resolve_profiles(vgpu, inv, store, checked)
    me = view.uuid
    was_active = me in store.active_domains()
    store.domain_started(me, view.name or me)
    made: List[Tuple[str, object]] = []
    from ..ops import tenancy
    try:
        # admission (issue 13): quota, isolation, QoS class, pool, under the host lock until recorded
        with tenancy.admitting(store, view, inv, actor=actor, allowed=checked.allowed) as grant:
            if checked.passthrough:
                from ..ops import passthrough
                for gpu, _ in checked.passthrough:
                    grant.made(str(gpu), str(gpu))
                    if gpu in checked.pooled:
                        continue                    # bound by the operator for guests: used as it is
                    out = passthrough.prepare(host, store, gpu, owner=me, actor=actor,
                                              boot_vga_fix=f"run 'vgpuhost passthrough prepare --allow-boot-vga "
                                                           f"{gpu}' if the host has another console, then start "
                                                           "the domain (the hook uses a group bound that way)")
                    if out.changed:
                        made.append(("passthrough", gpu))
            for req in checked.vgpus:
                # the inventory read above still describes the host while this call has changed nothing
                vid = _make_vgpu(host, store, view, req, grant.allowed_gpus(req.device, checked.allowed), actor,
                                 inv if not made else None)
                if vid is not None:
                    made.append(("vgpu", vid))
    except BaseException as e:
        failed = _undo(host, store, me, made, actor)
        if not was_active:
            try:
                store.domain_stopped(me)
            except Exception:
                pass
        if failed and isinstance(e, VgpuhostError):
            e.message += "; UNDO FAILED for " + ", ".join(failed)
        raise
    return [str(d) for _, d in made]


def _resolve_profiles(vgpu, inv: "Inventory", store: "StateStore", checked: Checked) -> None:
    """Every profile name must be one this host knows (on the pinned GPU / the VF's GPU) before any write."""
    records = store.vgpu_records()
    seen = store.seen_types() + vgpu.seen_rows(inv)
    for req in checked.vgpus:
        gpu = req.gpu
        if req.vf is not None:
            dev = inv.devices.get(req.vf)
            gpu = dev.physfn if dev is not None else None
        vgpu.resolve_profile(inv, records, req.profile, gpu, seen)


def _make_vgpu(host: HostRoot, store: "StateStore", view: DomainView, req, allowed, actor: str,
               inv: "Optional[Inventory]" = None) -> Optional[str]:
    """Create one requested vGPU; its id when this call made it, None when the domain already held it.

    ``inv``: a current inventory of the host, for the first placement look (None: read it anew).
    """
    from ..ops import vgpu
    meta = view.metadata
    me = view.uuid
    if req.vf is not None:
        out = vgpu.create(host, store, profile=req.profile, vf=req.vf, owner=me, strategy=meta.strategy,
                          anti_affinity=meta.anti_affinity, actor=actor, inventory=inv)
        return out.id if out.changed else None
    rec = next((r for r in store.vgpu_records(owner=me) if r.id == req.uuid), None)
    if rec is not None:
        from ..io.sysfs import Sysfs
        fs = Sysfs(host)
        current = fs.link_name(host.mdev_devices / req.uuid / "mdev_type")
        if current == rec.type_id and rec.type_name.lower() == req.profile.lower():
            return None                         # a retried start: the domain already holds it
        # stale (gone since, e.g. a host reboot) or the profile changed while stopped: make it anew
        vgpu.remove(host, store, req.uuid, owner=me, actor=actor)
        inv = None                              # the host changed
    try:
        out = vgpu.create(host, store, profile=req.profile, uuid=req.uuid, gpu=req.gpu, owner=me,
                          strategy=meta.strategy, anti_affinity=meta.anti_affinity, allowed_gpus=allowed,
                          actor=actor, inventory=inv)
    except RefusedError as e:
        if allowed is None:
            raise
        listed = ", ".join(sorted(map(str, allowed))) or "none"
        raise RefusedError(e.message, hint=f"the hook allow-list (etc/vgpuhost/hook.allow) lets the hook "
                                           f"place vGPUs only on: {listed}") from None
    return out.id


def _undo(host: HostRoot, store: "StateStore", me: str, made: List[Tuple[str, object]], actor: str) -> List[str]:
    """Remove what this prepare made, last first; the ids that could not be undone."""
    old = None
    try:
        old = signal.signal(signal.SIGTERM, signal.SIG_IGN)     # let the undo finish
    except ValueError:
        pass
    failed = []
    try:
        for kind, dev in reversed(made):
            try:
                if kind == "vgpu":
                    from ..ops import vgpu
                    vgpu.remove(host, store, str(dev), owner=me, actor=actor)
                else:
                    from ..ops import passthrough
                    passthrough.release(host, store, dev, owner=me, actor=actor)
            except Exception as e:
                failed.append(f"{dev} ({e})")
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return failed


def release(host: HostRoot, view: DomainView, *, actor: str) -> List[str]:
    """Remove the vGPUs and release the groups the domain holds; forget the domain.

    A domain that holds nothing (a start that never happened, a second
    release) is a no-op; no state store is created for it.  Every device is
    tried; the first failure raises DeviceError naming how many failed.
    """
    from ..io.state import DB_NAME, StateStore
    if not (host.state_dir / DB_NAME).is_file():
        return []
    return release_domain(host, StateStore(host.state_dir), view.uuid, actor=actor)


def release_domain(host: HostRoot, store: "StateStore", me: str, *, actor: str) -> List[str]:
    """``release end`` for the domain with UUID ``me``: see :func:`release`; the ids released."""
    done: List[str] = []
    errors: List[str] = []
    recs = store.vgpu_records(owner=me)
    if recs:
        from ..ops import vgpu
        for r in reversed(recs):
            try:
                vgpu.remove(host, store, r.id, owner=me, actor=actor)
                done.append(r.id)
            except VgpuhostError as e:
                errors.append(f"{r.id}: {e.message}")
    gpus = sorted({r.gpu for r in store.passthrough_records() if r.owner == me})
    if gpus:
        from ..ops import passthrough
        for g in gpus:
            try:
                passthrough.release(host, store, PciAddress.parse(g), owner=me, actor=actor)
                done.append(g)
            except VgpuhostError as e:
                errors.append(f"{g}: {e.message}")
    store.domain_stopped(me)
    from ..ops.tenancy import forget
    forget(store, owner=me)
    if errors:
        raise DeviceError(f"release left {len(errors)} device(s) held: " + "; ".join(errors),
                          hint="they stay recorded for this domain; fix the cause and run "
                               "'vgpuhost vgpu remove ID --owner UUID' / 'vgpuhost passthrough release BDF'")
    return done


# ---------------------------------------------------------------------------
# installing the dispatcher (``vgpuhost hook install|uninstall|status``)

def _template() -> str:
    from pathlib import Path
    return (Path(__file__).parent.parent / "hooks" / "qemu").read_text(encoding="utf-8")


def _sh_quote(text: str) -> str:
    if "\0" in text or "\n" in text:
        raise InputError(f"{text[:80]!r} cannot be written into the hook (newline or NUL)")
    return "'" + text.replace("'", "'\\''") + "'"


def render(host: HostRoot, *, python: Optional[str] = None, timeout_s: int = DEFAULT_TIMEOUT_S) -> str:
    """The dispatcher's text for ``host``: the template with the interpreter, sys.path, root and state dir.

    libvirt gives hooks a minimal environment (``PATH``, ``HOME``,
    ``LC_ALL=C``, REFERENCE.md §8), so all of it is baked in.  Python runs
    with ``-I -S`` (no site: no ``.pth`` processing, no user site) and an
    explicit ``sys.path``: the directory holding the ``vgpuhost`` package
    first, this interpreter's site-packages last.
    """
    import shutil
    import sysconfig
    from pathlib import Path
    from .. import __version__
    if not 1 <= timeout_s <= MAX_TIMEOUT_S:
        raise InputError(f"--timeout {timeout_s} is out of range", hint=f"1..{MAX_TIMEOUT_S} seconds")
    exe = python or sys.executable
    if not exe or not os.path.isabs(exe):
        raise InputError("cannot tell which Python runs vgpuhost (sys.executable is empty)",
                         hint="run 'vgpuhost hook install' with the interpreter vgpuhost is installed in")
    pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
    paths = [pkg_parent]
    purelib = sysconfig.get_paths().get("purelib")
    extra = [purelib] if purelib and purelib != pkg_parent else []
    boot = (f"import sys;sys.path[:0]={paths!r};sys.path.extend({extra!r});"
            "from vgpuhost.hook.handler import run;run()")
    tbin = shutil.which("timeout", path="/usr/bin:/bin")
    backstop = (f"{_sh_quote(tbin)} -k {BACKSTOP_KILL_S} {timeout_s + BACKSTOP_EXTRA_S} " if tbin else "")
    values = {
        "@VERSION@": __version__,
        "@MARKER@": MARKER,
        "@ROOT@": _sh_quote(str(host.root)),
        "@STATE_DIR@": _sh_quote(str(host.state_dir)),
        "@TIMEOUT_S@": str(int(timeout_s)),
        "@BACKSTOP@": backstop,
        "@PYTHON@": _sh_quote(exe),
        "@BOOT@": _sh_quote(boot),
    }
    text = _template()
    for key, value in values.items():
        text = text.replace(key, value)
    return text


class HookOutcome:
    """What install/uninstall did (``as_dict``: the ``vgpuhost.hook/v1`` document)."""

    def __init__(self, action: str, path: str, *, changed: bool, dry_run: bool, new: bool = False):
        self.action, self.path, self.changed, self.dry_run, self.new = action, path, changed, dry_run, new
        self.reload_needed = False
        self.compiled = False
        self.notes: List[str] = []

    def as_dict(self) -> dict:
        return {"schema": "vgpuhost.hook/v1", "action": self.action, "path": self.path, "changed": self.changed,
                "dry_run": self.dry_run, "new": self.new, "reload_needed": self.reload_needed,
                "compiled": self.compiled, "notes": self.notes}


def default_hooks_dir(host: HostRoot):
    """``<root>/etc/libvirt/hooks/qemu.d``: libvirt (>= 6.5) runs every executable there."""
    return host.libvirt_hooks / "qemu.d"


def _read(path) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except FileNotFoundError:
        return None


def _ours(text: Optional[str]) -> bool:
    return text is not None and any(line.startswith(MARKER) for line in text.splitlines()[:4])


RELOAD_HINT = ("libvirtd reads the hooks present when it starts: restart it or send it SIGHUP "
               "('systemctl reload libvirtd', or kill -HUP $(pidof libvirtd)) so it runs the new hook")


def install(host: HostRoot, *, hooks_dir=None, dry_run: bool = False, timeout_s: int = DEFAULT_TIMEOUT_S,
            python: Optional[str] = None, store: "Optional[StateStore]" = None, actor: Optional[str] = None) -> HookOutcome:
    """Write the dispatcher as ``<hooks_dir>/vgpuhost`` (mode 0755, atomically), byte-compile the package.

    Idempotent: an identical file is left alone.  Refuses (RefusedError) to
    overwrite a ``vgpuhost`` file it did not write.  Never signals libvirtd:
    the outcome says when it must be reloaded (a new file).  The write is
    audited when ``store`` is given.
    """
    from pathlib import Path
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    text = render(host, python=python, timeout_s=timeout_s)
    old = _read(path)
    if old is not None and not _ours(old):
        raise RefusedError(f"{path} exists and was not written by vgpuhost: left alone",
                           hint="move it aside, then run 'vgpuhost hook install' again")
    out = HookOutcome("install", str(path), changed=old != text, dry_run=dry_run, new=old is None)
    out.reload_needed = old is None
    if not out.changed:
        out.notes.append("the installed hook is up to date: nothing to do")
    if dry_run:
        return out
    if out.changed:
        _write_atomic(path, text, store=store, actor=actor, host=host)
    out.compiled = _compile()
    if out.reload_needed:
        out.notes.append(RELOAD_HINT)
    return out


def _write_atomic(path, text: str, *, store, actor: Optional[str], host: HostRoot) -> None:
    import errno as _errno
    err = 0
    tmp = path.with_name(f".{path.name}.vgpuhost-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o755)
        try:
            os.write(fd, text.encode("utf-8"))
            os.fchmod(fd, 0o755)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        err = e.errno or _errno.EIO
        try:
            os.unlink(tmp)
        except OSError:
            pass
        from ..model.errors import HostEnvironmentError
        raise HostEnvironmentError(f"cannot write {path}: {e.strerror}",
                                   hint="run as root, or pass --hooks-dir DIR") from None
    finally:
        if store is not None:
            store.audit(actor=actor or actor_name(), operation="hook install", path=host.relative(path),
                        value="<vgpuhost qemu hook>", err=err)


def _compile() -> bool:
    """Byte-compile the package so the hook never compiles on a domain start; False when not writable."""
    import compileall
    import contextlib
    import io
    from pathlib import Path
    try:
        with contextlib.redirect_stdout(io.StringIO()):        # keep --json output clean
            return bool(compileall.compile_dir(str(Path(__file__).parent.parent), quiet=2, workers=1))
    except OSError:
        return False


def uninstall(host: HostRoot, *, hooks_dir=None, dry_run: bool = False, store: "Optional[StateStore]" = None,
              actor: Optional[str] = None) -> HookOutcome:
    """Remove ``<hooks_dir>/vgpuhost`` when vgpuhost wrote it (marker line); absent is a no-op.

    Raises RefusedError for a file vgpuhost did not write.
    """
    from pathlib import Path
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    old = _read(path)
    if old is None:
        out = HookOutcome("uninstall", str(path), changed=False, dry_run=dry_run)
        out.notes.append("no vgpuhost hook is installed there: nothing to do")
        return out
    if not _ours(old):
        raise RefusedError(f"{path} was not written by vgpuhost: left alone",
                           hint="remove it by hand if it is yours to remove")
    out = HookOutcome("uninstall", str(path), changed=True, dry_run=dry_run)
    if dry_run:
        return out
    err = 0
    try:
        os.unlink(path)
    except FileNotFoundError:
        out.changed = False
    except OSError as e:
        err = e.errno or 5
        from ..model.errors import HostEnvironmentError
        raise HostEnvironmentError(f"cannot remove {path}: {e.strerror}", hint="run as root") from None
    finally:
        if store is not None:
            store.audit(actor=actor or actor_name(), operation="hook uninstall", path=host.relative(path),
                        value="<remove>", err=err)
    out.notes.append("domains starting from now on get no vgpuhost devices made for them")
    return out


def status(host: HostRoot, *, hooks_dir=None, timeout_s: int = DEFAULT_TIMEOUT_S,
           python: Optional[str] = None) -> dict:
    """``vgpuhost.hook-status/v1``: is the hook installed, current, where libvirt looks; the allow-list."""
    from pathlib import Path
    d = Path(hooks_dir) if hooks_dir is not None else default_hooks_dir(host)
    path = d / HOOK_NAME
    text = _read(path)
    installed = text is not None
    ours = _ours(text)
    current = bool(installed and ours and text == render(host, python=python, timeout_s=timeout_s))
    if installed and ours and not current:
        current = _same_but_timeout(text, host, python)
    executable = installed and os.access(path, os.X_OK)
    allow: Dict[str, object] = {"path": host.relative(allow_path(host))}
    try:
        entries = load_allow(host)
        allow["present"] = allow_path(host).exists()
        allow["gpus"] = None if entries is None else sorted(str(g) for g in entries)
        allow["error"] = None
        allow["summary"] = ("every NVIDIA GPU (no allow-list file)" if not allow["present"] else
                            "every NVIDIA GPU ('*')" if entries is None else
                            "no GPU (the file lists none)" if not entries else
                            ", ".join(allow["gpus"]))
    except VgpuhostError as e:
        allow.update(present=True, gpus=[], error=e.one_line(), summary="unreadable: the hook refuses every GPU domain")
    return {"schema": "vgpuhost.hook-status/v1", "path": str(path), "hooks_dir": str(d),
            "hooks_dir_exists": d.is_dir(), "installed": installed, "written_by_vgpuhost": ours,
            "current": current, "executable": executable,
            "libvirt_hooks_dir": str(d.parent), "libvirt_hooks_dir_exists": d.parent.is_dir(),
            "allow": allow, "ok": bool(installed and ours and current and executable and not allow["error"])}


def _same_but_timeout(text: str, host: HostRoot, python: Optional[str]) -> bool:
    """An installed hook that differs only in its ``--timeout`` is current too."""
    for line in text.splitlines():
        if line.startswith("VGPUHOST_HOOK_TIMEOUT="):
            try:
                t = int(line.split("=", 1)[1].strip("'"))
            except ValueError:
                return False
            return 1 <= t <= MAX_TIMEOUT_S and text == render(host, python=python, timeout_s=t)
    return False


if __name__ == "__main__":
    run()
