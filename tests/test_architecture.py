"""The house rules of the package layout, read from the source with :mod:`ast` (nothing is imported).

Layers, lowest first (docs/development/architecture.md)::

    model < io < {libvirt, observe} < policy < plan < ops < hook < present < {cli, agent}

``cli`` and ``agent`` sit side by side at the top and never import each other: the
program's entry point (``vgpuhost/__main__.py``) hands the CLI's ``vgpuhost agent``
command the agent's server.

A module imports only from its own layer or lower ones; ``vgpuhost/__main__.py`` and
``vgpuhost/demo.py`` are entry points and may import any layer.  ``sim/`` is the
simulator: it may import ``model`` and ``io`` (not ``io/backends``, which loads it).
Only the simulator's own commands (``cli/sim.py``) and the demo import it; product
code meets its stand-ins through ``io/backends.py``, which names them in its
``SIMULATED`` table and never imports ``sim`` (checked: every name there exists).

Doors: file, ``/proc`` and ``/sys`` access (``open()``, ``os`` file calls, ``Path``
reads, writes and listings, ``shutil``, ``subprocess``, ``tempfile``, ``fcntl``)
happens only in ``io/`` (and in ``sim/``, which *is* the simulated outside);
``pynvml`` only in ``io/nvml_pynvml.py``, the ``libvirt`` binding only in
``io/virt.py``, ``sqlite3`` only in ``io/state.py``.

Concepts: a concept's spelling (vgpuhost/model/concepts.py: ``"first-fit"``, ``"guaranteed"``, ...)
is written only in ``model/`` (and ``sim/``) where it is used as the concept; elsewhere code names the
enum member, or in the hook's modules model/kinds' plain copy (:func:`concept_literals`).

Imports sit at the top of a module, where the module-level graph shows them, except in the
modules a new process runs at start-up (the qemu hook's closure and the lean read commands:
:func:`local_imports`, with the hook's cost as the reason) and for an optional third-party
module inside its door; no ``TYPE_CHECKING`` shims elsewhere.

Also: no cycle in the graph of packages, no import cycle between modules (module-level and function-level imports
alike), package ``__init__.py`` files hold a docstring only (the top-level one may
also hold ``__version__``, which setup.cfg reads), and no ``cli`` module imports a
private name (``_x``) from another module.

Violations known when this test landed are listed in :data:`KNOWN`, each with the
engineer whose files hold it.  The test fails on a violation not listed AND on a
listed one that is gone, so the list only shrinks: whoever fixes one deletes its
line.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PKG = Path(__file__).resolve().parents[1] / "vgpuhost"

RANK = {"model": 0, "io": 1, "libvirt": 2, "observe": 2, "policy": 3, "plan": 4, "ops": 5, "hook": 6, "present": 7,
        "cli": 8, "agent": 8}
#: packages outside the layer order: the simulator (its own rules below)
UNRANKED = {"sim"}
ENTRY_POINTS = {"vgpuhost.__main__", "vgpuhost.demo"}
BACKENDS = "vgpuhost.io.backends"
#: the modules that import the simulator: its own commands and the demo
SIM_USERS = {"vgpuhost.cli.sim", "vgpuhost.demo"}

#: modules that stand for the outside world's file I/O
FILE_MODULES = {"shutil", "subprocess", "tempfile", "fcntl", "glob", "fileinput", "mmap"}
#: ``os`` / ``os.path`` functions that touch the file system
OS_FILE_CALLS = {
    "open", "fdopen", "read", "write", "close", "listdir", "scandir", "walk", "stat", "lstat", "fstat", "access",
    "mkdir", "makedirs", "rmdir", "removedirs", "remove", "unlink", "rename", "renames", "replace", "link",
    "symlink", "readlink", "chmod", "chown", "lchown", "utime", "truncate", "fsync", "mkfifo", "mknod",
    "exists", "lexists", "isfile", "isdir", "islink", "ismount", "getsize", "getmtime", "realpath", "samefile",
    "system", "popen", "execv", "execve", "execvp", "spawnv", "fork", "kill", "killpg",
}
#: ``pathlib.Path`` methods that touch the file system (matched by attribute name)
PATH_FILE_METHODS = {
    "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "glob", "rglob", "exists", "is_dir",
    "is_file", "is_symlink", "is_mount", "mkdir", "rmdir", "unlink", "touch", "symlink_to", "hardlink_to",
    "readlink", "resolve", "samefile", "lchmod", "chmod", "lstat", "open",
}
#: receivers whose same-named methods are io/'s doors, not pathlib (``fs.exists(path)`` is a Sysfs call, ``files.exists(path)`` io/files.py)
DOOR_RECEIVERS = {"fs", "sysfs", "_fs", "store", "files"}
#: the only module allowed to import each outside binding
DOORS = {"pynvml": "vgpuhost.io.nvml_pynvml", "libvirt": "vgpuhost.io.virt", "sqlite3": "vgpuhost.io.state",
         "_sqlite3": "vgpuhost.io.state"}


# ---------------------------------------------------------------------------
# reading the package

def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute dotted name ``from X import ...`` names in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> Iterator[Tuple[str, int, List[str]]]:
    """``(imported module, line, names)`` for every import statement anywhere in ``module``
    (``names``: the names a ``from`` import takes from that module, else [])."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, []
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            plain: List[str] = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, node.lineno, []
                else:
                    plain.append(alias.name)
            if plain or not node.names:
                yield target, node.lineno, plain


def _internal(name: str) -> Optional[str]:
    """The vgpuhost module an imported name lands in (the longest known prefix), or None."""
    if name != "vgpuhost" and not name.startswith("vgpuhost."):
        return None
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _layer(module: str) -> Optional[str]:
    """The subpackage a module lives in (``io``, ``sim``, ...); None for top-level modules."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and _is_package(module)):
        return parts[1]
    return None


def graph() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in imports(module):
            dest = _internal(target)
            if dest and dest != module:
                edges[module].add(dest)
    return edges


# ---------------------------------------------------------------------------
# the rules: each yields (rule, module, detail)

def layer_violations() -> Iterator[Tuple[str, str, str]]:
    for module, targets in graph().items():
        src = _layer(module)
        for dest in sorted(targets):
            dst = _layer(dest)
            if dst is None:             # the top-level package (__version__ only) and the entry points
                continue
            if src == "sim":
                if dst not in ("model", "io", "sim") or dest == BACKENDS:
                    yield "layer", module, dest
            elif dst == "sim":
                if module not in SIM_USERS:
                    yield "simulator", module, dest
            elif src in RANK and RANK[dst] > RANK[src]:
                yield "layer", module, dest


def cycles() -> Iterator[Tuple[str, str, str]]:
    """Each strongly connected component of more than one module, named by its sorted members."""
    edges = graph()
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:         # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    for comp in found:
        yield "cycle", comp[0], " ".join(comp[1:])


def _receiver(node: ast.expr) -> str:
    """The last name of a call's receiver: ``fs`` for ``fs.x()`` and ``self.fs.x()``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _file_access(module: str) -> Iterator[str]:
    tree = TREES[module]
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in FILE_MODULES:
                    yield f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            root = node.module.split(".")[0]
            if root in FILE_MODULES:
                yield f"from {node.module} import"
            if node.module in ("os", "os.path"):
                for alias in node.names:
                    if alias.name in OS_FILE_CALLS:
                        yield f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id == "open":
                yield "open()"
            elif isinstance(fn, ast.Attribute):
                owner = fn.value
                if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) \
                        and owner.value.id in os_names and owner.attr == "path" and fn.attr in OS_FILE_CALLS:
                    yield f"os.path.{fn.attr}()"
                elif isinstance(owner, ast.Name) and owner.id in os_names and fn.attr in OS_FILE_CALLS:
                    yield f"os.{fn.attr}()"
                elif fn.attr in PATH_FILE_METHODS and _receiver(owner) not in os_names | DOOR_RECEIVERS:
                    yield f".{fn.attr}()"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(("/proc/", "/sys/")) or node.value in ("/proc", "/sys"):
                yield f"literal {node.value!r}"


def door_violations() -> Iterator[Tuple[str, str, str]]:
    for module in MODULES:
        layer = _layer(module)
        if layer not in ("io", "sim"):
            seen: Set[str] = set()
            for what in _file_access(module):
                if what not in seen:
                    seen.add(what)
                    yield "file-access", module, what
        for target, _, _ in imports(module):
            root = target.split(".")[0]
            if root in DOORS and DOORS[root] != module:
                yield "door", module, root


def init_violations() -> Iterator[Tuple[str, str, str]]:
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        body = TREES[module].body
        for i, stmt in enumerate(body):
            if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                continue
            if module == "vgpuhost" and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                    and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == "__version__" \
                    and isinstance(stmt.value, ast.Constant):
                continue
            yield "init", module, f"line {stmt.lineno}"
            break


def private_imports() -> Iterator[Tuple[str, str, str]]:
    for module in MODULES:
        if _layer(module) != "cli":
            continue
        for target, _, names in imports(module):
            dest = _internal(target)
            if dest is None or dest == module:
                continue
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    yield "private", module, f"{dest}.{name}"


#: Modules that import where a path needs a module, not at the top: what a new Python process runs on
#: every domain start and stop (the qemu hook's import closure, :data:`vgpuhost.io.modbundle.MODULES`, which
#: tests/test_hook_bundle.py holds to what the hook really imports) and on a lean read command
#: (``vgpuhost types|gpus``, tests/test_cli_lean.py).  The reason is their start-up cost: the hook's
#: ``prepare begin`` pays for every module it loads (bench/hook.py).  Everywhere else imports sit at the
#: top, so the module-level graph is the real one.
#: what the hook's handler imports when it tries the agent itself (a hook installed without the thin
#: client or curl, hook/runtime.py): part of the hook's start-up, held by tests/test_hook.py to import no
#: json, re or socket before it knows an agent is there
HOOK_AGENT_CALL = {"vgpuhost.io.agentclient", "vgpuhost.io.unixsock"}
LEAN_READ = {"vgpuhost.__main__", "vgpuhost.cli", "vgpuhost.cli.context", "vgpuhost.cli.entry", "vgpuhost.cli.lean",
             "vgpuhost.cli.output", "vgpuhost.present", "vgpuhost.present.inventory"}
#: third-party modules a host may lack, imported at first use behind ``except ImportError`` in their door
OPTIONAL = {"pynvml": "vgpuhost.io.nvml_pynvml", "libvirt": "vgpuhost.io.virt"}


def hook_closure() -> Set[str]:
    """The names in io/modbundle.py's ``MODULES`` tuple, plus what imports before the bundle is used."""
    tree = TREES["vgpuhost.io.modbundle"]
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODULES" for t in node.targets):
            return {e.value for e in node.value.elts} | {"vgpuhost", "vgpuhost.io", "vgpuhost.io.modbundle"}
    raise AssertionError("io/modbundle.py has no MODULES tuple")


def start_up_modules() -> Set[str]:
    return hook_closure() | HOOK_AGENT_CALL | LEAN_READ


def local_imports() -> Iterator[Tuple[str, str, str]]:
    """Imports below the top of a module (in a function, a class or an ``if TYPE_CHECKING:`` block)
    and ``TYPE_CHECKING`` shims, outside the start-up modules; an optional third-party module in its door aside."""
    start_up = start_up_modules()
    for module, tree in TREES.items():
        if module in start_up:
            continue
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
                if all(OPTIONAL.get(n) == module for n in names):
                    continue
                yield "local-import", module, f"line {node.lineno}"
            elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                yield "type-checking-shim", module, f"line {node.lineno}"


def side_by_side() -> Iterator[Tuple[str, str, str]]:
    """``cli`` and ``agent`` share a rank and never import each other (what both serve lives in ``present``)."""
    for module, targets in graph().items():
        src = _layer(module)
        for dest in sorted(targets):
            if {src, _layer(dest)} == {"cli", "agent"}:
                yield "side-by-side", module, dest


def _concept_values() -> Dict[str, Tuple[str, ...]]:
    """The concept vocabularies of vgpuhost/model/concepts.py, read from its source: enum name -> spellings."""
    out: Dict[str, Tuple[str, ...]] = {}
    for node in TREES["vgpuhost.model.concepts"].body:
        if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "StrEnum" for b in node.bases):
            out[node.name] = tuple(s.value.value for s in node.body if isinstance(s, ast.Assign)
                                   and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
    return out


CONCEPTS = _concept_values()
#: spelling -> the concepts it belongs to
CONCEPT_OF: Dict[str, Set[str]] = {}
for _name, _values in CONCEPTS.items():
    for _v in _values:
        CONCEPT_OF.setdefault(_v, set()).add(_name)
#: words that are also plain English, YAML keys, CLI families or another vocabulary's values -> the names
#: beside which they are the concept (``owner == "manual"``, ``rec.backend != "mdev"``); never alone.
#: ``mdev`` is also libvirt's ``<hostdev type='mdev'>`` (beside ``pci``), ``vgpu`` and ``scheduler`` also a
#: made-device tag, a YAML key and a CLI family.
AMBIGUOUS: Dict[str, Tuple[str, ...]] = {
    "mdev": ("backend",), "passthrough": ("kind",), "vgpu": (), "module": (), "scheduler": (), "sriov": (),
    "layout": ("owner",), "manual": ("owner",), "domain": ("owner",),
    "shared": ("isolation",), "exclusive": ("isolation",), "hardware": ("isolation",),
    "guaranteed": ("qos",), "spread": ("strategy",), "reserve": ("strategy",),
}
#: concepts whose ambiguous words alone, two or more in one tuple or dict, are still that concept
#: (``("manual", "layout")``); ``("vgpu", "passthrough")`` may be a family, a mode or a key list
COLLECTED_AMBIGUOUS = {"OwnerKind", "Isolation"}


def _hint(node: ast.expr) -> str:
    """The name an expression goes by: ``strategy`` for ``req.strategy``, ``kind`` for ``r["kind"]`` and
    ``h.get("kind")``, ``owner`` for ``"--owner"``; "" when it has none."""
    if isinstance(node, ast.Name):
        return node.id.lower()
    if isinstance(node, ast.Attribute):
        return node.attr.lower()
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.slice.value.lower()
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value.lower()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lstrip("-").replace("-", "_").lower()
    return ""


def _named(value: str, hint: str) -> bool:
    """A concept value used as a concept: unambiguous, or ambiguous beside a name of one of its concepts."""
    if value not in CONCEPT_OF:
        return False
    if value not in AMBIGUOUS:
        return True
    return any(hint.endswith(h) for h in AMBIGUOUS[value])


def _strings(node: ast.expr) -> List[str]:
    """The string constants of a constant or of a tuple/list/set of them ([] for anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _vocabulary(values: List[str]) -> List[str]:
    """The values of a collection (two or more) that all belong to one concept, as its copy; else []."""
    if len(values) < 2 or not all(v in CONCEPT_OF for v in values):
        return []
    common = set.intersection(*(CONCEPT_OF[v] for v in values))
    if not common or (all(v in AMBIGUOUS for v in values) and not common & COLLECTED_AMBIGUOUS):
        return []
    return values


def _concept_uses(tree: ast.Module) -> Iterator[Tuple[int, str, str]]:
    """``(line, value, context)`` for each concept literal used as a concept in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                left, right = sides[i], sides[i + 1]
                for mine, other in ((left, right), (right, left)):
                    for v in _strings(mine):
                        if _named(v, _hint(other)):
                            yield node.lineno, v, "comparison"
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name == "Choice":
                for arg in node.args:
                    values = _strings(arg)
                    for v in values:
                        if v in CONCEPT_OF and (v not in AMBIGUOUS or _vocabulary(values)):
                            yield node.lineno, v, "click.Choice"
            option = next((_hint(a) for a in node.args if isinstance(a, ast.Constant)
                           and isinstance(a.value, str) and a.value.startswith("--")), "")
            for kw in node.keywords:
                if kw.arg == "default":
                    for v in _strings(kw.value):
                        if _named(v, option):
                            yield node.lineno, v, "default="
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                for v in _strings(default):
                    if _named(v, arg.arg.lower()):
                        yield default.lineno, v, f"default of {arg.arg}"
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            for v in _strings(node.value):
                if _named(v, node.target.id.lower()):
                    yield node.lineno, v, f"default of {node.target.id}"
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            for v in _strings(node.values[-1]):
                if v in CONCEPT_OF and v not in AMBIGUOUS:
                    yield node.lineno, v, "fallback (or)"
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            for v in _vocabulary(keys if len(keys) == len(node.keys) else []):
                yield node.lineno, v, "dict key"
            values = [x.value for x in node.values if isinstance(x, ast.Constant) and isinstance(x.value, str)]
            for v in _vocabulary(values if len(values) == len(node.values) else []):
                yield node.lineno, v, "dict value"
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = _strings(node)
            for v in _vocabulary(values if len(values) == len(node.elts) else []):
                yield node.lineno, v, "vocabulary copy"


def concept_literals() -> Iterator[Tuple[str, str, str]]:
    """A concept's spelling (vgpuhost/model/concepts.py) is written only in ``model/``: elsewhere code names
    the enum member (or, in the hook's modules, model/kinds' and model/tenancy's plain copies).

    Rejected where the literal is used as the concept: an operand of ``==``/``!=``/``in``/``not in``
    (with the constants of a tuple, list or set on the other side), an argument of ``click.Choice``, a
    ``default=`` of a concept's option, a parameter's or field's default, an ``x or "first-fit"``
    fallback, the keys or values of a dict, or the members of a tuple, list or set, that are all one
    concept's.  Not rejected: docstrings, command and family names, file names, messages.  Ambiguous
    words (:data:`AMBIGUOUS`) count only beside a name of their concept.
    The simulator (``sim/``) models the outside and spells what the kernel and NVML spell."""
    for module, tree in TREES.items():
        if _layer(module) in ("model", "sim"):
            continue
        for line, value, context in sorted(set(_concept_uses(tree))):
            yield "concept-literal", module, f"line {line}: {value!r} ({context})"


def package_cycles() -> Iterator[Tuple[str, str, str]]:
    """No cycle in the graph of packages (``io``, ``sim``, ...), every edge counted."""
    edges: Dict[str, Set[str]] = {}
    for module, targets in graph().items():
        src = _layer(module)
        if src is None:
            continue
        for dest in targets:
            dst = _layer(dest)
            if dst is None or dst == src:
                continue
            edges.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v == goal:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(edges.get(v, ()))
        return False

    for src in sorted(edges):
        for dst in sorted(edges[src]):
            if reaches(dst, src):
                yield "package-cycle", src, dst


#: the vGPU kernel interface's attribute and directory names (docs/reference/hardware.md#mdev, #vendor-vfio)
KERNEL_ATTRS = {"mdev_type", "current_vgpu_type", "creatable_vgpu_types", "mdev_supported_types",
                "available_instances", "vgpu_params"}
#: names of that interface that are plain words too (a driver, a CLI verb): kernel paths only as path components
KERNEL_WORDS = {"nvidia", "create", "remove"}
#: the one module that spells the vGPU kernel interface (``sim/``, the simulated kernel, does too)
VGPU_DOOR = "vgpuhost.io.vgpudev"


def _is_path_join(fn: ast.expr) -> bool:
    """``os.path.join``, ``path.join``, a bare ``join``/``_join`` (never ``", ".join``) and ``.joinpath``."""
    if isinstance(fn, ast.Name):
        return fn.id in ("join", "_join")
    if isinstance(fn, ast.Attribute):
        return fn.attr == "joinpath" or (fn.attr == "join" and _receiver(fn.value) == "path")
    return False


def _docstrings(tree: ast.AST) -> Set[int]:
    """ids of the string constants that stand alone as statements (docstrings and their like)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _kernel_components(text: str) -> Set[str]:
    """The vGPU kernel attribute names a path-spelled string holds as components (``nvidia/vgpu_params``)."""
    return set(text.split("/")) & KERNEL_ATTRS if "/" in text else set()


def _kernel_attr_uses(tree: ast.AST) -> Iterator[str]:
    """The spellings of the vGPU kernel interface a module's code (not its docstrings) builds paths with."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):      # an f-string: its text, each {...} a component boundary
            skip.update(id(v) for v in node.values)
            text = "".join(v.value if isinstance(v, ast.Constant) else "/" for v in node.values)
            for name in sorted(_kernel_components(text)):
                yield f"f-string {name!r}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for name in sorted(_kernel_components(node.value)):
                yield f"path {node.value!r}"
        operands: List[ast.expr] = []
        words = KERNEL_ATTRS | KERNEL_WORDS
        if isinstance(node, ast.Call) and (_is_path_join(node.func) or (
                isinstance(node.func, ast.Attribute) and _receiver(node.func.value) in DOOR_RECEIVERS)):
            operands = list(node.args) + [k.value for k in node.keywords]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            operands, words = [node.left, node.right], KERNEL_ATTRS
        for op in operands:
            if isinstance(op, ast.Constant) and isinstance(op.value, str) and op.value in words:
                yield f"component {op.value!r}"


def kernel_attrs() -> Iterator[Tuple[str, str, str]]:
    """The vGPU kernel interface (classic mdev and vendor VFIO: ``mdev_type``, ``current_vgpu_type``,
    ``creatable_vgpu_types``, ``mdev_supported_types``, ``available_instances``, ``vgpu_params``, the
    ``nvidia/`` directory and the ``create``/``remove`` files) is spelled only in its door,
    ``io/vgpudev.py``, and in ``sim/``, which simulates that kernel.

    What counts is a path built with those names: a string constant or f-string spelled as a path
    whose ``/``-separated components include an attribute name (``"nvidia/vgpu_params"``,
    ``f"{d}/mdev_type"``), and a bare name or word as an operand of a path operation (an
    ``os.path.join`` argument, a ``/`` operand, an argument of a ``fs.``/``sysfs.`` door call; a
    ``+`` operand for the attribute names).  Docstrings and comments name them freely, and so
    does data that merely shares a name: the ``available_instances`` field of the JSON documents
    (``present/``, the agent, the CLI's tables), NVML's probe keys, mdevctl's own JSON key
    ``mdev_type`` and a function named ``current_vgpu_type`` in ``__all__``.  Those are the
    document's or the tool's vocabulary, not the kernel's paths, and routing them through the
    kernel door would tie every document to it.  mdevctl's ``attrs`` entry
    ``nvidia/vgpu_params`` *is* a sysfs path (relative to the mdev), so it comes from the door
    (``vgpudev.mdevctl_attrs``).  ``"nvidia"`` in a message (``/usr/lib/nvidia/sriov-manage``) or
    as a driver name is no vGPU attribute and passes."""
    for module in MODULES:
        if module == VGPU_DOOR or _layer(module) == "sim":
            continue
        seen: Set[str] = set()
        for what in _kernel_attr_uses(TREES[module]):
            if what not in seen:
                seen.add(what)
                yield "kernel-attr", module, what


def violations() -> Set[Tuple[str, str, str]]:
    out: Set[Tuple[str, str, str]] = set()
    for rule in (layer_violations, cycles, door_violations, init_violations, private_imports, side_by_side,
                 concept_literals, package_cycles, kernel_attrs, local_imports):
        out.update(rule())
    return out


# ---------------------------------------------------------------------------
# known violations: (rule, module, detail) -> owner.  Delete a line when you fix it.

KNOWN: Dict[Tuple[str, str, str], str] = {}


def test_the_reader_sees_the_package():
    """The walk finds every layer and reads imports (a guard against a test that passes on nothing)."""
    layers = {_layer(m) for m in MODULES}
    assert set(RANK) <= layers
    assert "vgpuhost.model.errors" in graph()["vgpuhost.model.values"]


def test_every_package_has_a_layer():
    """A new package is placed in the layer order (RANK) before it lands, so the rules see it."""
    packages = {_layer(m) for m in MODULES} - {None}
    assert packages <= set(RANK) | UNRANKED, f"packages without a layer: {sorted(packages - set(RANK) - UNRANKED)}"


def test_no_new_violations():
    new = sorted(violations() - set(KNOWN))
    assert not new, "architecture rules broken (see tests/test_architecture.py):\n" + "\n".join(map(repr, new))


def test_known_violations_are_still_there():
    gone = sorted(set(KNOWN) - violations())
    assert not gone, "fixed, delete these lines from KNOWN in tests/test_architecture.py:\n" + "\n".join(
        f"{k!r}: {KNOWN[k]!r}" for k in gone)


def test_the_simulated_stand_ins_exist():
    """Each ``"module:Class"`` in io/backends' SIMULATED table names a class the simulator defines
    (the factories load them by name, so no import edge shows them)."""
    table = next(node.value for node in TREES[BACKENDS].body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "SIMULATED" for t in node.targets))
    names = [ast.literal_eval(v) for v in table.values]
    assert names
    for name in names:
        module, _, cls = name.partition(":")
        assert _layer(module) == "sim" and module in TREES, name
        assert any(isinstance(n, ast.ClassDef) and n.name == cls for n in TREES[module].body), name


def test_concept_literals_bite():
    """The concept-literal rule finds a planted literal in each context, and leaves the look-alikes alone."""
    planted = """
import click
@click.option("--strategy", default="first-fit", type=click.Choice(["first-fit", "best-fit"]))
@click.option("--owner", default="manual")
def f(strategy="best-fit", qos=None):
    if qos == "guaranteed" or rec.backend != "mdev" or a.owner in ("manual", "layout"):
        pass
    text = {"equal-share": "equal share", "fixed-share": "fixed share"}
    return policy or "best-effort"
"""
    found = {(value, context) for _, value, context in _concept_uses(ast.parse(planted))}
    assert {("first-fit", "default="), ("first-fit", "click.Choice"), ("manual", "default="),
            ("best-fit", "default of strategy"), ("guaranteed", "comparison"), ("mdev", "comparison"),
            ("layout", "comparison"), ("equal-share", "dict key"), ("best-effort", "fallback (or)")} <= found
    alike = """
@scheduler.command("scheduler")
def g(name="domain"):
    \"\"\"best-effort, first-fit: a docstring.\"\"\"
    if h.get("type") == "mdev" or kind == "vgpu" or "scheduler" in m or mode == "passthrough":
        log("first-fit chose " + x)
    return {"vgpus": [], "passthrough": []}, ("vgpu", "mig", "passthrough")
"""
    assert not list(_concept_uses(ast.parse(alike)))


def test_kernel_attrs_catches_a_hand_joined_path():
    """The kernel_attrs rule sees each way a vGPU kernel path is built by hand, and lets data and prose pass."""
    planted = ast.parse(
        'import os\n'
        'def f(fs, host, d, base, uuid, doc, g):\n'
        '    """Reads <uuid>/mdev_type (a docstring may name it)."""\n'
        '    fs.link_name(os.path.join(host.s.mdev_devices, uuid, "mdev_type"))\n'
        '    fs.read_optional(d / "nvidia" / "current_vgpu_type")\n'
        '    fs.read_attr_int(base + "available_instances")\n'
        '    fs.read_optional(f"{d}/nvidia/creatable_vgpu_types")\n'
        '    fs.write(f"{base}{uuid}/mdev_supported_types/x/create", uuid)\n'
        '    attrs = [{"nvidia/vgpu_params": "frame_rate_limiter=0"}]\n'
        '    os.path.join(d, "remove")\n')
    assert set(_kernel_attr_uses(planted)) == {
        "component 'mdev_type'", "component 'nvidia'", "component 'current_vgpu_type'",
        "component 'available_instances'", "f-string 'creatable_vgpu_types'", "f-string 'mdev_supported_types'",
        "path 'nvidia/vgpu_params'", "component 'remove'"}
    innocent = ast.parse(
        'def f(doc, e, g, bdf):\n'
        '    """nvidia/current_vgpu_type, written by hand in prose."""\n'
        '    e["available_instances"] += 1\n'
        '    doc.get("mdev_type")\n'
        '    ok = g.pci.driver == "nvidia"\n'
        '    hint = f"/usr/lib/nvidia/sriov-manage -d {bdf}; vgpuhost vgpu remove"\n'
        '    __all__ = ["current_vgpu_type"]\n')
    assert not list(_kernel_attr_uses(innocent))


def test_the_start_up_modules_are_real_modules():
    """A renamed module in the hook's bundle list or :data:`LEAN_READ` would silently exempt nothing."""
    assert start_up_modules() <= set(MODULES), sorted(start_up_modules() - set(MODULES))
    assert "vgpuhost.hook.runtime" in hook_closure()


def test_a_local_import_outside_the_start_up_modules_is_seen():
    TREES["vgpuhost.fake"] = ast.parse("def f():\n    import json\nTYPE_CHECKING = False\nif TYPE_CHECKING:\n    import os\n")
    try:
        found = {(rule, module) for rule, module, _ in local_imports()}
    finally:
        del TREES["vgpuhost.fake"]
    assert {("local-import", "vgpuhost.fake"), ("type-checking-shim", "vgpuhost.fake")} <= found


def test_known_violations_name_an_owner():
    assert set(KNOWN.values()) <= {"steps", "hostview", "house"}
