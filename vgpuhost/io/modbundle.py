"""The qemu hook's module bundle: the compiled code of the modules the hook imports, in one file.

Why: the handler is a new Python process on every domain start and stop, and
finding and loading its ~40 modules one by one (a path lookup, a ``stat`` of
the source, an open and read of the ``.pyc`` each) cost about 1.3 ms of each
such process (measured 2026-12-01 on the development machine, 20 runs each:
``python -I -S -c 'import <the prepare path's modules>'`` 19.2 ms, the same
served from one file 17.9 ms; ``python -I -S -c pass`` 6.8 ms).  This is
a hand-written stand-in for Python's path-based import of these modules, kept
only for the hook's start-up.

``vgpuhost hook install`` writes the bundle (:func:`build`) to
:func:`bundle_path` beside byte-compiling the package, and the dispatcher's
boot line calls :func:`use` before it imports the handler.  Each module keeps
its source's path, size and modification time (nanoseconds); a module is
served from the bundle only while its source still has them, as Python checks
a ``.pyc`` against its source, so a changed or upgraded package is never run
from a stale bundle: its modules load from their files.  A bundle that is
missing, unreadable, for another Python, writable by anyone but its owner, or
not owned by the user running the hook is ignored.  Never raises.

Format (:func:`pack`, :func:`unpack`): a 4-byte little-endian length N, then N bytes of ``marshal`` of
``(FORMAT, cache tag, {module name: (source path, size, mtime_ns, is package, offset, length, crc)})``,
then each module's ``marshal`` of its code, ``length`` bytes at ``offset`` counted from the end of that
index; ``crc`` is :func:`checksum` of the module's name and those bytes.
:func:`use` reads the index alone and keeps the file open; each module's code is read (``pread``) only
when it is imported.  Why: reading the whole 1.1 MB file and unmarshalling it into one object per module
cost 1.3 ms of each hook process, while a ``release end`` imports about half of the modules; the index
and one ``pread`` per imported module cost about 0.2 ms (measured 2026-12-07, below :func:`use`).  What
the hook runs is read from the file it opened and checked: replacing the file after that (a rename, as
``hook install`` writes it) does not change what it runs, and only its owner (root, the hook's user)
could write into it.

Damage (a bit flipped in the file, an index whose entries were swapped or changed by hand): each
module's code is checked against its ``crc`` after the ``pread``, before it is unmarshalled; a module
whose bytes do not match (or that do not unmarshal into code) loads from its file, as a stale one does,
so a damaged bundle costs speed, never a domain start or stop.  The name is part of the checksum, so
another module's intact code at a swapped offset fails it too.  Cost (2026-12-07, this machine, pyenv
CPython 3.11.7, which has neither ``zlib`` nor ``binascii`` built in): CRC-32 runs at about 0.25 ns a
byte (0.28 ms for all 54 modules' 1.1 MB); it comes from ``binascii`` (or ``zlib``) where the
interpreter has it built in (Debian's python3 has both), else from the ``binascii`` extension module,
whose ``dlopen`` (it and libz) is most of the cost; a pure-Python sum, ``hash(int.from_bytes(...))``,
costs 1.1 ms for the 1.1 MB, more than the load.  Measured in whole ``python -I -S`` processes (the
boot line, then the imports of a start: 26 modules served; of a stop: 11; 40 interleaved runs, median
CPU): a start +0.55 ms (19.85 -> 20.40 ms), a stop +0.44 ms (13.36 -> 13.79); with Debian's python3
(built in) +0.11 and +0.14 ms.  ``bench/hook.py --runs 10 --agent down --hosts
a40-mdev,l40s-vendor-vfio --tmpdir /dev/shm --growth ''`` (before, then after, one after the other;
load about 5): CPU - sim CPU / clean CPU a40-mdev 6.20 -> 6.51, l40s-vendor-vfio 6.95 -> 7.11.
"""

import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:   # annotations only (the qemu hook imports no typing)
    from typing import Dict, Iterable, Tuple

FORMAT = "vgpuhost-hook-bundle/3"
#: the formats older vgpuhosts wrote (1: one ``marshal`` of the whole file, before 2026-12-07; 2: this
#: layout without the checksums); ``hook status`` names them as such (:func:`check`)
OLDER_FORMATS = ("vgpuhost-hook-bundle/1", "vgpuhost-hook-bundle/2")
#: where ``hook install`` writes it, under the host root (FHS: a cache the program can rebuild)
BUNDLE_PARTS = ("var", "cache", "vgpuhost", "hook-modules.bundle")
MAX_BUNDLE_BYTES = 16 << 20

#: the modules the hook's ``prepare begin`` and ``release end`` import on a real host (and ``migrate
#: begin``'s own two, ops.migrate and policy.migration; it imports lxml too, on a live migration only) (vGPUs on mdev
#: and vendor VFIO, passthrough; tenancy's where it is in use), but ``vgpuhost``, ``vgpuhost.io`` and this module (imported before
#: the bundle is used).  tests/test_hook_bundle.py checks that the hook imports nothing of vgpuhost outside it.
MODULES = (
    "vgpuhost.hook", "vgpuhost.hook.runtime",
    "vgpuhost.io.backends", "vgpuhost.io.configfiles", "vgpuhost.io.files",
    "vgpuhost.io.hostroot", "vgpuhost.io.locks", "vgpuhost.io.process", "vgpuhost.io.state",
    "vgpuhost.io.sysfs", "vgpuhost.io.nvml", "vgpuhost.io.vfioholders", "vgpuhost.io.vgpudev",
    "vgpuhost.libvirt", "vgpuhost.libvirt.domxml",
    "vgpuhost.model", "vgpuhost.model.boards", "vgpuhost.model.errors", "vgpuhost.model.gputime",
    "vgpuhost.model.kinds",
    "vgpuhost.model.nvml", "vgpuhost.model.records", "vgpuhost.model.tenancy",
    "vgpuhost.model.values",
    "vgpuhost.observe", "vgpuhost.observe.inventory",
    "vgpuhost.ops", "vgpuhost.ops.admitting", "vgpuhost.ops.devices", "vgpuhost.ops.gputime", "vgpuhost.ops.health",
    "vgpuhost.ops.migrate", "vgpuhost.policy.migration",
    "vgpuhost.ops.passthrough",
    "vgpuhost.ops.recover", "vgpuhost.ops.tenancy", "vgpuhost.ops.vgpu",
    "vgpuhost.plan", "vgpuhost.plan.executor", "vgpuhost.plan.journal", "vgpuhost.plan.passthrough",
    "vgpuhost.plan.steps",
    "vgpuhost.policy", "vgpuhost.policy.admission", "vgpuhost.policy.binding", "vgpuhost.policy.compute",
    "vgpuhost.policy.demand",
    "vgpuhost.policy.feasibility", "vgpuhost.policy.health",
    "vgpuhost.policy.hookrequest", "vgpuhost.policy.hostdevs",
    "vgpuhost.policy.iommu",
    "vgpuhost.policy.offers", "vgpuhost.policy.placement",
)


def bundle_path(root: str) -> str:
    """``<root>/var/cache/vgpuhost/hook-modules.bundle`` (``root`` a string path)."""
    return os.path.join(root, *BUNDLE_PARTS)


def build(path: str, modules: "Iterable[str]" = MODULES) -> int:
    """Write the bundle of ``modules`` (those of the installed package that exist) to ``path``.

    Compiles each module's source as the import system would (its own
    ``from __future__`` lines, no optimisation), less its docstrings (:func:`_without_docstrings`), writes the file with mode 0644
    atomically (a temporary file renamed over it), and creates its directory
    (0755; one writable by others is made 0755).  Returns how many modules it
    holds.  Raises OSError when the file cannot be written, and (ELOOP) when
    the bundle's folder is a symbolic link: nothing is written through it, nor
    is what it points at chmodded (:func:`linked_folder`; ``hook install``
    refuses before it gets here).
    """
    from importlib.util import find_spec
    entries: "Dict[str, Tuple[str, int, int, bool, bytes]]" = {}
    for name in modules:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else None
        if not origin or not origin.endswith(".py"):
            continue
        with open(origin, "rb") as f:
            st = os.fstat(f.fileno())
            source = f.read()
        tree = _without_docstrings(source, origin)
        code = compile(tree, origin, "exec", flags=_lift_future_imports(tree), dont_inherit=True, optimize=0)
        entries[name] = (origin, st.st_size, st.st_mtime_ns, spec.submodule_search_locations is not None,
                         marshal.dumps(code))
    data = pack(FORMAT, sys.implementation.cache_tag, entries)
    import errno
    from pathlib import Path
    from .files import write_atomic
    folder = os.path.dirname(path) or "."
    if linked_folder(path):
        raise OSError(errno.ELOOP, "the bundle's folder is a symbolic link (remove the link)", folder)
    os.makedirs(folder, mode=0o755, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)   # ELOOP: a link now
    try:
        if os.fstat(fd).st_mode & 0o022:
            os.fchmod(fd, 0o755)            # writable by others: :func:`use` would not trust it
    finally:
        os.close(fd)
    write_atomic(Path(path), data, 0o644)
    return len(entries)


def linked_folder(path: str) -> "str | None":
    """The bundle's folder (``os.path.dirname(path)``) when it is a symbolic link, else None: the hook
    never uses a bundle there (:func:`use`) and :func:`build` never writes through it."""
    folder = os.path.dirname(path) or "."
    return folder if os.path.islink(folder) else None


def checksum(name: str, code: bytes) -> int:
    """CRC-32 of module ``name`` (UTF-8) followed by its code's bytes ``code``: an unsigned 32-bit int.
    The name binds the code to its module, so another module's intact code fails it."""
    crc = _crc32()
    return crc(code, crc(name.encode()))


_CRC = []


def _crc32():
    """``crc32`` of ``zlib`` or ``binascii`` (the same CRC-32): a built-in module where the interpreter has
    one, else the ``binascii`` extension module (loaded once, when the first module is checked)."""
    if not _CRC:
        if "binascii" in sys.builtin_module_names or "zlib" not in sys.builtin_module_names:
            import binascii as mod
        else:
            import zlib as mod
        _CRC.append(mod.crc32)
    return _CRC[0]


def pack(fmt: str, tag: str, entries: dict) -> bytes:
    """The bundle file's bytes (module docstring: format) for ``entries`` ``{module name: (source path, size,
    mtime_ns, is package, marshal of its code)}``, each with its :func:`checksum`; an entry of another
    shape is written as it is, without code (the hook skips it)."""
    index = {}
    blobs = []
    offset = 0
    for name, entry in entries.items():
        if type(entry) is tuple and len(entry) == 5 and type(entry[4]) is bytes:
            index[name] = tuple(entry[:4]) + (offset, len(entry[4]), checksum(name, entry[4]))
            blobs.append(entry[4])
            offset += len(entry[4])
        else:
            index[name] = entry
    head = marshal.dumps((fmt, tag, index))
    return len(head).to_bytes(4, "little") + head + b"".join(blobs)


def unpack(data: bytes) -> "Tuple[str, str, dict]":
    """``(format, cache tag, entries)`` of a bundle file's bytes, the inverse of :func:`pack` (each entry
    with its code's bytes, its checksum left out); raises ValueError (or what ``marshal`` raises) on a
    malformed file."""
    size = int.from_bytes(data[:4], "little")
    fmt, tag, index = marshal.loads(data[4:4 + size])
    base = 4 + size
    entries = {}
    for name, entry in index.items():
        if type(entry) is tuple and len(entry) == 7:
            offset, length = entry[4], entry[5]
            entry = tuple(entry[:4]) + (data[base + offset:base + offset + length],)
        entries[name] = entry
    return fmt, tag, entries


def _without_docstrings(source: bytes, origin: str):
    """The module's syntax tree without its docstrings (the module's, each class's and function's), line
    numbers kept: what the hook runs does not read ``__doc__``, and they were about half the bundle's bytes,
    all read and unmarshalled on every domain start and stop.  Assertions stay (``optimize=2`` would drop
    them too).  A body left empty gets ``pass``."""
    import ast
    tree = ast.parse(source, origin)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body.pop(0)
                if not body:
                    body.append(ast.copy_location(ast.Pass(), first))
    return tree


def _lift_future_imports(tree) -> int:
    """Take the ``from __future__ import ...`` statements out of the module's syntax tree ``tree``; the
    compiler flags that give the same semantics (``compile(..., flags=...)``).  Why: the statement also
    imports the ``__future__`` module at run time, a search of ``sys.path`` and a module to run (about
    0.2 ms of each hook process, 2026-12-07); the module's code then lacks only the ``annotations``
    name the statement binds, which no vgpuhost module reads."""
    import ast
    import __future__
    flags = 0
    body = tree.body
    keep = []
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__" and not node.level:
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
        else:
            keep.append(node)
    if not keep and body:
        keep.append(ast.copy_location(ast.Pass(), body[0]))
    tree.body = keep
    return flags


class _Finder:
    """A ``sys.meta_path`` finder and loader serving the bundle's modules whose source is unchanged and
    lies in ``package`` (the directory of the ``vgpuhost`` package this process imported)."""

    def __init__(self, entries: dict, package: str, fd: int, base: int):
        """``entries``: the bundle's index; ``fd``: the bundle, open (kept open for the process's life,
        close-on-exec); ``base``: where the code starts in it."""
        self.entries = entries
        self.package = package
        self.fd = fd
        self.base = base
        self.code: dict = {}

    def find_spec(self, name, path=None, target=None):
        entry = self.entries.pop(name, None)
        if entry is None:
            return None
        try:
            origin, size, mtime_ns, package, offset, length, crc = entry
            if not (type(offset) is int and type(length) is int and 0 <= offset and 0 < length
                    and _inside(origin, self.package)):
                return None                 # another installation's module, or not an entry: the file's own import
            st = os.stat(origin)
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
                return None                 # changed since the bundle was written
            blob = os.pread(self.fd, length, self.base + offset)
            if len(blob) != length or checksum(name, blob) != crc:
                return None                 # damaged (or truncated since it was opened): the file's own import
            code = marshal.loads(blob)
        except Exception:                   # a malformed entry: the file's own import
            return None
        if type(code) is not _CodeType:
            return None
        self.code[name] = code
        spec = _ModuleSpec(name, self, origin=origin, is_package=bool(package))
        if package:
            spec.submodule_search_locations = [os.path.dirname(origin)]
        spec.has_location = True
        return spec

    def create_module(self, spec):
        return None                         # the default module object

    def exec_module(self, module) -> None:
        exec(self.code.pop(module.__spec__.name), module.__dict__)   # noqa: S102 - the package's own code


_ModuleSpec = type(sys.modules[__name__].__spec__)   # importlib.machinery.ModuleSpec, without importing importlib
_CodeType = type(_ModuleSpec.__init__.__code__)


def _inside(origin: object, package: "str | None") -> bool:
    """``origin`` is a normalised path under ``package`` (no ``..`` climbing out of it; a string test,
    not a ``realpath``, which would cost each hook start a few hundred lstat calls)."""
    return (type(origin) is str and bool(package) and origin.startswith(package)
            and os.path.normpath(origin) == origin)


def _trusted_dir(path: str) -> bool:
    """The bundle's directory: a real directory (not a symlink) owned by this user, writable by no one else."""
    try:
        st = os.lstat(os.path.dirname(path) or ".")
    except OSError:
        return False
    return (st.st_mode & 0o170000) == 0o040000 and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _package(package_dir: "str | None") -> "str | None":
    """``package_dir``, or the directory of the ``vgpuhost`` package this process imported; with a slash."""
    if package_dir is None:
        pkg = getattr(sys.modules.get("vgpuhost"), "__path__", None)
        package_dir = list(pkg)[0] if pkg else None
    return os.path.join(os.path.realpath(package_dir), "") if package_dir else None


#: how much of the file :func:`_read` reads first: the index (about 8 KB for the hook's modules) fits
HEAD_BYTES = 32 << 10


def _read(path: str) -> "Tuple[str, dict | None, int, int]":
    """``(state, index, fd, base)`` of the bundle at ``path``: ``ok``, its index (module docstring: format),
    the file open (close-on-exec; the caller closes it) and where the code starts; or why it is not used
    (``missing``, ``untrusted``, ``unreadable``), None, -1, 0.  Never raises."""
    if not _trusted_dir(path):
        return ("missing" if not os.path.lexists(os.path.dirname(path) or ".") else "untrusted"), None, -1, 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "missing", None, -1, 0
    except OSError:
        return "untrusted", None, -1, 0     # a symlink (ELOOP), or unreadable
    state = "unreadable"
    try:
        st = os.fstat(fd)
        if ((st.st_mode & 0o170000) != 0o100000 or st.st_uid != os.geteuid() or st.st_mode & 0o022
                or st.st_size > MAX_BUNDLE_BYTES):
            state = "untrusted"             # code others could have written: never run it as root
            raise ValueError(state)
        head = os.pread(fd, HEAD_BYTES, 0)
        size = int.from_bytes(head[:4], "little")
        if 4 + size > st.st_size:
            raise ValueError("truncated")
        if 4 + size > len(head):
            head = os.pread(fd, 4 + size, 0)
        fmt, tag, index = marshal.loads(head[4:4 + size])
        if fmt != FORMAT or tag != sys.implementation.cache_tag or type(index) is not dict:
            raise ValueError("foreign")
        base = 4 + size
        end = max((e[4] + e[5] for e in index.values()
                   if type(e) is tuple and len(e) == 7 and type(e[4]) is int and type(e[5]) is int), default=0)
        if base + end != st.st_size:
            raise ValueError("truncated")   # or grown: not the file build() wrote
    except Exception:       # a truncated or foreign file, or one not to be trusted
        os.close(fd)
        return state, None, -1, 0
    return "ok", index, fd, base


def use(path: str, package_dir: "str | None" = None) -> int:
    """Serve the modules of the bundle at ``path`` from now on; how many it holds (0: not used).

    Used only when it is a regular file (opened without blocking: a FIFO planted there cannot hang a
    domain start) of at most :data:`MAX_BUNDLE_BYTES` bytes, owned by this user and writable by no
    one else, in a directory that is the same, and only for modules under ``package_dir`` (default:
    the directory of the ``vgpuhost`` package this process imported, so another installation's bundle
    is not run).  Keeps the file open (close-on-exec) while it is used: each module's code is read
    when it is imported.
    """
    package = _package(package_dir)
    if not package:
        return 0
    state, index, fd, base = _read(path)
    if index is None:
        return 0
    sys.meta_path.insert(0, _Finder(index, package, fd, base))
    return len(index)


def check(path: str, package_dir: "str | None" = None) -> dict:
    """What the hook would make of the bundle at ``path`` (``hook status``): ``{"state", "modules",
    "stale", "damaged"}``.  ``state`` is ``current`` (every module served), ``stale`` (``stale`` lists the
    modules whose source changed since, or that lie outside the package: they load from their files),
    ``damaged`` (``damaged`` lists the modules whose code fails its checksum or does not unmarshal into
    code: they load from their files), ``missing``, ``untrusted`` (not a regular file of this user's that
    no one else may write, in such a folder), ``folder-symlink`` (its folder is a symbolic link:
    ``hook install`` refuses to write through it), ``old-format`` (an older vgpuhost's bundle,
    :data:`OLDER_FORMATS`), ``other-python`` (for another Python's bytecode) or ``unreadable`` (cut
    short, grown, or not a bundle); ``hook install`` writes it anew but for ``folder-symlink``.
    ``modules``: how many it holds (0 when it is not used).  Never raises."""
    package = _package(package_dir)
    state, entries, fd, base = _read(path)
    if entries is None:
        if state == "untrusted" and linked_folder(path):
            state = "folder-symlink"
        elif state == "unreadable":
            state = _why_unreadable(path)
        return {"state": state, "modules": 0, "stale": [], "damaged": []}
    stale = []
    damaged = []
    try:
        for name, entry in sorted(entries.items()):
            try:
                origin, size, mtime_ns, _, offset, length, crc = entry
                st = os.stat(origin)
                fresh = _inside(origin, package) and (st.st_size, st.st_mtime_ns) == (size, mtime_ns)
            except Exception:
                fresh = False
            if not fresh:
                stale.append(str(name))
                continue
            try:
                blob = os.pread(fd, length, base + offset)
                sound = (len(blob) == length and checksum(name, blob) == crc
                         and type(marshal.loads(blob)) is _CodeType)
            except Exception:
                sound = False
            if not sound:
                damaged.append(str(name))
    finally:
        os.close(fd)
    state = "damaged" if damaged else "stale" if stale else "current"
    return {"state": state, "modules": len(entries), "stale": stale, "damaged": damaged}


def _why_unreadable(path: str) -> str:
    """``old-format``, ``other-python`` or ``unreadable`` (:func:`check`) for a bundle file that
    :func:`_read` could not use though it may be trusted."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BUNDLE_BYTES + 1)
    except OSError:
        return "unreadable"
    heads = []
    for parse in (lambda: marshal.loads(data),                                       # format 1: one marshal
                  lambda: marshal.loads(data[4:4 + int.from_bytes(data[:4], "little")])):   # 2 and 3
        try:
            head = parse()
        except Exception:
            continue
        if type(head) is tuple and len(head) == 3:
            heads.append(head)
    for fmt, tag, _ in heads:
        if fmt in OLDER_FORMATS:
            return "old-format"
        if fmt == FORMAT and tag != sys.implementation.cache_tag:
            return "other-python"
    return "unreadable"
