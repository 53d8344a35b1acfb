"""The simulated kernel: what happens when vgpuhost writes to a simulated tree.

Owns: applying kernel semantics to writes under a simulated host root —
mdev ``create``/``remove``, ``nvidia/current_vgpu_type``, ``driver_override``,
driver ``bind``/``unbind`` and ``drivers_probe`` — by changing the tree on
disk exactly as the kernel would lay it out, under a lock so separate
processes see one host.  Failures raise ``OSError`` with the errno the
kernel returns (docs/reference/hardware.md#pci-and-iommu, #mdev, #vendor-vfio); :mod:`vgpuhost.sysfs` wraps them.
Must not: be imported on a real host (``Sysfs`` only loads it when the root
holds ``.vgpuhost-sim/host.json``).

What a write does, by the file written (the path is resolved first, so a
write through ``bus/pci/devices/<BDF>`` or ``bus/mdev/devices/<uuid>`` lands
on the device directory, as in sysfs):

- ``<parent>/mdev_supported_types/<type>/create`` (a UUID): a new mdev laid
  out as mdev devices are in sysfs (docs/reference/hardware.md#mdev),
  with a new IOMMU group of its own, a ``driver`` link to ``nvidia-vgpu-vfio`` and its
  ``dev/vfio/<group>`` node.  EINVAL (bad UUID, unknown type), EEXIST (UUID
  in use), ENOSPC (no instance left, computed by :mod:`.capacity`).
- ``<mdev>/remove`` (``1``): undoes create.  EINVAL (other value).  While
  the mdev is open (:meth:`SimKernel.open_vgpu`: a qemu holding it) the write
  does not fail: it blocks until the last holder closes it
  (:meth:`SimKernel.close_vgpu`), then removes it, as the kernel does since
  Linux 5.8 (``mdev_device_remove()`` returns only 0, ENODEV or EAGAIN;
  ``vfio_unregister_group_dev()`` waits for the device's release and sends the
  driver's ``request`` to the holder meanwhile, counted in the holder's
  ``requests``; docs/reference/hardware.md#mdev).  Nothing returns EBUSY.  The
  ``remove`` file goes as the write starts (``remove_store()`` removes itself):
  a second writer while the first waits gets ENOENT.
  Both create and ``current_vgpu_type`` give ENODEV while the parent / VF
  is not bound to ``nvidia`` (no vGPU manager behind it); an mdev parent
  off ``nvidia`` shows no ``mdev_supported_types`` and no ``class/mdev_bus``
  link at all (:meth:`SimKernel.sync_mdev_parent`), so its ``create`` files
  are missing (ENOENT).
- ``<VF>/nvidia/current_vgpu_type`` (decimal; docs/reference/hardware.md#vendor-vfio): EINVAL
  (not decimal, unknown type), EPERM (a vGPU exists and non-zero written, or
  none and ``0`` written, or ``0`` written while the VF is open: the driver's
  usage count is not zero), ENOSPC (type not creatable now).  Never blocks.
- ``<mdev>/nvidia/vgpu_params``: the driver keeps ``count - 1`` bytes of the
  write (it expects ``echo``'s newline, whatever the last byte is) and shows
  them with a newline; E2BIG when the write is over 1024 bytes, EPERM while
  the mdev is open (docs/reference/hardware.md#mdev).  A VF's ``nvidia/`` has
  no ``vgpu_params`` (ENOENT, #vendor-vfio).
- ``driver_override``: stored; an empty value (or a lone newline) clears it
  to ``(null)``.
- ``bus/pci/drivers/<drv>/bind|unbind`` and ``bus/pci/drivers_probe`` (a
  BDF): driver links on both sides; ``dev/vfio/<group>`` exists while some
  member of the group is bound to vfio-pci.  A driver matches a device when
  ``driver_override`` names it, or, with no override, when it is the
  device's native driver (so vfio-pci only through the override, unless the
  spec booted the device on vfio-pci).  vfio-pci never binds a PF with SR-IOV
  VFs enabled (``sriov_numvfs`` > 0): bind gives EBUSY, drivers_probe binds
  nothing, as the kernel's vfio-pci probe refuses it.  unbind: ENODEV (not bound there),
  EBUSY (vGPUs on the GPU/VF; ``nvidia-persistenced`` holding a GPU —
  the real unbind hangs instead, docs/reference/hardware.md#pci-and-iommu).  bind: ENODEV (unknown
  device, no match), EBUSY (already bound).  drivers_probe succeeds even
  when nothing binds; ENODEV for an unknown device only.
- read-only attributes: EACCES; write-only files (``reset``, ``new_id``...)
  accept a write and stay empty; any other existing file takes the value;
  a missing path gives ENOENT (nothing is created); a directory EISDIR.

Open devices (what a running qemu holds): :meth:`SimKernel.open_vgpu` records
a holder in meta ``opened`` (``{pid: {vgpu, comm, via, requests}}``) and lays
out what a real host shows of it: ``proc/<pid>/comm`` and ``proc/<pid>/fd/``
links, one to ``anon_inode:[vfio-device]`` (the device fd) and, when ``via``
is ``group``, one to ``/dev/vfio/<group>`` (the group fd qemu keeps open);
``via`` ``device`` models a holder that closed its group fd, which only the
kernel still sees.  :meth:`SimKernel.close_vgpu` closes it again.

Injected faults (meta ``faults``, see :mod:`.spec`) fire when a request
passed every check above and the operation is about to happen (the driver's
probe / remove / the vGPU manager's create), so nothing changes when one
fires and a request refused anyway does not use one up; a probe fault fires
for an existing, unbound device.  ``count`` > 0
counts down and the fault is dropped when spent; 0 fires every time.  A
``read`` fault (``attr``: the attribute's name) fails the read(2) of that
attribute of its device (of a VF, or of its PF's VFs too) with its errno,
as a driver's show function that fails does (:meth:`SimKernel.read`).

A writer killed inside a write (docs/guide/simulator.md#killed-writer): the kernel's mdev create and
remove are one write(2), done whole or not at all, but the simulator lays a device out file by file
in the writing process.  So it records the change first (``state.json`` ``mdev_change``), makes the
bus link last on a create and takes it away first on a remove, and each later write (and
``sim reboot``) first takes away whatever a killed writer left half made
(:meth:`SimKernel._settle_mdev_change`); so does the first read after it (:meth:`SimKernel.settle`: a
:class:`~vgpuhost.io.sysfs.Sysfs`'s first read and each simulated NVML query, while the file
:data:`~vgpuhost.io.sysfs.SIM_UNSETTLED` says a change is under way), so no reader counts half a device.  A remove waiting for a release is listed
(``mdev_removing``) and finished by the last close, even where its writer was killed.

Crash injection (the kill -9 fault-injection tests): with
``VGPUHOST_SIM_KILL_AT=N`` in the environment, the process SIGKILLs itself
at its Nth write through this kernel or the simulated NVML (counted per
process from 1, refused writes included).  ``VGPUHOST_SIM_KILL_WHEN=before`` (the default) kills
before the write lands, ``after`` once it has landed (or been refused), so
every point between two writes, and between a write and its record, can be
hit.  Unset, nothing changes.  ``VGPUHOST_SIM_WRITE_LOG=FILE`` appends one
line per write that landed (``path<TAB>value``, as the audit log spells
them), so a test can check that no completed write went unaudited.

Time accounting (the benchmarks' split between vgpuhost's own cost and the
simulated kernel's, which a real kernel does not pay the same way): with
``VGPUHOST_SIM_TIME_FILE=FILE`` in the environment, every process appends
one line per charge to FILE, ``WALL CPU PID``: the seconds (decimal; wall clock,
then the thread's CPU time) and the charging process's id (a benchmark subtracts the simulator's CPU
from the process that spent it: ``bench/hook.py`` counts the agent's writer processes' CPU apart from the
agent's) spent importing this module (once, at the first :class:`SimKernel`) and inside each
:meth:`SimKernel.write`.  Unset, nothing is measured or written.  A resident writer (the agent's,
:mod:`vgpuhost.io.residentwriter`) takes this variable and ``VGPUHOST_SIM_WRITE_LOG`` from the process that
hands it each write (:meth:`SimKernel.writer_env`), so it charges and logs where that process would now.
"""

from __future__ import annotations

from time import perf_counter as _perf_counter
from time import thread_time as _thread_time

_IMPORT_T0 = _perf_counter()
_IMPORT_C0 = _thread_time()

import errno
import fcntl
import json
import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ..io.hostroot import HostRoot
from ..io.sysfs import SIM_READ_FAULTS, SIM_UNSETTLED
from ..io.vfioholders import group_node
from ..io.vgpudev import PLACEMENT_ATTR
from ..model import mixedsize
from ..model.values import is_digits
from .capacity import gpu_available, grid_units, taken_of

#: the driver NVIDIA's vGPU manager binds every mdev to
MDEV_DRIVER = "nvidia-vgpu-vfio"
#: the GPU driver (the vGPU manager registers mdev parents while it is bound)
NVIDIA = "nvidia"
VFIO_PCI = "vfio-pci"
PERSISTENCED = "nvidia-persistenced"
#: beside host.json: the attribute names a ``read`` fault is injected for, one a line (written when
#: the host is built); :class:`vgpuhost.io.sysfs.Sysfs` asks :meth:`SimKernel.read` only about files of
#: those names, so other reads never load the simulator
READ_FAULTS_FILE = SIM_READ_FAULTS

#: compiled on first use (re caches them)
_UUID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
_DECIMAL_PATTERN = r"^[0-9]+$"

#: attribute files the kernel creates read-only (writing gives EACCES)
READ_ONLY = frozenset({
    "vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node",
    "available_instances", "creatable_vgpu_types", "name", "description", "device_api",
    "boot_vga", "sriov_totalvfs", "sriov_offset", "sriov_stride", "sriov_vf_device",
})
#: write-only files with no modelled effect: a write succeeds, they stay empty
WRITE_ONLY = frozenset({
    "bind", "unbind", "new_id", "remove_id", "create", "remove", "reset", "rescan",
    "config", "drivers_probe",
})
#: VGPU_CONFIG_PARAMS_MAX_LENGTH of NVIDIA's nvidia-vgpu-vfio: a longer vgpu_params write is E2BIG
_PARAMS_MAX = 1024
#: how often a blocked remove looks whether its device was closed (seconds)
_CLOSE_POLL_S = 0.02
#: what /proc/<pid>/fd/<n> shows for a VFIO device fd (a group fd shows vfioholders.group_node)
DEVICE_FD_LINK = "anon_inode:[vfio-device]"
#: the first pid the simulator gives a holder (below it: the spec's processes)
_FIRST_HOLDER_PID = 4000
_OVERRIDE_MAX = 4095  # PAGE_SIZE - 1


def _fail(err: int, path: "str | Path", why: str = "") -> OSError:
    msg = os.strerror(err) + (f" ({why})" if why else "")
    return OSError(err, msg, str(path))


def _link(link: Path, target: Path) -> None:
    """A relative symlink at ``link`` pointing at ``target`` (both absolute, same root)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.relpath(target, link.parent), link)


def _remove_tree(top: Path) -> None:
    """Remove a simulated device directory and everything below it (links are removed, not followed;
    no shutil: the hook's start on a simulated host loads this module)."""
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames + dirnames:
            path = os.path.join(dirpath, name)
            try:
                if os.path.islink(path) or not os.path.isdir(path):
                    os.unlink(path)
                else:
                    os.rmdir(path)
            except FileNotFoundError:
                pass
    try:
        os.rmdir(top)
    except FileNotFoundError:
        pass


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _placement_of(nvidia_dir: "str | Path") -> Optional[int]:
    """The placement id in ``<vGPU>/nvidia/placement_id``; None where absent or not a number
    (the driver shows "Not Applicable" for a vGPU with none)."""
    try:
        fd = os.open(f"{nvidia_dir}/{PLACEMENT_ATTR}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def write_attr(path: "str | Path", text: str, *, if_changed: bool = False) -> None:
    """Set an attribute file's content atomically: a temp file in the same directory, then rename.

    A concurrent reader (another vgpuhost process, mdevctl) sees the old
    value or the new one, never an empty or partial file, as with a kernel
    attribute.  ``if_changed``: leave the file alone when it holds ``text``
    already.  Raises OSError.
    """
    path = os.fspath(path)
    data = text.encode("utf-8")
    if if_changed:
        try:
            with open(path, "rb") as f:
                if f.read(len(data) + 1) == data:
                    return
        except FileNotFoundError:
            pass
    try:
        mode = os.stat(path).st_mode & 0o7777      # the new file keeps the attribute's mode
    except FileNotFoundError:
        mode = 0o644
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.sim-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        _unlink(Path(tmp))
        raise


def _set_attr_at(dir_fd: int, name: str, text: str) -> None:
    """:func:`write_attr` with ``if_changed``, for ``name`` relative to the open directory ``dir_fd``:
    the file is read and left alone when it holds ``text``, else replaced (a temp file beside it,
    then rename: a concurrent reader sees the old value or the new one).  For the simulated driver's
    own attribute refresh, which compares some 30 files of one GPU at each vGPU create or remove:
    one open, read and close each, where most hold their value already.  No fsync: the simulated
    tree is a model of sysfs, which does not outlive a reboot either; a crash of the writing
    process leaves the old file or the new one (rename), never a partial one.  A missing file is
    made (mode 0644), as :func:`write_attr` makes it.  Raises OSError (FileNotFoundError where the
    file's directory is missing)."""
    data = text.encode("utf-8")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        mode = 0o644                                # made, as write_attr makes a missing one
    else:
        try:
            if os.read(fd, len(data) + 1) == data:
                return
            mode = os.fstat(fd).st_mode & 0o7777    # the new file keeps the attribute's mode
        finally:
            os.close(fd)
    head, _, base = name.rpartition("/")
    tmp = f"{head}/.{base}.{os.getpid()}.sim-tmp" if head else f".{base}.{os.getpid()}.sim-tmp"
    wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.write(wfd, data)
        os.fchmod(wfd, mode)
    finally:
        os.close(wfd)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def _type_of(mdev_dir: str) -> Optional[str]:
    """The type id an mdev's ``mdev_type`` link names; None where the link is missing."""
    try:
        return os.path.basename(os.readlink(f"{mdev_dir}/mdev_type"))
    except OSError:
        return None


def _group_of(mdev_dir: str) -> Optional[int]:
    """The IOMMU group number an mdev's ``iommu_group`` link names (``.../kernel/iommu_groups/<n>``, as
    the simulated kernel makes it); None where the link is missing or names something else."""
    try:
        target = os.readlink(f"{mdev_dir}/iommu_group")
    except OSError:
        return None
    head, num = os.path.split(target)
    return int(num) if num.isdigit() and os.path.basename(head) == "iommu_groups" else None


class _MustWait(Exception):
    """A write the kernel blocks until device ``vid`` is closed; ``resume(meta)`` (under the lock)
    finishes it then."""

    def __init__(self, vid: str, resume: Callable[[dict], None]):
        super().__init__(vid)
        self.vid = vid
        self.resume = resume


def _rmtree(path: "str | Path") -> None:
    """Remove a directory tree, never following symlinks (``shutil.rmtree`` without importing shutil)."""
    with os.scandir(path) as it:
        entries = list(it)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            _rmtree(e.path)
        else:
            os.unlink(e.path)
    os.rmdir(path)


def _symlink(link: str, target: str) -> None:
    """:func:`_link` for the simulated kernel's hot path (strings; absolute, under one resolved root):
    the link's directory is made only where the first try finds it missing, and a link already there
    is replaced."""
    rel = os.path.relpath(target, os.path.dirname(link))
    try:
        os.symlink(rel, link)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(rel, link)
    except FileExistsError:
        os.unlink(link)
        os.symlink(rel, link)


def _create_file(path: str, text: str) -> None:
    """``Path(path).write_text(text)`` (mode 0666 less the umask), the file's directory made where
    missing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        if text:
            os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


TIME_FILE_ENV = "VGPUHOST_SIM_TIME_FILE"
#: seconds this module's import took, charged once (at the first SimKernel)
_import_s = None
_import_cpu_s = 0.0


def charge(seconds: float, cpu_seconds: Optional[float] = None) -> None:
    """Add ``seconds`` of simulator time (wall clock) and ``cpu_seconds`` of its CPU time (the calling
    thread's; None: the same as ``seconds``) to ``$VGPUHOST_SIM_TIME_FILE``: one line ``WALL CPU PID``
    (decimal seconds, then this process's id); nothing when unset."""
    path = os.environ.get(TIME_FILE_ENV)
    if not path:
        return
    cpu = seconds if cpu_seconds is None else cpu_seconds
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{seconds:.9f} {cpu:.9f} {os.getpid()}\n".encode("ascii"))
    finally:
        os.close(fd)


#: writes made through any SimKernel in this process (the crash-injection counter)
_writes_made = 0
KILL_AT_ENV = "VGPUHOST_SIM_KILL_AT"
KILL_WHEN_ENV = "VGPUHOST_SIM_KILL_WHEN"
WRITE_LOG_ENV = "VGPUHOST_SIM_WRITE_LOG"


def _kill_point() -> "tuple":
    """``(N, when)`` from the environment (see the module docstring); ``(0, '')`` when unset."""
    text = os.environ.get(KILL_AT_ENV, "")
    if not is_digits(text) or int(text) <= 0:
        return 0, ""
    when = os.environ.get(KILL_WHEN_ENV, "before")
    return int(text), ("after" if when == "after" else "before")


def _die() -> None:
    """SIGKILL this process: nothing after this line runs (no finally, no atexit, no rollback)."""
    os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def crash_point() -> Iterator[None]:
    """Count one mutating write (a sysfs write, an NVML change) and SIGKILL at the chosen one."""
    global _writes_made
    _writes_made += 1
    kill_at, when = _kill_point()
    killing = kill_at == _writes_made
    if killing and when == "before":
        _die()
    try:
        yield
    finally:
        if killing:
            _die()


@contextmanager
def _uncounted() -> Iterator[None]:
    yield


#: the parts of the simulated host's state kept apart from ``host.json`` (:meth:`SimKernel.meta`): what
#: changes after the host is built, so a change rewrites one small file, never the whole host
STATE_FILE = "state.json"
GPUS_DIR = "gpus"
#: the keys of ``state.json``: the host-wide counters and lists a write changes
STATE_KEYS = ("next_iommu_group", "opened", "faults", "mdev_change", "mdev_removing", "vf_clear")
#: :meth:`SimKernel.save_meta`'s ``part`` for ``state.json`` (any other part names a GPU)
STATE = "state"

#: parsed state shared by readers (:meth:`SimKernel.meta_view`): sim dir -> (bytes of every part, meta)
_VIEWS: Dict[str, Tuple[tuple, dict]] = {}
_VIEWS_KEPT = 4
#: parsed ``host.json`` (never changed once built: devices, drivers, processes): path -> (bytes, dict)
_STATIC: Dict[str, Tuple[bytes, dict]] = {}
#: each GPU's part as the kernel's own writes last parsed it (:meth:`SimKernel._write_meta`): sim dir ->
#: {GPU: (bytes, dict)}; the last :data:`_VIEWS_KEPT` hosts
_GPU_PARSED: Dict[str, Dict[str, Tuple[bytes, dict]]] = {}


def _read_bytes(path: str) -> bytes:
    """A whole small file's bytes (os-level: a part is read at every simulated write)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def split_meta(meta: dict) -> Tuple[dict, dict, Dict[str, dict]]:
    """``(host.json's part, state.json's, {GPU: its file's})`` of a whole host's state ``meta``."""
    static = {k: v for k, v in meta.items() if k != "gpus" and k not in STATE_KEYS}
    state = {k: meta[k] for k in STATE_KEYS if k in meta}
    return static, state, dict(meta.get("gpus") or {})


def write_meta(sim_dir: "str | Path", meta: dict) -> None:
    """Write a whole host's state ``meta`` as :class:`SimKernel` keeps it: ``host.json`` (what never
    changes once built), ``state.json`` and one ``gpus/<BDF>.json`` per GPU (:func:`split_meta`)."""
    sim = Path(sim_dir)
    static, state, gpus = split_meta(meta)
    (sim / GPUS_DIR).mkdir(exist_ok=True)
    for pf, gpu in gpus.items():
        _replace(sim / GPUS_DIR / f"{pf}.json", gpu)
    _replace(sim / STATE_FILE, state)
    _replace(sim / "host.json", static)


def _replace(path: "str | Path", doc: dict) -> None:
    """Write ``doc`` (JSON, one line) to ``path`` through a ``.tmp`` file beside it and a rename
    (os-level: ``state.json`` is written at every mdev create and remove)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    # one line: json's C encoder serves only indent=None
    data = json.dumps(doc, sort_keys=True).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class SimKernel:
    """Kernel semantics for one simulated host root."""

    def __init__(self, host: HostRoot):
        t0, c0 = _perf_counter(), _thread_time()
        self.host = host
        self.meta_path = host.sim_dir / "host.json"
        self.lock_path = host.sim_dir / "lock"
        # the root with symlinks resolved: written paths are resolved too
        self.real_root = Path(os.path.realpath(host.root))
        self._root_str, self._real_str = str(host.root), str(self.real_root)
        #: (bus/pci/drivers, bus/pci/drivers_probe) below the root, made at the first write
        self._drivers_rel: Optional[Tuple[Path, Path]] = None
        global _import_s, _import_cpu_s
        spent, cpu = _perf_counter() - t0, _thread_time() - c0
        if _import_s is None:
            _import_s = _IMPORT_DONE - _IMPORT_T0
            _import_cpu_s = _IMPORT_CPU_DONE - _IMPORT_C0
            spent += _import_s
            cpu += _import_cpu_s
        charge(spent, cpu)

    # --- metadata --------------------------------------------------------
    def _parts(self) -> Tuple[bytes, bytes, List[Tuple[str, bytes]]]:
        """The bytes of ``host.json``, ``state.json`` and each ``gpus/<BDF>.json`` (sorted by BDF).
        A tree built before the state was split (``host.json`` holding ``gpus``) is split first."""
        sim = self.meta_path.parent
        data = _read_bytes(str(self.meta_path))
        gdir = f"{sim}/{GPUS_DIR}/"
        try:
            names = sorted(os.listdir(gdir))
        except FileNotFoundError:
            write_meta(sim, json.loads(data))            # an older tree: one whole host.json, split now
            return self._parts()
        gpus = [(n[:-5], _read_bytes(gdir + n)) for n in names if n.endswith(".json")]
        return data, _read_bytes(f"{sim}/{STATE_FILE}"), gpus

    def _static(self, data: bytes) -> dict:
        key = str(self.meta_path)
        hit = _STATIC.get(key)
        if hit is None or hit[0] != data:
            hit = _STATIC[key] = (data, json.loads(data))
        return hit[1]

    def _compose(self, parts: Tuple[bytes, bytes, List[Tuple[str, bytes]]]) -> dict:
        data, state, gpus = parts
        meta = dict(self._static(data))         # shared values: devices, drivers, processes (never changed)
        meta.update(json.loads(state))
        meta["gpus"] = {pf: json.loads(raw) for pf, raw in gpus}
        return meta

    def _write_meta(self) -> dict:
        """:meth:`meta` for the kernel's own writes (:meth:`_write`, under the lock): every part is read,
        but a GPU's part is parsed again only when its bytes differ from those this process parsed last,
        and the dict parsed then is handed out again.  Most writes change no GPU's part (a time-sliced
        vGPU's create or remove rewrites ``state.json`` alone), so this saves parsing every GPU's file
        (some 5 KB each) twice a vGPU.  Safe because a write changes a GPU's dict only to save it at
        once (:meth:`_place_on_gi`), :meth:`save_meta` drops the kept dict of every GPU part it writes,
        and :meth:`_write` drops them all when a write raises, whatever it had changed."""
        data, state, gpus = self._parts()
        key = str(self.meta_path.parent)
        kept = _GPU_PARSED.pop(key, None) or {}
        _GPU_PARSED[key] = fresh = {}
        while len(_GPU_PARSED) > _VIEWS_KEPT:
            del _GPU_PARSED[next(iter(_GPU_PARSED))]
        meta = dict(self._static(data))
        meta.update(json.loads(state))
        out = meta["gpus"] = {}
        for pf, raw in gpus:
            hit = kept.get(pf)
            if hit is None or hit[0] != raw:
                hit = (raw, json.loads(raw))
            fresh[pf] = hit
            out[pf] = hit[1]
        return meta

    def meta(self) -> dict:
        """The simulated host's state, read anew: the caller may change its ``gpus`` entries and
        :data:`STATE_KEYS` (and :meth:`save_meta` them), never ``devices``, ``drivers`` or ``processes``
        (fixed when the host is built, parsed once per process).

        Kept in parts, so that a change rewrites the part it changed, not the whole host:
        ``host.json`` (what is fixed once built), ``state.json`` (:data:`STATE_KEYS`) and one
        ``gpus/<BDF>.json`` per GPU (its types, parents, NVML state)."""
        return self._compose(self._parts())

    def meta_view(self) -> dict:
        """:meth:`meta`, shared by every reader of the same host: the caller must not change it.

        Parsed again only when some part's bytes differ from those of the last parse (reading and
        comparing the bytes costs a fraction of parsing them: NVML reads call this for every
        query).  The last :data:`_VIEWS_KEPT` hosts are kept.
        """
        parts = self._parts()
        flat = (parts[0], parts[1], tuple(parts[2]))
        key = str(self.meta_path.parent)
        hit = _VIEWS.get(key)
        if hit is not None and hit[0] == flat:
            return hit[1]
        meta = self._compose(parts)
        _VIEWS.pop(key, None)
        _VIEWS[key] = (flat, meta)
        while len(_VIEWS) > _VIEWS_KEPT:
            del _VIEWS[next(iter(_VIEWS))]
        return meta

    def save_meta(self, meta: dict, part: Optional[str] = None) -> None:
        """Write what changed of ``meta`` (from :meth:`meta`): ``part`` :data:`STATE` writes
        ``state.json``, a GPU's BDF its ``gpus/<BDF>.json``; None every part (the whole host)."""
        sim = self.meta_path.parent
        kept = _GPU_PARSED.get(str(sim))
        if kept is not None and part != STATE:
            # a dict :meth:`_write_meta` handed out may be the one saved, changed: never hand it out again
            # for bytes it no longer matches (the file could come back to them)
            if part is None:
                kept.clear()
            else:
                kept.pop(part, None)
        if part is None:
            write_meta(sim, meta)
        elif part == STATE:
            _replace(f"{sim}/{STATE_FILE}", {k: meta[k] for k in STATE_KEYS if k in meta})
        else:
            _replace(f"{sim}/{GPUS_DIR}/{part}.json", meta["gpus"][part])

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Serialise kernel operations across processes (flock on .vgpuhost-sim/lock)."""
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def dev_dir(self, meta: dict, bdf: str) -> Path:
        return self.host.root / meta["devices"][bdf]["path"]

    def _rdir(self, meta: dict, bdf: str) -> Path:
        """Like :meth:`dev_dir` but under the resolved root (for links)."""
        return self.real_root / meta["devices"][bdf]["path"]

    def _rpath(self, p: Path) -> Path:
        """A HostRoot-derived path re-expressed under the resolved root."""
        return self.real_root / p.relative_to(self.host.root)

    def _rstr(self, p: str) -> str:
        """:meth:`_rpath` of a HostRoot-derived path as a string (``host.s``), to a string."""
        root = self._root_str
        if p == root:
            return self._real_str
        prefix = root if root.endswith("/") else root + "/"      # a host tree at / (the Debian package's test)
        if not p.startswith(prefix):
            raise ValueError(f"{p!r} is not under {root!r}")
        return self._real_str.rstrip("/") + "/" + p[len(prefix):]

    def _below_root(self, real: str) -> str:
        """A path under the resolved root (a string, as :meth:`_rstr` gives), relative to that root
        (``Path.relative_to`` without pathlib, on a simulated write's hot path).  ValueError when
        ``real`` is not under it."""
        root = self._real_str.rstrip("/") + "/"
        if not real.startswith(root):
            raise ValueError(f"{real!r} is not under {self._real_str!r}")
        return real[len(root):]

    # --- a device leaving the tree (docs/guide/failures.md#signals) ------------
    def unplug(self, bdf: str) -> None:
        """Simulator only: the device at ``bdf`` (and its VFs and mdevs below it) disappears from the PCI
        tree, as after a surprise removal or the kernel removing a GPU that fell off the bus: its
        ``bus/pci/devices`` link, its driver's link and its directory go; host.json keeps its entry
        (``unplugged``), so writes naming it fail with ENOENT as on a real host.  The directory is kept
        aside (``.vgpuhost-sim/unplugged/BDF``) for :meth:`replug`."""
        with self.locked():
            meta = self.meta()
            if bdf not in meta["devices"]:
                raise _fail(errno.ENODEV, self.host.pci_device(bdf), f"no device {bdf!r}")
            gone = [b for b, d in meta["devices"].items() if b == bdf or d.get("pf") == bdf]
            for b in gone:
                drv = self._driver_of(meta, b)
                if drv:
                    _unlink(self._driver_dir(drv) / b)
                _unlink(self._rpath(self.host.pci_device(b)))
                meta["devices"][b]["unplugged"] = drv or True      # the driver it had, for replug
            aside = self._aside(bdf)
            aside.parent.mkdir(parents=True, exist_ok=True)
            _remove_tree(aside)
            os.rename(self._rdir(meta, bdf), aside)
            self.save_meta(meta)

    def _aside(self, bdf: str) -> Path:
        return self._rpath(self.host.sim_dir) / "unplugged" / bdf

    def is_unplugged(self, bdf: str) -> bool:
        """Simulator only: did :meth:`unplug` take ``bdf`` out of the tree (and no :meth:`replug` since)?"""
        return bool(((self.meta_view().get("devices") or {}).get(bdf) or {}).get("unplugged"))

    def replug(self, bdf: str) -> None:
        """Simulator only: undo :meth:`unplug` (a reseated GPU found again): the device's directory as it
        was, its ``bus/pci/devices`` links and its driver's links come back.  ENODEV when ``bdf`` is not
        unplugged."""
        with self.locked():
            meta = self.meta()
            if not (meta["devices"].get(bdf) or {}).get("unplugged"):
                raise _fail(errno.ENODEV, self.host.pci_device(bdf), f"{bdf!r} is not unplugged")
            os.rename(self._aside(bdf), self._rdir(meta, bdf))
            for b, d in meta["devices"].items():
                if b != bdf and d.get("pf") != bdf:
                    continue
                drv = d.pop("unplugged", None)
                ddir = self._rdir(meta, b)
                _link(self._rpath(self.host.pci_device(b)), ddir)
                if isinstance(drv, str) and ddir.is_dir():
                    _link(self._driver_dir(drv) / b, ddir)
            self.save_meta(meta)

    # --- vGPU instances and capacity ---------------------------------------
    def instances(self, meta: dict, pf: str) -> List[dict]:
        """vGPUs present on GPU ``pf``: ``[{parent, type_id, id, placement}]`` read from the tree, by
        parent (in ``parents`` order), then type id, then id.

        An mdev is a directory named by its UUID under its parent's device directory with an
        ``mdev_type`` link (docs/reference/hardware.md#mdev): one listing of each parent's
        directory finds them, where listing every type's ``devices/`` took one listing per type
        (29 on an A40).  Only types of the GPU count, as before; a parent whose types are not
        registered (off ``nvidia``: :meth:`sync_mdev_parent`) holds none."""
        gpu = meta["gpus"][pf]
        out: List[dict] = []
        if gpu["backend"] == "mdev":
            types = gpu["types"]
            for parent in gpu["parents"]:
                pdir = f"{self.dev_dir(meta, parent)}/"
                found = []
                try:
                    with os.scandir(pdir) as it:
                        names = [e.name for e in it if len(e.name) == 36 and e.name[8] == "-"
                                 and e.is_dir(follow_symlinks=False)]
                except FileNotFoundError:
                    continue
                if names and not os.path.isdir(f"{pdir}mdev_supported_types"):
                    continue            # not registered: no type to list it under
                for name in names:
                    try:
                        tid = os.path.basename(os.readlink(f"{pdir}{name}/mdev_type"))
                    except OSError:
                        continue        # a directory of that shape that is no mdev
                    if tid in types:
                        found.append((tid, name))
                for tid, name in sorted(found):
                    out.append({"parent": parent, "type_id": tid, "id": name,
                                "placement": _placement_of(f"{pdir}{name}/nvidia")})
        elif gpu["backend"] == "vendor-vfio":
            for vf in gpu["parents"]:
                nvidia = f"{self.dev_dir(meta, vf)}/nvidia"
                cur = _read_bytes(f"{nvidia}/current_vgpu_type").decode("utf-8", "replace").strip()
                if cur and cur != "0":
                    out.append({"parent": vf, "type_id": cur, "id": vf, "placement": _placement_of(nvidia)})
        return out

    def gi_of_vgpus(self, meta: dict, pf: str, *, instances: Optional[List[dict]] = None) -> Dict[str, int]:
        """``{vGPU id: GPU instance id}`` for the MIG-backed vGPUs present on GPU ``pf``: which GPU
        instance each sits on, as NVML's ``nvmlVgpuInstanceGetGpuInstanceId`` answers on a real host
        (docs/reference/hardware.md#mig-backed-vgpus).  The driver picks the GPU instance at create;
        the simulator records its pick (``vgpu_gi`` in the GPU's file, :meth:`_place_on_gi`).  A
        vGPU with no record (made before the simulator kept one) is read as sitting on the
        lowest-numbered free GPU instance of its profile; a record of a vGPU or GPU instance gone
        is dropped."""
        gpu = meta["gpus"][pf]
        live = instances if instances is not None else self.instances(meta, pf)
        types = gpu.get("types") or {}
        gis = {int(g["gi_id"]): g["profile"] for g in gpu.get("gpu_instances") or []}
        kept = {str(k): int(v) for k, v in (gpu.get("vgpu_gi") or {}).items()}
        out: Dict[str, int] = {}
        unplaced: List[Tuple[str, str]] = []
        for inst in live:
            prof = (types.get(inst["type_id"]) or {}).get("gi_profile")
            if not prof:
                continue
            gi = kept.get(inst["id"])
            if gi is not None and gis.get(gi) == prof and gi not in out.values():
                out[inst["id"]] = gi
            else:
                unplaced.append((inst["id"], prof))
        for vid, prof in unplaced:
            free = sorted(g for g, p in gis.items() if p == prof and g not in out.values())
            if free:
                out[vid] = free[0]
        return out

    def _place_on_gi(self, meta: dict, pf: str, vid: str, tid: str) -> None:
        """Record the GPU instance the driver puts new MIG-backed vGPU ``vid`` (type ``tid``) on: the
        lowest-numbered GPU instance of its profile holding no vGPU (NVIDIA documents no order; the
        simulator's choice).  No-op for a time-sliced type."""
        gpu = meta["gpus"][pf]
        prof = ((gpu.get("types") or {}).get(tid) or {}).get("gi_profile")
        if not prof:
            return
        others = [i for i in self.instances(meta, pf) if i["id"] != vid]
        held = self.gi_of_vgpus(meta, pf, instances=others)
        free = sorted(int(g["gi_id"]) for g in gpu.get("gpu_instances") or []
                      if g["profile"] == prof and int(g["gi_id"]) not in held.values())
        if free:
            held[vid] = free[0]
        gpu["vgpu_gi"] = held
        self.save_meta(meta, pf)

    def available(self, meta: dict, pf: str, *, instances: Optional[List[dict]] = None) -> Dict[str, Dict[str, int]]:
        """Free instances per parent and type id of GPU ``pf``: ``{parent: {type_id: n}}``.

        On SR-IOV GPUs each VF holds one vGPU at most (docs/reference/hardware.md#mdev, #vendor-vfio):
        a VF reports 0 when it holds one, else at most 1.  ``instances``: :meth:`instances` of ``pf``
        where the caller has them (read under the lock since the tree last changed), else read here.
        """
        gpu = meta["gpus"][pf]
        if gpu["backend"] == "none":
            return {}
        inst = instances if instances is not None else self.instances(meta, pf)
        avail = gpu_available(gpu, [i["type_id"] for i in inst], [i.get("placement") for i in inst])
        busy = {i["parent"] for i in inst}
        sriov = bool(gpu["vfs"])
        out: Dict[str, Dict[str, int]] = {}
        for parent in gpu["parents"]:
            if not sriov:
                out[parent] = {tid: avail.get(tid, 0) for tid in gpu["types"]}
            elif parent in busy:
                out[parent] = {tid: 0 for tid in gpu["types"]}
            else:
                out[parent] = {tid: min(1, avail.get(tid, 0)) for tid in gpu["types"]}
        return out

    def refresh_gpu(self, pf: str, meta: dict = None, *, instances: Optional[List[dict]] = None) -> None:
        """Rewrite ``available_instances`` / ``creatable_vgpu_types`` of GPU ``pf`` where its value
        moved (``instances``: as :meth:`available` takes them).

        Each file is read and compared first, and only one whose text differs is replaced
        (:func:`_set_attr_at`: temp file and rename): after a vGPU create or remove on an A40 in
        equal-size mode that is the types of the vGPU's size (3 of 29), or all of them when the
        GPU's first vGPU comes or its last goes.  Comparing against the file, not against the availability before the
        change, keeps the files right even where something outside the kernel changed the tree."""
        meta = meta or self.meta()
        gpu = meta["gpus"][pf]
        if gpu["backend"] == "none":
            return
        for parent, avail in self.available(meta, pf, instances=instances).items():
            pdir = self.dev_dir(meta, parent)
            if gpu["backend"] == "mdev":
                try:
                    dfd = os.open(f"{pdir}/mdev_supported_types", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except FileNotFoundError:       # not registered: not bound to nvidia (sync_mdev_parent)
                    continue
                try:
                    for tid in gpu["types"]:
                        _set_attr_at(dfd, f"{tid}/available_instances", f"{avail.get(tid, 0)}\n")
                except FileNotFoundError:
                    continue
                finally:
                    os.close(dfd)
            else:
                lines = ["ID    : vGPU Name"]
                for tid in sorted(gpu["types"], key=int):
                    if avail.get(tid, 0) > 0:
                        lines.append(f"{int(tid):<5d} : {gpu['types'][tid]['raw_name']}")
                dfd = os.open(f"{pdir}/nvidia", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    _set_attr_at(dfd, "creatable_vgpu_types", "\n".join(lines) + "\n")
                finally:
                    os.close(dfd)

    # --- writes ------------------------------------------------------------
    def crash_point(self):
        """:func:`crash_point` (a context manager): for a writer that counts a write itself and
        makes it elsewhere (:meth:`vgpuhost.io.sysfs.Sysfs.write_bounded`'s detached or resident writer)."""
        return crash_point()

    def writer_env(self) -> Dict[str, Optional[str]]:
        """The environment this kernel's writes follow, as this process has it now (``{name: value or None}``:
        :data:`TIME_FILE_ENV`, :data:`WRITE_LOG_ENV`), for a resident writer that makes them elsewhere
        (:mod:`vgpuhost.io.residentwriter`) and may have been started with another; the crash-injection
        variables are not in it (such a writer's writes are not counted: this process counts them)."""
        return {name: os.environ.get(name) for name in (TIME_FILE_ENV, WRITE_LOG_ENV)}

    def write(self, path: Path, value: str, *, counted: bool = True) -> None:
        """Apply a write of ``value`` to ``path`` (absolute, under the root).

        Raises OSError(errno) as the kernel would (see the module docstring); a remove of an
        open mdev blocks until it is closed.  ``counted`` False: the crash-injection count was
        taken by the process that asked for the write.
        """
        t0, c0 = _perf_counter(), _thread_time()
        try:
            with (crash_point() if counted else _uncounted()):
                try:
                    self._write(path, value)
                except _MustWait as w:      # blocked, the lock released: wait for the close, then finish
                    waited, cwaited = _perf_counter(), _thread_time()
                    self._wait_closed(path, w.vid)
                    t0 += _perf_counter() - waited      # waiting is not the simulator's cost
                    c0 += _thread_time() - cwaited
                    with self.locked():
                        w.resume(self.meta())
                log = os.environ.get(WRITE_LOG_ENV)
                if log:         # the writes that landed, for the fault-injection tests' audit check
                    with open(log, "a", encoding="utf-8") as f:
                        f.write(f"{self.host.relative(path)}\t{value.rstrip(chr(10)) or chr(92) + 'n'}\n")
        finally:
            charge(_perf_counter() - t0, _thread_time() - c0)

    # --- open devices (a qemu holding a vGPU) --------------------------------------
    def _vgpu_dir(self, meta: dict, vid: str) -> Optional[Path]:
        """The resolved device directory of vGPU ``vid`` (an mdev UUID or a VF address), None if unknown."""
        if vid in meta["devices"]:
            return self._rdir(meta, vid)
        link = self.host.mdev_devices / vid
        return Path(os.path.realpath(link)) if os.path.lexists(link) else None

    def holders(self, vid: str, meta: Optional[dict] = None) -> List[int]:
        """The pids holding vGPU ``vid`` open (meta ``opened``), sorted."""
        meta = meta if meta is not None else self.meta_view()
        return sorted(int(p) for p, h in (meta.get("opened") or {}).items() if h.get("vgpu") == vid)

    def open_vgpu(self, vid: str, *, comm: str = "qemu-system-x86", via: str = "group") -> int:
        """Open vGPU ``vid`` (an mdev UUID or a vendor-VFIO VF's address) as a qemu would; its pid.

        ``via`` ``group``: the holder keeps the group fd too (``/dev/vfio/<group>`` in its fd
        table, what a real qemu shows); ``device``: only the device fd.  Raises OSError ENODEV
        for a vGPU that does not exist (a VF holding no vGPU cannot be opened: the driver's
        open_device fails).
        """
        if via not in ("group", "device"):
            raise ValueError(f"via must be 'group' or 'device', not {via!r}")
        with self.locked():
            meta = self.meta()
            ddir = self._vgpu_dir(meta, vid)
            if ddir is None or (vid in meta["devices"] and not self._vf_holds_vgpu(ddir)):
                raise _fail(errno.ENODEV, vid, "no such vGPU to open")
            group = os.path.basename(os.readlink(ddir / "iommu_group")) if os.path.islink(
                ddir / "iommu_group") else None
            opened = meta.setdefault("opened", {})
            pid = _FIRST_HOLDER_PID
            while str(pid) in opened or os.path.lexists(self._rpath(self.host.proc) / str(pid)):
                pid += 1
            pdir = self._rpath(self.host.proc) / str(pid)
            (pdir / "fd").mkdir(parents=True)
            (pdir / "comm").write_text(comm[:15] + "\n")
            os.symlink(DEVICE_FD_LINK, pdir / "fd" / "21")
            if via == "group" and group is not None:
                os.symlink(group_node(group), pdir / "fd" / "20")
            opened[str(pid)] = {"vgpu": vid, "comm": comm, "via": via, "requests": 0}
            self.save_meta(meta, STATE)
            return pid

    def close_vgpu(self, pid: int) -> None:
        """The holder ``pid`` closes its vGPU (and exits): its ``proc/<pid>`` goes; a blocked remove goes on."""
        with self.locked():
            meta = self.meta()
            held = ((meta.get("opened") or {}).pop(str(pid), None) or {}).get("vgpu")
            waiting = (meta.get("mdev_removing") or {}).get(held) if held else None
            if waiting is not None and not self.holders(held, meta):
                # a remove waits for this release: the device goes now (its writer, if alive,
                # finds it gone and returns)
                del meta["mdev_removing"][held]
                pf = waiting.get("pf")
                self._mdev_unregister(meta, self.real_root / waiting["dir"],
                                      pf if pf in meta["gpus"] else None)
            self.save_meta(meta, STATE)
            pdir = self._rpath(self.host.proc) / str(int(pid))
            if pdir.is_dir():
                _rmtree(pdir)

    @staticmethod
    def _vf_holds_vgpu(vf_dir: Path) -> bool:
        try:
            return (vf_dir / "nvidia" / "current_vgpu_type").read_text().strip() not in ("", "0")
        except OSError:
            return False

    def _request_release(self, meta: dict, vid: str) -> None:
        """The driver's ``request`` op, sent to each holder while an unregister waits (counted)."""
        for h in (meta.get("opened") or {}).values():
            if h.get("vgpu") == vid:
                h["requests"] = int(h.get("requests") or 0) + 1
        self.save_meta(meta, STATE)

    def _wait_closed(self, path: Path, vid: str) -> None:
        """Block until nobody holds ``vid`` (no timeout: the kernel's wait after a signal is
        uninterruptible).  The host root vanishing ends it with ENODEV (a test's tree removed)."""
        while True:
            try:
                if not self.holders(vid):
                    return
            except FileNotFoundError:
                raise _fail(errno.ENODEV, path, "the simulated host is gone") from None
            time.sleep(_CLOSE_POLL_S)

    def file_op(self, path: Path, logged: str, apply: Callable[[], None]) -> None:
        """A configuration file written or removed under the root (``etc/``: mdevctl, driverctl,
        modprobe.d): not the kernel's, but a crash point like a kernel write, so fault injection
        covers it too; logged as ``logged`` (the audit value) when it lands."""
        with crash_point():
            apply()
            log = os.environ.get(WRITE_LOG_ENV)
            if log:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"{self.host.relative(path)}\t{logged}\n")

    def read(self, path: Path) -> None:
        """A read of ``path``, an attribute named in :data:`READ_FAULTS_FILE`: raises OSError with the
        errno of the first matching ``read`` fault (its ``attr`` the file's name, its device the
        attribute's device or that device's PF), as a driver's show function that fails makes the
        read(2) fail (EINVAL when the driver's query failed: docs/guide/simulator.md); returns when
        none matches, and the caller reads the file."""
        with self.locked():
            meta = self.meta()
            real, rel = self._resolved(path)
            if rel is None:
                return
            by_path = {d["path"]: bdf for bdf, d in meta["devices"].items()}
            owner = rel.parent
            while str(owner) not in by_path and owner != owner.parent:
                owner = owner.parent        # mdev_supported_types/<type>/, nvidia/: the device above
            bdf = by_path.get(str(owner))
            devices = [bdf, meta["devices"][bdf].get("pf")] if bdf else []
            self._fault(meta, "read", devices, path, attr=real.name)

    def _resolved(self, path: Path) -> Tuple[Path, Optional[Path]]:
        """``(real path, its path below the simulated root)``; the second None when it is outside."""
        real = Path(os.path.realpath(path))
        try:
            return real, real.relative_to(self.real_root)
        except ValueError:
            return real, None

    def _write(self, path: Path, value: str) -> None:
        with self.locked():
            try:
                self._write_locked(path, value)
            except BaseException:
                # the write may have changed a kept GPU dict and not saved it: parse every GPU again
                _GPU_PARSED.pop(str(self.meta_path.parent), None)
                raise

    def _write_locked(self, path: Path, value: str) -> None:
        meta = self._write_meta()
        self._settle_mdev_change(meta)
        self._settle_vf_clear(meta)
        real, rel = self._resolved(path)
        if rel is None:
            raise _fail(errno.EACCES, path, "outside the simulated host root")
        if not os.path.lexists(real):
            raise _fail(errno.ENOENT, path)
        if real.is_dir():
            raise _fail(errno.EISDIR, path)
        if not real.is_file():      # a FIFO or device planted in the tree: never block on it
            raise _fail(errno.EINVAL, path, "not a simulated attribute file")
        self._dispatch(meta, Path(path), real, rel, value)

    def _dispatch(self, meta: dict, path: Path, real: Path, rel: Path, value: str) -> None:
        by_path = {d["path"]: bdf for bdf, d in meta["devices"].items()}
        name = real.name
        if self._drivers_rel is None:       # the same for every write: made once
            self._drivers_rel = (self.host.pci_drivers.relative_to(self.host.root),
                                 self.host.pci_drivers_probe.relative_to(self.host.root))
        drivers_rel, probe_rel = self._drivers_rel
        if rel == probe_rel:
            return self._probe(meta, path, value)
        if name in ("bind", "unbind") and rel.parent.parent == drivers_rel:
            drv = rel.parent.name
            if name == "bind":
                return self._bind(meta, path, drv, value)
            return self._unbind(meta, path, drv, value)
        parent_rel = str(rel.parent)
        if name == "driver_override" and parent_rel in by_path:
            return self._driver_override(meta, path, by_path[parent_rel], real, value)
        if (name == "create" and real.parent.parent.name == "mdev_supported_types"
                and str(rel.parent.parent.parent) in by_path):
            return self._mdev_create(meta, path, by_path[str(rel.parent.parent.parent)],
                                     real.parent.name, value)
        if name == "remove" and os.path.islink(real.parent / "mdev_type"):
            return self._mdev_remove(meta, path, real.parent, by_path, value)
        if real.parent.name == "nvidia":
            owner = str(rel.parent.parent)
            if name == "current_vgpu_type" and owner in by_path:
                return self._set_type(meta, path, by_path[owner], real, value)
            if name == "vgpu_params":
                return self._vgpu_params(meta, path, real, value)
            if name == PLACEMENT_ATTR and owner in by_path:
                return self._placement_write(meta, path, by_path[owner], real, value)
        if name in READ_ONLY:
            raise _fail(errno.EACCES, path, "read-only attribute")
        if name in WRITE_ONLY:
            return
        write_attr(real, value)

    # --- faults ------------------------------------------------------------
    def _fault(self, meta: dict, op: str, devices: Iterable[Optional[str]], path: Path,
               attr: Optional[str] = None) -> bool:
        """Fire the first matching injected fault (a ``read`` fault: of attribute ``attr``).

        Raises OSError for effect ``error``; True for ``ignore`` (the caller
        returns success without acting); False when none matches.
        """
        devs = {d.lower() for d in devices if d}
        faults = meta.get("faults") or []
        for i, f in enumerate(faults):
            if f.get("op") != op:
                continue
            if f.get("device") and f["device"].lower() not in devs:
                continue
            if f.get("attr") and f["attr"] != attr:
                continue
            count = int(f.get("count") or 0)
            if count > 0:
                if count == 1:
                    del faults[i]
                else:
                    f["count"] = count - 1
                self.save_meta(meta, STATE)
            if f.get("effect", "error") == "ignore":
                return True
            raise _fail(int(f.get("errno") or errno.EIO), path, f"injected {op} fault")
        return False

    # --- PCI driver binding ------------------------------------------------
    def _driver_of(self, meta: dict, bdf: str) -> Optional[str]:
        try:
            return os.path.basename(os.readlink(self._rdir(meta, bdf) / "driver"))
        except OSError:
            return None

    def _override(self, meta: dict, bdf: str) -> Optional[str]:
        try:
            v = (self._rdir(meta, bdf) / "driver_override").read_text().strip()
        except FileNotFoundError:
            return None
        return None if v in ("", "(null)") else v

    def _matches(self, meta: dict, bdf: str, drv: str) -> bool:
        ov = self._override(meta, bdf)
        if ov is not None:
            return ov == drv
        return meta["devices"][bdf].get("native_driver") == drv

    def _driver_dir(self, drv: str) -> Path:
        return self._rpath(self.host.pci_driver(drv))

    def _attach(self, meta: dict, bdf: str, drv: str) -> None:
        ddir = self._rdir(meta, bdf)
        _link(ddir / "driver", self._driver_dir(drv))
        _link(self._driver_dir(drv) / bdf, ddir)
        self._sync_vfio_group(meta, meta["devices"][bdf].get("iommu_group"))
        if drv == NVIDIA:
            self.sync_mdev_parent(meta, bdf)

    def _detach(self, meta: dict, bdf: str, drv: str) -> None:
        _unlink(self._rdir(meta, bdf) / "driver")
        _unlink(self._driver_dir(drv) / bdf)
        self._sync_vfio_group(meta, meta["devices"][bdf].get("iommu_group"))
        if drv == NVIDIA:
            self.sync_mdev_parent(meta, bdf)

    def sync_mdev_parent(self, meta: dict, bdf: str) -> None:
        """Show or hide mdev parent ``bdf``'s ``mdev_supported_types`` and its ``class/mdev_bus`` link
        as it is bound to ``nvidia`` or not: the vGPU manager registers the parent when it binds and
        unregisters it when it unbinds (docs/reference/hardware.md#mdev), so a GPU on vfio-pci or on
        no driver offers no mdev type.  Hidden types wait under ``.vgpuhost-sim/mdev-unregistered/``.
        Nothing for a device that is no mdev parent."""
        pf = bdf if bdf in meta["gpus"] else meta["devices"][bdf].get("pf")
        gpu = meta["gpus"].get(pf) if pf else None
        if gpu is None or gpu["backend"] != "mdev" or bdf not in gpu["parents"]:
            return
        types = self._rdir(meta, bdf) / "mdev_supported_types"
        hidden = self._rpath(self.host.sim_dir) / "mdev-unregistered" / bdf
        link = self._rpath(self.host.mdev_bus) / bdf
        if self._driver_of(meta, bdf) == NVIDIA:
            if hidden.is_dir() and not os.path.lexists(types):
                os.rename(hidden, types)
            _link(link, self._rdir(meta, bdf))
            self.refresh_gpu(pf, meta)
        else:
            if types.is_dir():
                hidden.parent.mkdir(parents=True, exist_ok=True)
                os.rename(types, hidden)
            _unlink(link)

    def _sync_vfio_group(self, meta: dict, group: Optional[int]) -> None:
        """``dev/vfio/<group>`` exists while a member of the group is bound to vfio-pci."""
        if group is None:
            return
        node = self._rpath(self.host.dev_vfio) / str(group)
        held = any(d.get("iommu_group") == group and self._driver_of(meta, b) == VFIO_PCI
                   for b, d in meta["devices"].items())
        if held:
            if not node.exists():
                node.parent.mkdir(parents=True, exist_ok=True)
                node.write_text("")
        else:
            _unlink(node)

    def _has_vgpus(self, meta: dict, bdf: str) -> bool:
        """Whether device ``bdf`` (a GPU PF, or a VF / mdev parent) holds vGPUs."""
        if bdf in meta["gpus"]:
            return bool(self.instances(meta, bdf))
        pf = meta["devices"][bdf].get("pf")
        if pf and pf in meta["gpus"]:
            return any(i["parent"] == bdf for i in self.instances(meta, pf))
        return False

    def _vfs_enabled(self, meta: dict, bdf: str) -> bool:
        """Whether ``bdf`` is a PF with SR-IOV VFs enabled (``sriov_numvfs`` > 0).

        vfio-pci refuses to bind such a PF ("Cannot bind to PF with SR-IOV
        enabled", -EBUSY from its probe): the VFs may be in use by the host."""
        try:
            return int((self._rdir(meta, bdf) / "sriov_numvfs").read_text().strip() or 0) > 0
        except (OSError, ValueError):
            return False

    def _bind(self, meta: dict, path: Path, drv: str, value: str) -> None:
        bdf = value.strip()
        if bdf not in meta["devices"]:
            raise _fail(errno.ENODEV, path, f"no device {bdf!r}")
        if self._driver_of(meta, bdf) is not None:
            raise _fail(errno.EBUSY, path, f"{bdf} is already bound")
        if drv == VFIO_PCI and self._matches(meta, bdf, drv) and self._vfs_enabled(meta, bdf):
            raise _fail(errno.EBUSY, path, f"vfio-pci: cannot bind to PF {bdf} with SR-IOV enabled")
        if not self._matches(meta, bdf, drv):
            raise _fail(errno.ENODEV, path, f"{drv} does not match {bdf}")
        if self._fault(meta, "bind", [bdf], path):
            return
        self._attach(meta, bdf, drv)

    def _unbind(self, meta: dict, path: Path, drv: str, value: str) -> None:
        bdf = value.strip()
        if bdf not in meta["devices"]:
            raise _fail(errno.ENODEV, path, f"no device {bdf!r}")
        if self._driver_of(meta, bdf) != drv:
            raise _fail(errno.ENODEV, path, f"{bdf} is not bound to {drv}")
        if self._has_vgpus(meta, bdf):
            raise _fail(errno.EBUSY, path, f"{bdf} has vGPUs")
        if (meta["devices"][bdf].get("is_gpu") and drv == "nvidia"
                and PERSISTENCED in (meta.get("processes") or [])):
            raise _fail(errno.EBUSY, path, f"{PERSISTENCED} holds {bdf} (non-zero usage count)")
        if self._fault(meta, "unbind", [bdf], path):
            return
        self._detach(meta, bdf, drv)

    def _probe(self, meta: dict, path: Path, value: str) -> None:
        bdf = value.strip()
        if bdf not in meta["devices"]:
            raise _fail(errno.ENODEV, path, f"no device {bdf!r}")
        if self._driver_of(meta, bdf) is not None:
            return
        if self._fault(meta, "probe", [bdf], path):
            return
        ov = self._override(meta, bdf)
        drv = ov if ov is not None else meta["devices"][bdf].get("native_driver")
        if drv == VFIO_PCI and self._vfs_enabled(meta, bdf):
            return          # vfio-pci's probe fails (-EBUSY); drivers_probe still reports success
        if drv and self._driver_dir(drv).is_dir():
            self._attach(meta, bdf, drv)

    def _driver_override(self, meta: dict, path: Path, bdf: str, real: Path, value: str) -> None:
        v = value[:-1] if value.endswith("\n") else value
        if len(v) > _OVERRIDE_MAX:
            raise _fail(errno.EINVAL, path, "value too long")
        if self._fault(meta, "driver_override", [bdf], path):
            return
        write_attr(real, (v if v else "(null)") + "\n")

    # --- mdev --------------------------------------------------------------
    def _pf_of_parent(self, meta: dict, parent: str) -> Optional[str]:
        for pf, gpu in meta["gpus"].items():
            if parent in gpu.get("parents", []):
                return pf
        return None

    def _mdev_create(self, meta: dict, path: Path, parent: str, tid: str, value: str) -> None:
        pf = self._pf_of_parent(meta, parent)
        if pf is None or meta["gpus"][pf]["backend"] != "mdev" or tid not in meta["gpus"][pf]["types"]:
            raise _fail(errno.EINVAL, path, f"type {tid} not supported by {parent}")
        text = value.strip()
        if not re.match(_UUID_PATTERN, text):
            raise _fail(errno.EINVAL, path, f"not a UUID: {text[:40]!r}")
        uuid = text.lower()
        if self._driver_of(meta, parent) != "nvidia":
            raise _fail(errno.ENODEV, path, f"{parent} is not bound to nvidia")
        bus_link = self._rpath(self.host.mdev_devices) / uuid
        pdir = self._rdir(meta, parent)
        mdir = pdir / uuid
        if os.path.lexists(bus_link):
            raise _fail(errno.EEXIST, path, f"mdev {uuid} exists")
        if os.path.lexists(mdir):
            # no bus link: pieces a killed writer left (the bus link is made last and goes first),
            # which the kernel never shows; they go, and the create goes on
            self._mdev_take_away(meta, str(mdir), uuid, _type_of(str(mdir)), _group_of(str(mdir)), pf)
        present = self.instances(meta, pf)      # under the lock: the tree changes only below, by us
        if self.available(meta, pf, instances=present)[parent].get(tid, 0) <= 0:
            raise _fail(errno.ENOSPC, path, f"no {tid} instance left on {parent}")
        pid = self._placement_for(meta, pf, tid, None, path, instances=present)
        if self._fault(meta, "create", [parent, pf], path):
            return

        # the layout, os-level on strings (pathlib's parsing was half the create's own time)
        groups = self._rstr(self.host.s.iommu_groups)
        group = int(meta.get("next_iommu_group") or 0)
        while os.path.exists(f"{groups}/{group}"):
            group += 1
        meta["next_iommu_group"] = group + 1
        # recorded before the tree changes: a writer killed while it lays the device out leaves pieces
        # that the next write takes away (:meth:`_settle_mdev_change`), as the kernel's create is one
        # write(2) that a killed process cannot leave half done
        meta["mdev_change"] = {"op": "create", "uuid": uuid, "parent": parent, "pf": pf, "tid": tid,
                               "group": group}
        self.save_meta(meta, STATE)
        self._unsettled(True)
        gdir = f"{groups}/{group}"
        m, types = str(mdir), f"{pdir}/mdev_supported_types"
        os.mkdir(m)
        _symlink(f"{m}/mdev_type", f"{types}/{tid}")
        _create_file(f"{m}/remove", "")
        os.mkdir(f"{m}/nvidia")
        _create_file(f"{m}/nvidia/vgpu_params", "\n")
        if pid is not None:
            _create_file(f"{m}/nvidia/{PLACEMENT_ATTR}", f"{pid}\n")
        os.makedirs(f"{gdir}/devices")
        _create_file(f"{gdir}/type", "DMA\n")
        _create_file(f"{gdir}/reserved_regions", "")
        _symlink(f"{gdir}/devices/{uuid}", m)
        _symlink(f"{m}/iommu_group", gdir)
        mdrv = self._rstr(self.host.s.path("sys", "bus", "mdev", "drivers", MDEV_DRIVER))
        _symlink(f"{m}/driver", mdrv)
        _symlink(f"{mdrv}/{uuid}", m)
        _symlink(f"{types}/{tid}/devices/{uuid}", m)
        # the mdev is bound to a VFIO driver: its group node appears (libvirt opens it)
        _create_file(f"{self._rstr(self.host.s.dev_vfio)}/{group}", "")
        self._place_on_gi(meta, pf, uuid, tid)
        # the vGPUs now: those read above and this one (the order does not matter to the counts)
        self.refresh_gpu(pf, meta, instances=present + [
            {"parent": parent, "type_id": tid, "id": uuid, "placement": pid}])
        # last: the device is whole once its bus link is there (vgpuhost finds mdevs by it)
        _symlink(str(bus_link), m)
        self._unsettled(False)

    def _mdev_remove(self, meta: dict, path: Path, mdir: Path, by_path: Dict[str, str],
                     value: str) -> None:
        uuid = mdir.name
        parent = by_path.get(self._below_root(os.path.dirname(str(mdir))))
        pf = self._pf_of_parent(meta, parent) if parent else None
        if value.strip() != "1":
            raise _fail(errno.EINVAL, path, "write 1 to remove")
        if self._fault(meta, "remove", [parent, pf], path):
            return
        if self.holders(uuid, meta):
            # remove_store() removes its own file first (device_remove_file_self): a second writer
            # meanwhile finds no remove file; then the unregister waits for the release
            _unlink(mdir / "remove")
            # the unregister goes on when the last holder closes (close_vgpu), even where this
            # writer is killed meanwhile: the kernel's wait after a signal is uninterruptible
            meta.setdefault("mdev_removing", {})[uuid] = {
                "dir": self._below_root(str(mdir)), "pf": pf}
            self._request_release(meta, uuid)
            raise _MustWait(uuid, lambda m: self._mdev_unregister(m, mdir, pf))
        self._mdev_unregister(meta, mdir, pf)

    def _mdev_unregister(self, meta: dict, mdir: Path, pf: Optional[str]) -> None:
        """The mdev at ``mdir`` goes: its links, its IOMMU group and node, its directory.  Recorded
        first (meta ``mdev_change``), so that pieces a killed writer leaves go at the next write; the
        bus link goes first (vgpuhost no longer finds the device), the directory last."""
        m = str(mdir)
        uuid = os.path.basename(m)
        if not os.path.isdir(m):
            return          # gone meanwhile (a blocked remove resumed after a reboot took it)
        tid = _type_of(m)
        group = _group_of(m)
        meta["mdev_change"] = {"op": "remove", "uuid": uuid, "pf": pf, "tid": tid,
                               "group": group, "dir": self._below_root(m)}
        self.save_meta(meta, STATE)
        self._unsettled(True)
        self._mdev_take_away(meta, m, uuid, tid, group, pf)
        self._unsettled(False)

    def _mdev_take_away(self, meta: dict, m: str, uuid: str, tid: Optional[str], group: Optional[int],
                        pf: Optional[str]) -> None:
        """Every piece of mdev ``uuid`` (device directory ``m``, type ``tid``, IOMMU group ``group``)
        that is there goes, the bus link first and the directory last; what is missing is passed
        over (a killed writer's leftovers: :meth:`_settle_mdev_change`).  GPU ``pf``'s counts are
        refreshed before the directory goes, counting the vGPU gone."""
        head = os.path.dirname(m)
        _unlink(f"{self._rstr(self.host.s.mdev_devices)}/{uuid}")
        if tid is not None:
            _unlink(f"{head}/mdev_supported_types/{tid}/devices/{uuid}")
        _unlink(f"{self._rstr(self.host.s.path('sys', 'bus', 'mdev', 'drivers', MDEV_DRIVER))}/{uuid}")
        if group is not None:
            _unlink(f"{self._rstr(self.host.s.dev_vfio)}/{group}")
            gdir = f"{self._rstr(self.host.s.iommu_groups)}/{group}"
            if os.path.isdir(gdir):
                try:
                    _rmtree(gdir)
                except OSError:
                    pass
        if pf is not None:
            self.refresh_gpu(pf, meta, instances=[
                i for i in self.instances(meta, pf) if i["id"] != uuid])
        if os.path.isdir(m):
            _rmtree(m)

    def sweep_mdev_leftovers(self, meta: dict, pf: str, parent: str) -> List[str]:
        """Take away every mdev-shaped directory (named by a UUID) under mdev parent ``parent`` of GPU
        ``pf`` that has no bus link (``bus/mdev/devices/<uuid>``): a device a killed writer left half
        made, which the kernel never shows.  The UUIDs taken away, sorted.  For :func:`.reboot.reboot`
        (under the lock)."""
        pdir = str(self._rdir(meta, parent))
        bus = self._rstr(self.host.s.mdev_devices)
        try:
            with os.scandir(pdir) as it:
                names = sorted(e.name for e in it if re.match(_UUID_PATTERN, e.name)
                               and e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        gone = [n for n in names if not os.path.lexists(f"{bus}/{n}")]
        for name in gone:
            m = f"{pdir}/{name}"
            self._mdev_take_away(meta, m, name, _type_of(m), _group_of(m), pf)
        return gone

    def _settle_mdev_change(self, meta: dict) -> None:
        """Finish the last mdev create or remove (meta ``mdev_change``) where its writer was killed
        half-way: a create whose bus link is missing, or a remove whose bus link is gone and whose device
        directory is still there, is taken away whole (a remove killed before it took anything away leaves
        the device as it was) (the kernel's create and remove are one write(2) each: a device
        is there completely or not at all).  One or two lstat calls when there is nothing to do."""
        ch = meta.get("mdev_change")
        if not ch:
            return
        self._settle_mdev_pieces(meta, ch)
        if not meta.get("vf_clear"):
            self._unsettled(False)          # (a clear cut short is :meth:`_settle_vf_clear`'s, after this)

    def _settle_mdev_pieces(self, meta: dict, ch: dict) -> None:
        """:meth:`_settle_mdev_change` of the record ``ch``: the pieces of a device cut short go."""
        uuid = ch.get("uuid") or ""
        if ch.get("op") == "create":
            if os.path.lexists(f"{self._rstr(self.host.s.mdev_devices)}/{uuid}"):
                return          # whole: the bus link is made last
            parent = ch.get("parent")
            if parent not in meta["devices"]:
                return
            m = f"{self._rdir(meta, parent)}/{uuid}"
        else:
            if os.path.lexists(f"{self._rstr(self.host.s.mdev_devices)}/{uuid}"):
                return          # the remove never began (its bus link goes first): the device stays whole
            m = f"{self._real_str.rstrip('/')}/{ch.get('dir')}" if ch.get("dir") else ""
        if not m or not os.path.lexists(m):
            return              # nothing laid out yet (a create's directory comes first), or all gone
        pf = ch.get("pf")
        self._mdev_take_away(meta, m, uuid, ch.get("tid"), ch.get("group"),
                             pf if pf in meta["gpus"] else None)

    def _settle_vf_clear(self, meta: dict) -> None:
        """Finish a vendor-VFIO clear (meta ``vf_clear``: the VF's ``nvidia`` folder) whose writer was killed
        between the type and the placement: a VF whose type is 0 gets its ``placement_id`` reset to "Not
        Applicable"; one still holding its type was never cleared (killed before its write).  Nothing
        to do: one dict lookup."""
        rel = meta.get("vf_clear")
        if not rel:
            return
        nvidia = f"{self._real_str.rstrip('/')}/{rel}"
        try:
            cur = _read_bytes(f"{nvidia}/current_vgpu_type").decode("utf-8", "replace").strip()
        except OSError:
            cur = ""
        if cur in ("", "0") and os.path.exists(f"{nvidia}/{PLACEMENT_ATTR}"):
            write_attr(f"{nvidia}/{PLACEMENT_ATTR}", "Not Applicable\n", if_changed=True)
        meta.pop("vf_clear", None)
        self.save_meta(meta, STATE)
        self._unsettled(False)

    def _unsettled(self, on: bool) -> None:
        """Make (``on``) or remove :data:`~vgpuhost.io.sysfs.SIM_UNSETTLED` beside ``state.json``: while it
        is there a write may be cut short, and a reader has :meth:`settle` look first.  Not a step of the
        tree (the kill tests' steps are the tree's): plain calls, under the lock."""
        path = f"{self.meta_path.parent}/{SIM_UNSETTLED}"
        if on:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def settle(self) -> bool:
        """A reader's look for a write cut short (:data:`~vgpuhost.io.sysfs.SIM_UNSETTLED` beside
        ``state.json``: its writer was killed inside it): under the lock, the mdev create or remove and the
        vendor-VFIO clear it recorded are finished as the next write would (:meth:`_settle_mdev_change`,
        :meth:`_settle_vf_clear`), so a read sees a device whole or not at all, as on a real host where the
        write is one write(2).  A live writer's write is waited for (it holds the lock), then found whole.
        :class:`vgpuhost.io.sysfs.Sysfs` calls it at its first read, :class:`vgpuhost.sim.nvml.SimNvml` at
        each query.  True when there was something to look at; one ``lstat`` when there is nothing."""
        if not os.path.lexists(f"{self.meta_path.parent}/{SIM_UNSETTLED}"):
            return False
        t0, c0 = _perf_counter(), _thread_time()
        try:
            with self.locked():
                try:
                    meta = self._write_meta()
                    self._settle_mdev_change(meta)
                    self._settle_vf_clear(meta)
                    self._unsettled(False)
                except BaseException:
                    _GPU_PARSED.pop(str(self.meta_path.parent), None)
                    raise
        finally:
            charge(_perf_counter() - t0, _thread_time() - c0)
        return True

    # --- vendor-specific VFIO ------------------------------------------------
    def _set_type(self, meta: dict, path: Path, vf: str, real: Path, value: str) -> None:
        pf = meta["devices"][vf].get("pf") or self._pf_of_parent(meta, vf)
        gpu = meta["gpus"].get(pf) if pf else None
        if gpu is None or gpu["backend"] != "vendor-vfio" or vf not in gpu["parents"]:
            raise _fail(errno.ENODEV, path, f"{vf} is not a vGPU-capable VF")
        text = value.strip()
        if not re.match(_DECIMAL_PATTERN, text):
            raise _fail(errno.EINVAL, path, f"not a decimal type id: {text[:40]!r}")
        new = int(text)
        if self._driver_of(meta, vf) != "nvidia":
            raise _fail(errno.ENODEV, path, f"{vf} is not bound to nvidia")
        cur_text = real.read_text().strip() or "0"
        cur = int(cur_text) if re.match(_DECIMAL_PATTERN, cur_text) else 0
        if new == 0:
            if cur == 0:
                raise _fail(errno.EPERM, path, f"{vf} holds no vGPU")
            if self.holders(vf, meta):
                raise _fail(errno.EPERM, path, f"{vf} is open (usage count not zero)")
            if self._fault(meta, "set_type", [vf, pf], path):
                return
            # the counts first, as they will be: a writer killed before the type goes leaves them
            # generous, never short (the type file is the vGPU; every check reads it, not the counts)
            self.refresh_gpu(pf, meta, instances=[i for i in self.instances(meta, pf) if i["id"] != vf])
            pfile = real.parent / PLACEMENT_ATTR
            if pfile.exists():
                # the driver clears type and placement in one write(2): recorded first, so that a writer
                # killed between the two files leaves the next write to reset the placement
                # (:meth:`_settle_vf_clear`), never a free VF still naming the old vGPU's placement
                meta["vf_clear"] = self._below_root(str(real.parent))
                self.save_meta(meta, STATE)
                self._unsettled(True)
            write_attr(real, "0\n")
            if pfile.exists():
                write_attr(pfile, "Not Applicable\n")
                meta.pop("vf_clear", None)
                self.save_meta(meta, STATE)
                self._unsettled(False)
            return
        else:
            if cur != 0:
                raise _fail(errno.EPERM, path, f"{vf} already holds vGPU type {cur}")
            tid = str(new)
            if tid not in gpu["types"]:
                raise _fail(errno.EINVAL, path, f"type {tid} not supported by {pf}")
            if self.available(meta, pf)[vf].get(tid, 0) <= 0:
                raise _fail(errno.ENOSPC, path, f"type {tid} not creatable on {vf} now")
            pfile = real.parent / PLACEMENT_ATTR
            pid = self._placement_for(meta, pf, tid, _placement_of(real.parent), path)
            if self._fault(meta, "set_type", [vf, pf], path):
                return
            if pid is not None:
                write_attr(pfile, f"{pid}\n")
            write_attr(real, f"{new}\n")
            self._place_on_gi(meta, pf, vf, tid)
        self.refresh_gpu(pf, meta)

    def _placement_write(self, meta: dict, path: Path, vf: str, real: Path, value: str) -> None:
        """A VF's ``nvidia/placement_id`` before its type is set: a decimal id, kept for the create
        (EINVAL otherwise; EPERM while the VF holds a vGPU)."""
        text = value.strip()
        if not re.match(_DECIMAL_PATTERN, text):
            raise _fail(errno.EINVAL, path, f"not a decimal placement id: {text[:40]!r}")
        cur = (real.parent / "current_vgpu_type").read_text().strip() if (real.parent / "current_vgpu_type").exists() else "0"
        if cur not in ("", "0"):
            raise _fail(errno.EPERM, path, f"{vf} holds a vGPU")
        write_attr(real, f"{int(text)}\n")

    def _placement_for(self, meta: dict, pf: str, tid: str, wanted: Optional[int], path: Path, *,
                       instances: Optional[List[dict]] = None) -> Optional[int]:
        """The placement id a new vGPU of ``tid`` takes on GPU ``pf`` in mixed-size mode (None in
        equal-size mode and for MIG-backed types): ``wanted`` (written to the VF's ``nvidia/placement_id``
        before the type) where it is one of the type's free ids, else EINVAL; none written: the
        best-fit free id (:func:`vgpuhost.model.mixedsize.best_id`); none free: ENOSPC."""
        gpu = meta["gpus"][pf]
        t = gpu["types"][tid]
        if not gpu.get("mixed_size") or gpu.get("mig_mode") or t.get("gi_profile"):
            return None
        units = grid_units(gpu)
        present = instances if instances is not None else self.instances(meta, pf)
        taken = taken_of(gpu, ((i["type_id"], i.get("placement")) for i in present))
        size = t["fb_mib"] // 1024
        if wanted is not None:
            if wanted not in mixedsize.free_ids(units, size, t["max_mixed"], taken):
                raise _fail(errno.EINVAL, path, f"placement id {wanted} is not a free placement of type {tid}")
            return wanted
        pid = mixedsize.best_id(units, size, t["max_mixed"], taken)
        if pid is None:
            raise _fail(errno.ENOSPC, path, f"no free placement for type {tid}")
        return pid

    def _vgpu_params(self, meta: dict, path: Path, real: Path, value: str) -> None:
        """nvidia-vgpu-vfio's ``vgpu_params_store``: E2BIG over 1024 bytes, EPERM while the mdev is
        open, else ``count - 1`` bytes kept (snprintf with size ``count``), shown with a newline."""
        data = value.encode("utf-8")
        if len(data) > _PARAMS_MAX:
            raise _fail(errno.E2BIG, path, f"{len(data)} bytes; at most {_PARAMS_MAX}")
        if self.holders(real.parent.parent.name, meta):
            raise _fail(errno.EPERM, path, "the vGPU is open")
        kept = data[:-1].decode("utf-8", "replace")
        write_attr(real, kept + "\n")


_IMPORT_DONE = _perf_counter()
_IMPORT_CPU_DONE = _thread_time()
