"""Cheap change detection for a warm host snapshot (the agent's).

Owns: :func:`fingerprint`, a small value that changes when the host's
devices or vgpuhost's records change: the entries of the mdev bus, the
functions bound to ``vfio-pci`` and ``nvidia``, each VF's
``current_vgpu_type`` (vendor-specific VFIO), and the state store's files
(size and modification time).  Comparing two fingerprints costs a handful
of directory listings and small reads, far less than a discovery.
Must not: interpret what it reads.

What it cannot see: a change that moves none of those (a vGPU type's
``available_instances`` changing because of another tool's MIG change, for
example).  The agent also re-reads, after each of its own writes, the GPUs the
write touched (or the whole host).
"""

from __future__ import annotations

import os
from typing import Iterable, Tuple

from .hostroot import HostRoot
from .vgpudev import CURRENT_TYPE_ATTR, NVIDIA_DIR

#: state store files whose (size, mtime) say the records changed
STATE_FILES = ("state.db", "state.db-wal")


def _listing(path) -> "Tuple[str, ...]":
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError:
        return ()


def _stat(path) -> "Tuple[int, int]":
    try:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns)
    except OSError:
        return (-1, -1)


def _read(path) -> str:
    # os.open/os.read, not open(): no buffered file object per file (a fingerprint reads every VF's type,
    # several times a hook call in the agent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
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
    """A hashable value that differs when ``host``'s devices or records change (module docstring).

    ``vfs``: BDFs of vendor-VFIO VFs whose ``current_vgpu_type`` to include
    (the snapshot's, so the cost stays linear in devices).
    """
    # paths as text from one base each (a pathlib or posixpath join per VF cost more than its read); the
    # VFs' files read relative to bus/pci/devices, opened once (an L40S's 16 VFs, each fingerprint)
    base = host.s.pci_devices
    tail = f"{NVIDIA_DIR}/{CURRENT_TYPE_ATTR}"          # vf_type_path's, after the VF's directory
    state = host.s.state_dir
    return (
        _listing(host.s.mdev_devices),
        _listing(host.s.pci_driver("vfio-pci")),
        _listing(host.s.pci_driver("nvidia")),
        _read_all(base, [f"{vf}/{tail}" for vf in vfs]),
        tuple(_stat(f"{state}/{name}") for name in STATE_FILES),
    )
