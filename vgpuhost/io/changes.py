"""Cheap change detection for a warm host snapshot (the agent's).

Owns: :func:`fingerprint`, a small value that changes when the host's
devices change: the entries of the mdev bus, the functions bound to
``vfio-pci`` and ``nvidia``, each VF's ``current_vgpu_type``
(vendor-specific VFIO), and the driver-state token (:func:`note_driver_change`).
Comparing two fingerprints costs a handful of directory listings and small
reads, far less than a discovery.  Also owns that token: a file in the state
dir (:data:`DRIVER_TOKEN`) that every vgpuhost process rewrites after an NVML
write that changes what a GPU offers (MIG mode, a GPU instance made or
destroyed, mixed-size mode: :attr:`vgpuhost.plan.steps.Step.moves_offers`),
whatever its process, so the agent sees a ``--local`` or one-shot MIG change
too (trial 8 T1).
Must not: interpret what it reads.

What it cannot see: a change that moves none of those.  The MIG state lives
in the NVIDIA driver, behind NVML (docs/reference/hardware.md#mig-backed-vgpus):
a GPU instance made with ``nvidia-smi`` or another NVML client moves only the
counts of the GPU's types (``available_instances``, read per type: hundreds of
files on an SR-IOV GPU; a vendor-VFIO VF's ``creatable_vgpu_types``), none of
the files above.  The agent also re-reads,
after each of its own writes, the GPUs the write touched (or the whole host),
and a start it would refuse for room or for a missing GPU instance is looked at
again on a fresh read of the host first (:func:`vgpuhost.ops.vgpu.create_vgpu`).
"""

from __future__ import annotations

import fcntl
import os
import stat
from _thread import allocate_lock
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from .hostroot import HostRoot
from .vgpudev import CURRENT_TYPE_ATTR, NVIDIA_DIR

#: the driver-state token's file in the state dir (:func:`note_driver_change`)
DRIVER_TOKEN = "driver-state.token"


def _listing(path) -> "Tuple[str, ...]":
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError:
        return ()


def _read(path) -> str:
    # os.open/os.read, not open(): no buffered file object per file (a fingerprint reads every VF's type,
    # several times a hook call in the agent); O_NONBLOCK: a FIFO put there never blocks the reader
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _read_token(path: str) -> str:
    """The driver-state token at ``path``: a regular file's first 64 bytes, never through a symbolic link
    (O_NOFOLLOW: a link to a device such as /dev/urandom would move the token at every read, and with it
    a whole read of the host per request: trial 8 retest R3); "" for none or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _read_all(base: str, names: "Iterable[str]") -> "Tuple[str, ...]":
    """:func:`_read` of ``base/<name>`` for each of ``names``, ``base`` opened once and each file opened
    relative to it (``openat(2)``: the path up to ``base`` walked once, not once per file)."""
    names = tuple(names)
    if not names:
        return ()
    try:
        dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return tuple(_read(f"{base}/{n}") for n in names)
    out = []
    flags = os.O_RDONLY | os.O_CLOEXEC
    open_, read, close = os.open, os.read, os.close
    try:
        for n in names:
            try:
                fd = open_(n, flags, dir_fd=dfd)
            except OSError:
                out.append("")
                continue
            try:
                out.append(read(fd, 256).decode("ascii", "replace").strip())
            except OSError:
                out.append("")
            finally:
                close(fd)
    finally:
        close(dfd)
    return tuple(out)


def fingerprint(host: "HostRoot", vfs: "Iterable[str]" = ()) -> tuple:
    """A hashable value that differs when ``host``'s devices change (module docstring):
    ``(mdev bus entries, vfio-pci functions, nvidia functions, the VFs' current types, driver token)``.

    ``vfs``: BDFs of vendor-VFIO VFs whose ``current_vgpu_type`` to include
    (the snapshot's, so the cost stays linear in devices).
    """
    # paths as text from one base each (a pathlib or posixpath join per VF cost more than its read); the
    # VFs' files read relative to bus/pci/devices, opened once (an L40S's 16 VFs, each fingerprint)
    base = host.s.pci_devices
    tail = f"{NVIDIA_DIR}/{CURRENT_TYPE_ATTR}"          # vf_type_path's, after the VF's directory
    return (
        _listing(host.s.mdev_devices),
        _listing(host.s.pci_driver("vfio-pci")),
        _listing(host.s.pci_driver("nvidia")),
        _read_all(base, [f"{vf}/{tail}" for vf in vfs]),
        _read_token(f"{host.s.state_dir}/{DRIVER_TOKEN}"),
    )


#: the tokens this process wrote: token -> (the token it replaced, the GPU its change was on, "" unknown);
#: :func:`own_changes` follows them back (bounded: cleared when full, which then reads as another's change)
_OWN: "Dict[str, Tuple[str, str]]" = {}
_OWN_LOCK = allocate_lock()
_OWN_MAX = 1024


def own_changes(before: str, after: str) -> "Optional[FrozenSet[str]]":
    """The GPUs (BDF text) of this process's own token writes that lead from token ``before`` to ``after``
    (empty when they are equal); None when another process wrote one of them (or one is not known), or a
    write did not name its GPU.  The agent explains a moved token by its own change on those GPUs alone
    (a MIG on demand start re-reads its GPU, not the whole host: trial 8 retest R1)."""
    gpus = set()
    token = after
    with _OWN_LOCK:
        for _ in range(_OWN_MAX + 1):
            if token == before:
                return frozenset(gpus)
            step = _OWN.get(token)
            if step is None or not step[1]:
                return None
            token, gpu = step
            gpus.add(gpu)
    return None


def note_driver_change(host: "HostRoot", gpu: str = "") -> None:
    """Rewrite the driver-state token (:data:`DRIVER_TOKEN` in ``host``'s state dir) with a value never
    used before, after an NVML write that changes what a GPU offers (made or failed: either may have
    moved the driver's state), so every :func:`fingerprint` taken before differs from those taken after.

    A temporary file of this process's own renamed over it (atomic: a reader sees the old token or
    the new one); not synced (the driver's MIG state does not outlive a reboot either).  Never raises:
    a token that cannot be written (no state dir) costs only the agent's notice of the change."""
    path = f"{host.s.state_dir}/{DRIVER_TOKEN}"
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
    token = os.urandom(12).hex()
    lock = None
    try:
        # the token read and replaced under a lock of its own: the replaced token this process remembers is
        # the one that stood just before, never one another process wrote between (own_changes)
        lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:
        if lock is not None:
            os.close(lock)
        lock = None
    try:
        before = _read_token(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, (token + "\n").encode("ascii"))
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if lock is not None:        # unlocked, a write of another process may have come between: not ours
            with _OWN_LOCK:
                if len(_OWN) >= _OWN_MAX:
                    _OWN.clear()
                _OWN[token] = (before, gpu)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    finally:
        if lock is not None:
            os.close(lock)          # closing the descriptor releases the flock
