"""`vgpuhost sim specs|create|libvirtd`: simulated hosts, to try vgpuhost without a GPU.

The commands of the simulator itself: they use :mod:`vgpuhost.sim` directly (its
specs and builder), as no other command does.
"""

from __future__ import annotations

import errno as errnos
import sys
from pathlib import Path
from typing import List

import click

from ..hook import install as hookmod
from ..io import files
from ..io.hostroot import HostRoot
from ..model.errors import EXIT_PROBLEMS, InputError
from ..model.values import PciAddress
from ..io.sysfs import Sysfs
from ..observe.inventory import discover
from ..sim.build import materialise
from ..sim.data import bundled_specs
from ..sim.kernel import SimKernel
from ..sim.libvirtd import kept, keep_reload, keep_start, keep_stop
from ..sim.nvml import SimNvml
from ..sim.reboot import note_libvirtd, reboot
from ..sim.spec import load_spec
from .common import Context, emit, pass_ctx, store
from .output import table


@click.group()
def sim() -> None:
    """Simulated hosts: try vgpuhost without a GPU."""


@sim.command("specs")
@pass_ctx
def sim_specs(ctx: Context) -> None:
    """List the host specs shipped with vgpuhost."""
    rows = []
    for name, path in bundled_specs().items():
        rows.append([name, load_spec(path).summary])
    emit(ctx, {"schema": "vgpuhost.sim-specs/v1", "specs": [{"name": r[0], "summary": r[1]} for r in rows]},
          table(["NAME", "SUMMARY"], rows))


def _complete_spec(ctx: click.Context, param: click.Parameter, incomplete: str) -> List[str]:
    """The shipped host specs' names (shell completion of ``sim create SPEC``)."""
    return [name for name in bundled_specs() if name.startswith(incomplete)]


@sim.command("create")
@click.argument("spec", shell_complete=_complete_spec)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace a simulated host already at DIRECTORY.")
@pass_ctx
def sim_create(ctx: Context, spec: str, directory: str, force: bool) -> None:
    """Build a simulated host from SPEC (a file or a shipped name) at DIRECTORY."""
    specs = bundled_specs()
    if "/" not in spec and not spec.endswith((".yaml", ".yml")):
        if spec not in specs:       # a bare name is a shipped spec; a file is named by a path
            raise InputError(f"no host spec {spec!r}",
                             hint="name a YAML file (./my-host.yaml) or one of: " + ", ".join(specs))
        path = specs[spec]
    else:
        path = Path(spec)
    hs = load_spec(path)
    host_root = materialise(hs, directory, force=force)
    doc = {"schema": "vgpuhost.sim-create/v1", "name": hs.name, "root": str(host_root.root)}
    emit(ctx, doc, f"simulated host {hs.name!r} at {host_root.root}\n"
                    f"use: vgpuhost --root {host_root.root} host check   (or export VGPUHOST_ROOT=...)")


@sim.command("fail")
@click.argument("bdf")
@click.option("--lost", is_flag=True, help="NVML answers GPU_IS_LOST for it from now on.")
@click.option("--found", is_flag=True, help="NVML sees it again (undoes --lost; refused when it is not lost).")
@click.option("--xid", type=click.IntRange(1, 65535), metavar="N", help="Queue an Xid event N (NVML's event API).")
@click.option("--unplug", is_flag=True, help="It disappears from the PCI tree (its VFs too).")
@click.option("--create-errno", metavar="NAME", help="Every vGPU create on it fails with this errno (EIO, ENODEV).")
@click.option("--write-errno", metavar="NAME",
              help="Every driver-binding write on it (driver_override, bind, unbind, drivers_probe) fails with this "
                   "errno, and every NVML write (MIG, scheduler) with GPU_IS_LOST for EIO/ENODEV.")
@click.option("--repair", is_flag=True,
              help="Undo every fault given here: back in the tree, NVML sees it, no queued Xid, creates work.")
@pass_ctx
def sim_fail(ctx: Context, bdf: str, lost: bool, found: bool, xid: int, unplug: bool, create_errno: str,
             write_errno: str, repair: bool) -> None:
    """Make the simulated GPU at BDF fail, as a real one does, or repair it (docs/guide/failures.md);
    --root names the host.  One option at a time (exit 2 otherwise)."""
    addr = PciAddress.parse(bdf)
    host = ctx.host
    if not host.is_simulated:
        raise InputError(f"{host.root} is not a simulated host", hint="pass --root DIR of one 'vgpuhost sim create' made")
    given = [name for name, x in (("--lost", lost), ("--found", found), ("--xid", xid), ("--unplug", unplug),
                                  ("--create-errno", create_errno), ("--write-errno", write_errno),
                                  ("--repair", repair)) if x]
    if len(given) != 1:
        raise InputError(("give one of" if not given else f"{' and '.join(given)} do not go together: give one of")
                         + " --lost, --found, --xid N, --unplug, --create-errno NAME, --write-errno NAME, --repair",
                         hint="nothing was changed")
    k = SimKernel(host)
    present = [g.address for g in discover(Sysfs(host), with_types=False).gpus]
    if addr not in present and not (repair and k.is_unplugged(str(addr))):
        # every option: a fault on no GPU of the host would be silently stored
        why = " (it is unplugged: 'sim fail --repair' puts it back)" if k.is_unplugged(str(addr)) else ""
        raise InputError(f"no NVIDIA GPU at {addr} on the simulated host {host.root}{why}",
                         hint="GPUs there: " + (", ".join(map(str, present)) or "none") + " ('vgpuhost gpus')")
    nv = SimNvml(host)
    if lost:
        nv.lose(addr, True)
        what = "NVML: GPU_IS_LOST"
    elif found:
        if not nv.gpu_lost(addr):
            raise InputError(f"NVML does not report {addr} lost: there is nothing for --found to undo",
                             hint="--found undoes --lost; --repair undoes every fault; nothing was changed")
        nv.lose(addr, False)
        what = "NVML sees it again"
    elif xid:
        nv.inject_xid(addr, xid)
        what = f"Xid {xid} queued"
    elif unplug:
        k.unplug(str(addr))
        what = "gone from the PCI tree"
    elif repair:
        what = "repaired: " + (", ".join(_repair(k, nv, addr)) or "nothing to undo")
    else:
        name, ops = (create_errno, CREATE_OPS) if create_errno else (write_errno, WRITE_OPS)
        number = getattr(errnos, name, None)
        if not isinstance(number, int) or not name.startswith("E"):
            raise InputError(f"unknown errno name {name!r}", hint="e.g. EIO, ENODEV")
        with k.locked():
            meta = k.meta()
            # a later one replaces the one given before (the first matching fault would win)
            meta["faults"] = [f for f in meta.get("faults", []) if not _injected(f, addr, ops)]
            for op in ops:
                meta.setdefault("faults", []).append({"op": op, "device": str(addr), "errno": number, "count": 0})
            k.save_meta(meta)
        what = (f"every vGPU create fails with {name}" if create_errno else
                f"every driver-binding and NVML write fails with {name}")
    emit(ctx, {"schema": "vgpuhost.sim-fail/v1", "gpu": str(addr), "fault": what}, f"{addr}: {what}")


#: the simulated kernel's fault ops of a vGPU create: an mdev create, a VF's current_vgpu_type (vendor VFIO)
CREATE_OPS = ("create", "set_type")
#: ``--write-errno``'s: the driver-binding writes (passthrough) and NVML's writes (MIG, scheduler)
WRITE_OPS = ("driver_override", "bind", "unbind", "probe", "nvml")


def _injected(f: dict, addr: PciAddress, ops=CREATE_OPS + WRITE_OPS) -> bool:
    """Is ``f`` (a fault of host.json) one ``--create-errno`` or ``--write-errno`` (``ops``) gave ``addr``?"""
    return f.get("device") == str(addr) and f.get("op") in ops and f.get("count") == 0


def _repair(k: SimKernel, nv: SimNvml, addr: PciAddress) -> List[str]:
    """Undo what ``sim fail`` did to ``addr``: what was undone, one phrase each."""
    done = []
    if k.is_unplugged(str(addr)):
        k.replug(str(addr))
        done.append("back in the PCI tree")
    with k.locked():
        meta = k.meta()
        faults = meta.get("faults") or []
        kept = [f for f in faults if not _injected(f, addr)]
        gpu = (meta.get("gpus") or {}).get(str(addr)) or {}
        queued = gpu.pop("xid_events", None)
        if len(kept) != len(faults) or queued:
            meta["faults"] = kept
            k.save_meta(meta)
        if any(_injected(f, addr, CREATE_OPS) for f in faults):
            done.append("vGPU creates work")
        if any(_injected(f, addr, WRITE_OPS) for f in faults):
            done.append("device writes work")
        if queued:
            done.append(f"{len(queued)} queued Xid event(s) dropped")
    if nv.gpu_lost(addr):
        nv.lose(addr, False)
        done.append("NVML sees it")
    return done


@sim.group("libvirtd")
def sim_libvirtd() -> None:
    """A real libvirtd in private namespaces, kept running for trying VMs by hand."""


_WORKDIR = click.argument("workdir", type=click.Path(file_okay=False))


def _workdir(text: str) -> Path:
    """The daemon's work directory, absolute; an empty one is refused (it would be the current directory)."""
    if not text.strip():
        raise InputError("the work directory is empty", hint="name a directory for the daemon's state, e.g. /tmp/lv")
    return Path(files.real_path(text))


def _daemon_doc(workdir: str, doc, running: bool):
    return {"schema": "vgpuhost.sim-libvirtd/v1", "workdir": str(Path(workdir).absolute()), "running": running,
            "uri": doc and doc.get("uri"), "hooks_dir": doc and doc.get("hooks_dir"), "pid": doc and doc.get("libvirtd")}


@sim_libvirtd.command("start")
@_WORKDIR
@click.option("--hook", is_flag=True,
              help="First install vgpuhost's qemu hook for --root (a simulated host) in the daemon's hooks directory.")
@pass_ctx
def sim_libvirtd_start(ctx: Context, workdir: str, hook: bool) -> None:
    """Start Debian's libvirtd with all its state under WORKDIR (private mount and network namespaces,
    the machine's own libvirt untouched), kept running after this command exits; idempotent.

    With --hook, domains started there run vgpuhost's hook against --root.  Needs root, util-linux
    unshare and Debian's libvirt-daemon, libvirt-clients and qemu-system-x86 (exit 2 when missing)."""
    where = _workdir(workdir)
    if hook:
        if not ctx.host.is_simulated:
            raise InputError("--hook needs --root to name a simulated host (vgpuhost sim create)",
                             hint="the daemon's hooks would otherwise act on this machine's GPUs")
        root = Path(files.real_path(ctx.host.root))
        if where == root or root in where.parents:
            raise InputError(f"the work directory {where} is inside the simulated host {root}",
                             hint="give the daemon a directory of its own (its etc/ and run/ are libvirt's)")
        hooks_dir = where / "etc" / "hooks" / "qemu.d"                  # IsolatedLibvirtd.hooks_dir
        running = kept(where) is not None
        if not files.is_dir(hooks_dir):
            files.make_dirs(hooks_dir)
        hookmod.install(ctx.host, hooks_dir=str(hooks_dir), store=store(ctx))     # idempotent
        note_libvirtd(ctx.host, where)          # 'sim reboot' of this host stops it
        if running:
            keep_reload(where)           # libvirtd reads its hooks at start and on SIGHUP
    doc = keep_start(where)
    uri = doc["uri"]
    emit(ctx, _daemon_doc(workdir, doc, True),
         f"libvirtd running in {Path(workdir).absolute()} (pid {doc['libvirtd']})\n"
         f"use: virsh -c '{uri}' list --all\n"
         f"     vgpuhost --root {ctx.host.root if hook else 'ROOT'} --connect '{uri}' attach DOMAIN --profile PROFILE\n"
         f"stop: vgpuhost sim libvirtd stop {workdir}")


@sim_libvirtd.command("stop")
@_WORKDIR
@pass_ctx
def sim_libvirtd_stop(ctx: Context, workdir: str) -> None:
    """Stop the libvirtd kept in WORKDIR: its running domains are destroyed first (their hooks run)."""
    stopped = keep_stop(_workdir(workdir))
    emit(ctx, dict(_daemon_doc(workdir, None, False), stopped=stopped),
         f"stopped the libvirtd in {workdir}" if stopped else f"no libvirtd runs in {workdir}")


@sim_libvirtd.command("status")
@_WORKDIR
@pass_ctx
def sim_libvirtd_status(ctx: Context, workdir: str) -> None:
    """Whether a libvirtd is kept in WORKDIR, and its URI (exit 1 when none runs)."""
    doc = kept(_workdir(workdir))
    emit(ctx, _daemon_doc(workdir, doc, doc is not None),
         f"running: {doc['uri']} (pid {doc['libvirtd']})" if doc else f"no libvirtd runs in {workdir}")
    if doc is None:
        sys.exit(EXIT_PROBLEMS)


@sim.command("reboot")
@click.argument("root", required=False, type=click.Path(file_okay=False))
@pass_ctx
def sim_reboot(ctx: Context, root: str) -> None:
    """Reboot the simulated host ROOT (default: --root), as a real reboot leaves it before vgpuhost's
    boot units run.

    Every vGPU, GPU instance, driver_override and process is gone, mixed-size mode and the NVML
    scheduler are reset, MIG mode stays; devices bind by driverctl overrides, vfio-pci ids= or as
    booted, and mdevctl starts its auto definitions.  A libvirtd kept for ROOT ('sim libvirtd start
    --hook') is stopped first.  Files under etc/ and var/ (the state store) stay.  Then run the boot
    units' commands (docs/guide/simulator.md#reboot)."""
    host = ctx.host
    if root is not None:
        host = HostRoot.from_env(root)
    if not host.is_simulated:
        raise InputError(f"{host.root} is not a simulated host",
                         hint="name the root of one 'vgpuhost sim create' made (sim reboot ROOT)")
    done = reboot(host)
    prefix = f"vgpuhost --root {host.root}"
    config = host.root / "etc" / "vgpuhost" / "config.yaml"
    # the layout unit's ConditionPathExists=: without a config it is skipped
    layout = [f"{prefix} config check -c {config}", f"{prefix} apply -c {config}"] if files.is_file(config) else []
    doc = {"schema": "vgpuhost.sim-reboot/v1", "root": str(host.root), **done,
           "next": [f"{prefix} reconcile --forget-domains", *layout, f"{prefix} reconcile"]}
    lines = [f"rebooted the simulated host {host.root}"]
    if done["libvirtd_stopped"]:
        lines.append("stopped libvirtd in " + ", ".join(done["libvirtd_stopped"]))
    lines.append(f"vGPUs lost: {len(done['vgpus_lost'])}; GPU instances lost: "
                 f"{sum(done['gpu_instances_lost'].values())}")
    if done["mdevctl_started"]:
        lines.append("mdevctl started: " + ", ".join(done["mdevctl_started"]))
    for f in done["mdevctl_failed"]:
        lines.append(f"mdevctl could not start {f['uuid']} on {f['parent']}: {f['error']}")
    lines.append("the boot units restore the rest (docs/guide/boot-units.md), as systemd runs them:")
    lines += [f"  {c}" for c in doc["next"]]
    emit(ctx, doc, "\n".join(lines))


COMMANDS: List[click.Command] = [sim]
