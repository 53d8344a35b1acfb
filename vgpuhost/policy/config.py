"""Declarative host configuration: the layouts file that ``vgpuhost plan|apply|assert`` read.

Owns: reading and validating the YAML config (``version: 1``) into frozen
values — named layouts, each a list of entries that select GPUs and give
them one mode (``passthrough``, ``vgpu`` or ``mig``) with its settings and
the vGPU scheduler policy — plus the host-level settings (kernel parameters
wanted, vfio modules).  Validation is strict: an unknown key, a wrong type,
a name that is not a vGPU type or GPU-instance profile, a name given twice
(names compare without case), a MIG layout that cannot fit, or two entries
selecting the same GPU is one
:class:`~vgpuhost.errors.InputError` whose message starts ``FILE:LINE: ``.
Must not: read the host.  Checks that need a host (the profile exists on
*this* GPU, the MIG layout fits *this* device) are :mod:`vgpuhost.layout`'s,
which reuses the checks here with the device's own tables.

Board checks at load time: when an entry's selector pins the board
(``board: A40`` or ``device_id: 0x2235``), vGPU type names, their maximum
instances and framebuffer, GPU-instance profile names and MIG layout fit are
checked against vgpuhost's own tables (the simulator catalog,
``vgpuhost/data/catalog.yaml``, which follows docs/reference/hardware.md#vgpu-types, #mig-profiles).  A board
name shared by products of different memory sizes (``A100``: 40 GB and
80 GB) is not checked at load time, since their tables differ; ``plan``
checks it on the host, against what the device reports.

Format (docs/reference/config.md):

.. code-block:: yaml

    version: 1
    default: compute                 # optional; a single layout is the default
    host:                            # optional
      kernel_params: [intel_iommu=on, iommu=pt]
      vfio_modules: [vfio, vfio_pci, vfio_iommu_type1]
    layouts:
      compute:
        description: free text
        scheduler: {policy: equal-share}           # default for the vgpu entries
        gpus:                                      # 'gpus: []': a layout that holds nothing
          - select: {board: A40}                   # or all | {address|uuid|board|device_id: value or list}
            mode: vgpu
            vgpu:
              types: {A40-8Q: 4}                   # per GPU (counts: per-gpu, the default)
              counts: per-gpu                      # or total: counts across the selected GPUs
              strategy: first-fit                  # with counts: total
              mixed_size: false                    # absent: left as it is
            scheduler: {policy: fixed-share, persist: true}
            pool: {name: gold, serves: [guaranteed]}   # or 'pool: gold' (serves what the policy can);
                                                       # ceiling: 1.5 (best-effort only: GPU time per GPU)
                                                       # mixed_size: true (not fixed-share; several sizes)
          - select: {address: "0000:41:00.0"}
            mode: mig
            mig:
              instances: {3g.20gb: 1, 1g.5gb: 2}   # GPU-instance profile -> count
              vgpus: {A100-3-20C: 1}               # MIG-backed vGPU types -> count
              on_demand: true                      # a start makes the GPU instance its vGPU needs
          - select: {device_id: 0x1e87}
            mode: passthrough
            passthrough: {allow_boot_vga: false, persist: true}
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..io.catalog import load_catalog
from ..io.yamlutil import read_text_file
from ..model import mixedsize
from ..model.boards import BOARDS, MIG_NO_SCHEDULER
from ..model.concepts import PlacementStrategy, SchedulerPolicy
from ..model.errors import InputError
from ..model.nvml import GiProfile, SchedulerState
from ..model.values import MigProfile, PciAddress, VgpuProfile
from ..model.yamldoc import Located, checked_mapping, kind_of, load_located, require_versioned, shown
from ..policy.mig import why_not
from ..policy.scheduler import POLICIES, validate
from ..model.tenancy import QOS_CLASSES
from .admission import DEFAULT_POOL, POLICY_SERVES, ceiling_problem
from .placement import STRATEGIES

VERSION = 1
MODES = ("passthrough", "vgpu", "mig")
SELECTOR_KEYS = ("address", "uuid", "board", "device_id")
COUNTS = ("per-gpu", "total")
MAX_PER_GPU = 64          # vGPUs of one type on one GPU (the largest boards offer 32)
MAX_TOTAL = 4096
MAX_ENTRIES = 256

_TOP = {"version", "default", "host", "layouts"}
_HOST = {"kernel_params", "vfio_modules"}
_LAYOUT = {"description", "scheduler", "gpus"}
_ENTRY = {"select", "mode", "description", "vgpu", "mig", "passthrough", "scheduler", "pool"}
_POOL = {"name", "serves", "ceiling", "mixed_size"}
_VGPU = {"types", "counts", "strategy", "mixed_size"}
_MIG = {"instances", "vgpus", "on_demand"}
_PASSTHROUGH = {"allow_boot_vga", "persist"}
_SCHEDULER = {"policy", "arr", "timeslice_ms", "frequency_hz", "avg_factor", "persist"}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}\Z")
_BOARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.+-]{0,63}\Z")
_GPU_UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)
_PARAM_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}(=[A-Za-z0-9_.,:+/-]{0,200})?\Z")
_MODULE_RE = re.compile(r"^[A-Za-z0-9_-]{1,56}\Z")
_DEVICE_ID_RE = re.compile(r"^(?:(?:0x)?10de:)?(?:0x)?([0-9a-f]{4})$", re.I)


# ---------------------------------------------------------------------------
# values

@dataclass(frozen=True)
class Where:
    """Where a value came from: ``source`` (the file as named) and 1-based ``line``."""

    source: str
    line: Optional[int]

    def __str__(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source

    def error(self, message: str, hint: Optional[str] = None) -> InputError:
        """An InputError ``FILE:LINE: message``."""
        return InputError(f"{self}: {message}", hint=hint)


@dataclass(frozen=True)
class Selector:
    """Which GPUs an entry takes: ``kind`` all | address | uuid | board | device_id.

    ``values``: PciAddress for address, ``GPU-...`` strings (lower case) for
    uuid, board names as written for board, ints (PCI device id) for device_id.
    """

    kind: str
    values: Tuple[Any, ...]
    where: Where

    def text(self) -> str:
        if self.kind == "all":
            return "all"
        shown = [f"0x{v:04x}" if self.kind == "device_id" else str(v) for v in self.values]
        return f"{self.kind} {', '.join(shown)}"


@dataclass(frozen=True)
class Count:
    """``name: count`` as written (a vGPU type or a GPU-instance profile), with its line."""

    name: str
    count: int
    where: Where


@dataclass(frozen=True)
class SchedulerSpec:
    """The vGPU scheduler a layout wants: a validated :class:`SchedulerState`;
    ``persist`` also wants vgpuhost's modprobe.d file to hold it (applies at
    the next nvidia module load: a reboot step, never done by apply)."""

    state: SchedulerState
    persist: bool
    where: Where


@dataclass(frozen=True)
class VgpuSpec:
    types: Tuple[Count, ...]
    counts: str = "per-gpu"                 # per-gpu | total
    strategy: str = PlacementStrategy.FIRST_FIT
    mixed_size: Optional[bool] = None       # None: left as it is
    where: Optional[Where] = None


@dataclass(frozen=True)
class MigSpec:
    instances: Tuple[Count, ...]            # GPU-instance profile name -> count
    vgpus: Tuple[Count, ...] = ()           # MIG-backed vGPU type -> count
    where: Optional[Where] = None
    #: MIG on demand for the entry's GPUs (docs/guide/nvml-mig-scheduler.md#mig-on-demand): a domain's start
    #: makes the GPU instance its MIG-backed vGPU needs, its stop destroys it; None: left as recorded
    on_demand: Optional[bool] = None
    #: False when ``instances`` was left out (allowed beside ``on_demand``): the GPU instances the GPU has
    #: are kept as they are (with ``on_demand: true``, those its domains' starts make come and go)
    instances_given: bool = True


@dataclass(frozen=True)
class PassthroughSpec:
    allow_boot_vga: bool = False
    persist: bool = False                   # driverctl overrides, so the group binds to vfio-pci at boot


@dataclass(frozen=True)
class PoolSpec:
    """The tenancy pool a vgpu entry's GPUs join (docs/guide/tenancy.md): its
    ``name``, the QoS classes it ``serves``; its scheduler policy is the entry's;
    ``ceiling``: the expected GPU-time demand each of its GPUs may carry (a share of
    one GPU; None: 1.0; above 1.0 only in a best-effort pool); ``mixed_size``: the pool runs its
    GPUs in mixed-size mode (never a fixed-share pool: NVIDIA has no fixed share in mixed-size mode).
    The planner turns the mode on only on an empty GPU and leaves a busy one as it is, saying why
    (docs/guide/layouts.md, "Mixed-size pools")."""

    name: str
    serves: Tuple[str, ...]
    where: Where
    ceiling: Optional[float] = None
    mixed_size: bool = False


@dataclass(frozen=True)
class Entry:
    """One item of a layout's ``gpus`` list."""

    index: int
    select: Selector
    mode: str
    where: Where
    description: str = ""
    vgpu: Optional[VgpuSpec] = None
    mig: Optional[MigSpec] = None
    passthrough: Optional[PassthroughSpec] = None
    scheduler: Optional[SchedulerSpec] = None
    pool: Optional[PoolSpec] = None

    def label(self) -> str:
        return f"entry {self.index + 1} at {self.where} ({self.mode}, {self.select.text()})"


@dataclass(frozen=True)
class HostSettings:
    kernel_params: Tuple[Tuple[str, Where], ...] = ()
    vfio_modules: Tuple[Tuple[str, Where], ...] = ()


@dataclass(frozen=True)
class Layout:
    name: str
    entries: Tuple[Entry, ...]
    where: Where
    description: str = ""


@dataclass(frozen=True)
class Config:
    """A validated config file.  ``layouts`` by name (file order); ``default``:
    the layout plan/apply/assert use when none is named (None: several and no
    ``default:`` key)."""

    source: str
    layouts: Dict[str, Layout]
    default: Optional[str]
    host: HostSettings = field(default_factory=HostSettings)

    def layout(self, name: Optional[str] = None) -> Layout:
        """The layout ``name`` or the default; InputError naming the choices otherwise."""
        if name is None:
            if self.default is None:
                raise InputError(f"{self.source}: {len(self.layouts)} layouts ({', '.join(self.layouts)}) and no "
                                 "default", hint="name one (vgpuhost plan -c FILE LAYOUT) or add 'default: NAME'")
            name = self.default
        if name not in self.layouts:
            near = difflib.get_close_matches(name, list(self.layouts), n=3, cutoff=0.5)
            raise InputError(f"{self.source}: no layout {name!r}",
                             hint=("did you mean " + ", ".join(near) + "? " if near else "")
                             + "layouts: " + ", ".join(self.layouts))
        return self.layouts[name]


# ---------------------------------------------------------------------------
# loading

def load(path: "str | Any") -> Config:
    """Read and validate a config file (a regular UTF-8 file of at most 1 MiB, no YAML aliases).

    Raises InputError whose message starts ``FILE:LINE: `` (``FILE`` as given).
    """
    text = read_text_file(path, "config file")
    return parse(text, source=str(path))


def parse(text: str, source: str = "<config>") -> Config:
    """Validate config text (see :func:`load`)."""
    loc = load_located(text, source)
    return _Parser(loc).config()


_UNSET = object()
_TOP_WHAT = "the config file"


class _Parser:
    def __init__(self, loc: Located):
        self.loc = loc
        self.source = loc.source

    # --- typed access ---------------------------------------------------------
    def where(self, path: tuple) -> Where:
        return Where(self.source, self.loc.line(path))

    def err(self, path: tuple, message: str, hint: Optional[str] = None) -> InputError:
        return self.where(path).error(message, hint)

    def mapping(self, value: Any, path: tuple, allowed: set, what: str) -> Dict[str, Any]:
        return checked_mapping(self.err, value, path, allowed, what)

    def get(self, m: Dict[str, Any], path: tuple, key: str, typ: Any, what: str, default: Any = _UNSET,
            label: Optional[str] = None) -> Any:
        """``m[key]`` checked against ``typ``; ``label``: how the key is named in the message
        (default ``WHAT.KEY``; a top-level key is named alone)."""
        if key not in m:
            if default is _UNSET:
                raise self.err(path, f"{what} needs the key {key!r}")
            return default
        value = m[key]
        types = typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            if label is None:
                label = key if what == _TOP_WHAT else f"{what}.{key}"
            raise self.err(path + (key,), f"{label} must be {names}, found {kind_of(value)}"
                                          + ("" if value is None else f" {_show(value)}"))
        return value

    def name(self, value: Any, path: tuple, what: str) -> str:
        if not isinstance(value, str) or not _NAME_RE.match(value):
            raise self.err(path, f"{what} {_show(value)} is not a valid name",
                           hint=("YAML reads on/off/yes/no as true/false: quote the name; " if isinstance(value, bool)
                                 else "") + "letters, digits and _ . + - (at most 64 characters)")
        return value

    def counts(self, value: Any, path: tuple, what: str, high: int) -> List[Tuple[str, int, Where]]:
        if not isinstance(value, dict):
            raise self.err(path, f"{what} must be a mapping of NAME: COUNT, found {kind_of(value)}",
                           hint="e.g. {A40-8Q: 2}")
        out = []
        for name, n in value.items():
            p = path + (name,)
            if not isinstance(name, str):
                raise self.err(p, f"{what}: {_show(name)} is not a name", hint="quote it")
            if isinstance(n, bool) or not isinstance(n, int):
                raise self.err(p, f"{what}.{name} must be a whole number, found {kind_of(n)} {_show(n)}")
            if not 0 <= n <= high:
                raise self.err(p, f"{what}.{name} = {n} is out of range 0..{high}")
            out.append((name, n, self.where(p)))
        return out

    # --- the document --------------------------------------------------------
    def config(self) -> Config:
        data = require_versioned(self.loc, "config file")       # before any message may quote the file
        top = self.mapping(data, (), _TOP, "the config file")
        version = self.get(top, (), "version", int, "the config file")
        if version != VERSION:
            raise self.err(("version",), f"unsupported config version {version}",
                           hint=f"this vgpuhost reads version {VERSION}")
        host = self.host(top.get("host"), ("host",)) if "host" in top else HostSettings()
        raw_layouts = self.get(top, (), "layouts", dict, "the config file")
        if not raw_layouts:
            raise self.err(("layouts",), "layouts is empty", hint="define at least one named layout")
        layouts: Dict[str, Layout] = {}
        for name, body in raw_layouts.items():
            self.name(name, ("layouts", name), "layout name")
            layouts[name] = self.layout(name, body, ("layouts", name))
        default = None
        if "default" in top:
            default = self.get(top, (), "default", str, "the config file")
            if default not in layouts:
                raise self.err(("default",), f"default names no layout: {default!r}",
                               hint="layouts: " + ", ".join(layouts))
        elif len(layouts) == 1:
            default = next(iter(layouts))
        return Config(self.source, layouts, default, host)

    def host(self, value: Any, path: tuple) -> HostSettings:
        m = self.mapping(value, path, _HOST, "host")
        params, modules = [], []
        for i, p in enumerate(self.get(m, path, "kernel_params", list, "host", [])):
            if not isinstance(p, str) or not _PARAM_RE.match(p):
                raise self.err(path + ("kernel_params", i), f"kernel parameter {_show(p)} is not one word like "
                                                           "intel_iommu=on", hint="one parameter per item")
            params.append((p, self.where(path + ("kernel_params", i))))
        seen: Dict[str, int] = {}
        for i, p in enumerate(params):
            key = p[0].split("=", 1)[0]
            if key in seen:
                raise self.err(path + ("kernel_params", i), f"kernel parameter {key} is given twice")
            seen[key] = i
        for i, mod in enumerate(self.get(m, path, "vfio_modules", list, "host", [])):
            if not isinstance(mod, str) or not _MODULE_RE.match(mod):
                raise self.err(path + ("vfio_modules", i), f"module name {_show(mod)} is not valid",
                               hint="e.g. vfio_pci")
            modules.append((mod.replace("-", "_"), self.where(path + ("vfio_modules", i))))
        return HostSettings(tuple(params), tuple(modules))

    def layout(self, name: str, body: Any, path: tuple) -> Layout:
        what = f"layout {name!r}"
        dotted = f"layouts.{name}"
        m = self.mapping(body, path, _LAYOUT, what)
        desc = self.get(m, path, "description", str, what, "", label=f"{dotted}.description")
        default_sched = (self.scheduler(m["scheduler"], path + ("scheduler",), None)
                         if "scheduler" in m else None)
        if "gpus" in m and m["gpus"] is None:
            raise self.err(path + ("gpus",), f"{dotted}.gpus is empty (nothing after 'gpus:')",
                           hint="list entries, or write 'gpus: []' for a layout that holds nothing (applying it "
                                "removes the vGPUs layouts created)")
        gpus = self.get(m, path, "gpus", list, what, label=f"{dotted}.gpus")
        if len(gpus) > MAX_ENTRIES:
            raise self.err(path + ("gpus",), f"{what} has {len(gpus)} entries; at most {MAX_ENTRIES}")
        entries = [self.entry(i, raw, path + ("gpus", i), default_sched, f"layouts.{name}.gpus[{i}]")
                   for i, raw in enumerate(gpus)]
        _check_overlaps(entries)
        _check_pools(entries)
        return Layout(name, tuple(entries), self.where(path), desc)

    def entry(self, index: int, raw: Any, path: tuple, default_sched: Optional[SchedulerSpec], what: str) -> Entry:
        m = self.mapping(raw, path, _ENTRY, what)
        select = self.selector(self.get(m, path, "select", (str, dict), what), path + ("select",))
        mode = self.get(m, path, "mode", str, what)
        if mode not in MODES:
            near = difflib.get_close_matches(mode, MODES, n=1, cutoff=0.5)
            raise self.err(path + ("mode",), f"unknown mode {mode!r}",
                           hint=(f"did you mean {near[0]!r}? " if near else "") + "modes: " + ", ".join(MODES))
        for block in ("vgpu", "mig", "passthrough"):
            if block in m and block != mode:
                raise self.err(path + (block,), f"a {block!r} block in an entry with mode: {mode}",
                               hint=f"move it to an entry with mode: {block}, or change the mode")
        if mode in ("vgpu", "mig") and mode not in m:
            raise self.err(path, f"{what} has mode: {mode} but no {mode!r} block")
        if "scheduler" in m and mode != "vgpu":
            why = (f"a GPU in MIG mode has no vGPU scheduler before Blackwell ({MIG_NO_SCHEDULER}: A100, "
                   "H100, H200), and from Blackwell on it is per GPU instance, which vgpuhost does not set "
                   "(docs/reference/hardware.md#vgpu-scheduling)" if mode == "mig"
                   else "a passed-through GPU has no vGPU scheduler")
            raise self.err(path + ("scheduler",), f"scheduler in an entry with mode: {mode}: {why}")
        desc = self.get(m, path, "description", str, what, "")
        where = self.where(path)
        vgpu = mig = pt = sched = None
        if mode == "vgpu":
            vgpu = self.vgpu(m["vgpu"], path + ("vgpu",))
            sched = self.scheduler(m["scheduler"], path + ("scheduler",), vgpu) if "scheduler" in m else None
            if sched is None and default_sched is not None:
                sched = default_sched
                _check_fixed_mixed(sched, vgpu, sched.where)
        elif mode == "mig":
            mig = self.mig(m["mig"], path + ("mig",))
        else:
            pt = self.passthrough(m.get("passthrough"), path + ("passthrough",))
            if select.kind == "uuid":
                raise select.where.error(
                    "select a passed-through GPU by address, board or device_id, not uuid: NVML cannot see a "
                    "GPU bound to vfio-pci, so its UUID stops matching once it is passed through")
        pool = None
        if "pool" in m:
            if mode != "vgpu":
                raise self.err(path + ("pool",), f"pool in an entry with mode: {mode}: pools hold time-sliced "
                                                 "vGPUs; MIG-backed vGPUs and passthrough are hardware partitions, "
                                                 "which admission places without pools")
            pool = self.pool(m["pool"], path + ("pool",), sched)
            if pool.mixed_size and vgpu is not None:
                if vgpu.mixed_size is False:
                    raise self.err(path + ("vgpu", "mixed_size"), f"vgpu.mixed_size: false in mixed-size pool "
                                                                  f"{pool.name!r}", hint="drop one of the two")
                vgpu = replace(vgpu, mixed_size=True)
        if vgpu is not None:
            self.vgpu_sizes(vgpu, path + ("vgpu",))
        entry = Entry(index, select, mode, where, desc, vgpu, mig, pt, sched, pool)
        _check_board(entry)
        return entry

    def pool(self, value: Any, path: tuple, sched: Optional[SchedulerSpec]) -> PoolSpec:
        if sched is None:
            raise self.err(path, "a pool needs a scheduler policy (one policy per pool)",
                           hint="add scheduler: {policy: fixed-share|equal-share|best-effort} to the entry or "
                                "the layout")
        policy = sched.state.policy
        if isinstance(value, str):
            m: Dict[str, Any] = {"name": value}
            name_path = path
        else:
            m = self.mapping(value, path, _POOL, "pool")
            name_path = path + ("name",)
        name = self.get(m, path, "name", str, "pool")
        if not _NAME_RE.match(name) or name.lower() == DEFAULT_POOL:
            raise self.err(name_path, f"pool name {_show(name)} is not valid" +
                           (f": {DEFAULT_POOL!r} names the GPUs in no pool" if name.lower() == DEFAULT_POOL else ""),
                           hint="letters, digits and _.+- only, e.g. gold")
        serves = self.get(m, path, "serves", list, "pool", None)
        if serves is None:
            serves = list(POLICY_SERVES[policy])
        if not serves:
            raise self.err(path + ("serves",), "pool.serves is an empty list",
                           hint="QoS classes: " + ", ".join(POLICY_SERVES[policy]))
        for i, c in enumerate(serves):
            if c not in QOS_CLASSES:
                raise self.err(path + ("serves", i), f"{_show(c)} is not a QoS class",
                               hint=f"QoS classes: {', '.join(QOS_CLASSES)}; a {policy} pool serves: "
                                    f"{', '.join(POLICY_SERVES[policy])}")
            if c not in POLICY_SERVES[policy]:
                raise self.err(path + ("serves", i), f"a pool with the {policy} scheduler cannot serve {_show(c)}",
                               hint=f"a {policy} pool serves: {', '.join(POLICY_SERVES[policy])}")
        if len(set(serves)) != len(serves):
            raise self.err(path + ("serves",), "pool.serves names a class twice")
        ceiling = m.get("ceiling")
        why = ceiling_problem(policy, ceiling)
        if why:
            raise self.err(path + ("ceiling",), f"pool.{why}",
                           hint="a share of one GPU: at most 1.0 for equal-share and fixed-share pools, up to "
                                "8.0 (overcommit) for best-effort ones")
        mixed = self.get(m, path, "mixed_size", bool, "pool", False)
        if mixed and policy == SchedulerPolicy.FIXED_SHARE:
            raise self.err(path + ("mixed_size",), f"pool {name!r} is fixed-share, and NVIDIA has no fixed share in "
                                                   "mixed-size mode (docs/reference/hardware.md#vgpu-types)",
                           hint="give the pool the equal-share or best-effort scheduler, or drop pool.mixed_size")
        return PoolSpec(name, tuple(serves), self.where(path), None if ceiling is None else float(ceiling), mixed)

    def selector(self, value: Any, path: tuple) -> Selector:
        where = self.where(path)
        if isinstance(value, str):
            if value != "all":
                raise self.err(path, f"select {_show(value)}: write 'all' or a mapping",
                               hint="e.g. select: {address: \"0000:41:00.0\"} or {board: A40}")
            return Selector("all", (), where)
        if isinstance(value, dict) and "all" in value:
            raise self.err(path, "select: 'all' is a word, not a key",
                           hint="write select: all (every GPU), or one of " + ", ".join(SELECTOR_KEYS))
        m = self.mapping(value, path, set(SELECTOR_KEYS), "select")
        if len(m) != 1:
            raise self.err(path, f"select needs exactly one of {', '.join(SELECTOR_KEYS)} (found "
                                 f"{', '.join(m) or 'none'})", hint="use one entry per selector")
        kind, raw = next(iter(m.items()))
        items = raw if isinstance(raw, list) else [raw]
        if not items:
            raise self.err(path + (kind,), f"select.{kind} is an empty list")
        out: List[Any] = []
        for i, v in enumerate(items):
            p = path + (kind, i) if isinstance(raw, list) else path + (kind,)
            if kind == "address":
                if not isinstance(v, str):
                    raise self.err(p, f"select.address must be a quoted PCI address like \"0000:41:00.0\", "
                                      f"found {kind_of(v)} {_show(v)}",
                                   hint="unquoted, YAML may read an address as a number")
                try:
                    out.append(PciAddress.parse(v))
                except InputError as e:
                    raise self.err(p, e.message, e.hint) from None
            elif kind == "uuid":
                if not isinstance(v, str) or not _GPU_UUID_RE.match(v):
                    raise self.err(p, f"select.uuid {_show(v)} is not a GPU UUID",
                                   hint="GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L prints it")
                out.append(v.lower())
            elif kind == "board":
                if not isinstance(v, str) or not _BOARD_RE.match(v):
                    raise self.err(p, f"select.board {_show(v)} is not a board name",
                                   hint="the MODEL 'vgpuhost gpus' shows (A100-PCIE-40GB), its family (A100) or the "
                                        "vGPU board of its types (H200X)")
                out.append(v)
            else:
                out.append(self.device_id(v, p))
            if out[-1] in out[:-1]:
                raise self.err(p, f"select.{kind} names {_show(v)} twice")
        return Selector(kind, tuple(out), where)

    def device_id(self, v: Any, path: tuple) -> int:
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFF:
            return v
        if isinstance(v, str):
            m = _DEVICE_ID_RE.match(v.strip())
            if m:
                return int(m[1], 16)
        raise self.err(path, f"select.device_id {_show(v)} is not a PCI device id",
                       hint="e.g. 0x2235 or \"10de:2235\" ('vgpuhost gpus' shows them)")

    def vgpu(self, value: Any, path: tuple) -> VgpuSpec:
        m = self.mapping(value, path, _VGPU, "vgpu")
        counts = self.get(m, path, "counts", str, "vgpu", "per-gpu")
        if counts not in COUNTS:
            raise self.err(path + ("counts",), f"vgpu.counts {counts!r} is not one of {', '.join(COUNTS)}")
        if "strategy" in m and counts != "total":
            raise self.err(path + ("strategy",), "vgpu.strategy applies only with counts: total",
                           hint="per-gpu counts put each type on every selected GPU; total counts are "
                                "placed across the selected GPUs by the strategy")
        strategy = self.get(m, path, "strategy", str, "vgpu", PlacementStrategy.FIRST_FIT)
        if strategy not in STRATEGIES:
            raise self.err(path + ("strategy",), f"unknown placement strategy {strategy!r}",
                           hint="one of " + ", ".join(STRATEGIES))
        mixed = self.get(m, path, "mixed_size", bool, "vgpu", None)
        raw = self.get(m, path, "types", dict, "vgpu")
        types = []
        for name, n, where in self.counts(raw, path + ("types",), "vgpu.types",
                                         MAX_TOTAL if counts == "total" else MAX_PER_GPU):
            p = VgpuProfile.try_parse(name)
            if p is None:
                raise where.error(f"{name!r} is not a vGPU type name",
                                  hint="<board>-<GB><Q|B|A|C>, e.g. A40-8Q ('vgpuhost types' lists them)")
            if p.mig_backed:
                raise where.error(f"{name} is a MIG-backed vGPU type: it belongs in mode: mig (mig.vgpus)",
                                  hint="list its GPU instance in mig.instances and the type in mig.vgpus")
            _check_duplicate(types, name, where, "vgpu.types")
            types.append(Count(name, n, where))
        if not types:
            raise self.err(path + ("types",), "vgpu.types is empty", hint="e.g. types: {A40-8Q: 2}")
        boards = sorted({VgpuProfile.parse(t.name).board for t in types})
        if len(boards) > 1:
            raise types[-1].where.error(f"vgpu.types mixes boards ({', '.join(boards)}): one board per entry",
                                        hint="select each board in its own entry")
        return VgpuSpec(tuple(types), counts, strategy, mixed, self.where(path))

    def vgpu_sizes(self, vgpu: VgpuSpec, path: tuple) -> None:
        """One framebuffer size per GPU unless the entry runs mixed-size mode (``vgpu.mixed_size:
        true``, or a mixed-size pool, which sets it): InputError ``FILE:LINE:``."""
        sizes = sorted({VgpuProfile.parse(t.name).framebuffer_gb for t in vgpu.types if t.count})
        if len(sizes) > 1 and vgpu.mixed_size is not True:
            raise self.err(path + ("types",),
                           f"vgpu.types holds {len(sizes)} framebuffer sizes "
                           f"({', '.join(f'{s} GB' for s in sizes)}): "
                           "equal-size mode allows one size per GPU (docs/reference/hardware.md#vgpu-types)",
                           hint="run the GPUs in mixed-size mode (vGPU 17+): pool: {name: ..., mixed_size: true} "
                                "or vgpu.mixed_size: true; or keep one size")

    def mig(self, value: Any, path: tuple) -> MigSpec:
        m = self.mapping(value, path, _MIG, "mig")
        on_demand = m.get("on_demand")
        if on_demand is not None and not isinstance(on_demand, bool):     # before instances: a typo is not a left-out key
            raise self.err(path + ("on_demand",), f"mig.on_demand is {kind_of(on_demand)}: write true or false",
                           hint="true: a domain's start makes the GPU instance its MIG-backed vGPU needs, "
                                "its stop destroys it")
        instances = []
        # beside on_demand (true or false), instances are optional: left out, the GPU keeps the instances
        # it has (docs/guide/layouts.md); given with on_demand: true, a floor; otherwise the whole set
        given = "instances" in m
        optional = {} if isinstance(m.get("on_demand"), bool) else _UNSET
        for name, n, where in self.counts(self.get(m, path, "instances", dict, "mig", optional),
                                          path + ("instances",), "mig.instances", MAX_PER_GPU):
            try:
                MigProfile.parse(name)
            except InputError as e:
                raise where.error(e.message, e.hint) from None
            _check_duplicate(instances, name, where, "mig.instances", "profile")
            instances.append(Count(name.lower(), n, where))
        vgpus = []
        for name, n, where in self.counts(self.get(m, path, "vgpus", dict, "mig", {}),
                                          path + ("vgpus",), "mig.vgpus", MAX_PER_GPU):
            p = VgpuProfile.try_parse(name)
            if p is None or not p.mig_backed:
                raise where.error(f"{name!r} is not a MIG-backed vGPU type name",
                                  hint="<board>-<GI slices>-<GB>C[ME], e.g. A100-1-5C or H200X-3-71C; "
                                       "time-sliced types belong in mode: vgpu")
            _check_duplicate(vgpus, name, where, "mig.vgpus")
            vgpus.append(Count(name, n, where))
        spec = MigSpec(tuple(instances), tuple(vgpus), self.where(path), on_demand, instances_given=given)
        _check_mig_vgpus(spec)
        return spec

    def passthrough(self, value: Any, path: tuple) -> PassthroughSpec:
        if value is None:
            return PassthroughSpec()
        m = self.mapping(value, path, _PASSTHROUGH, "passthrough")
        return PassthroughSpec(self.get(m, path, "allow_boot_vga", bool, "passthrough", False),
                               self.get(m, path, "persist", bool, "passthrough", False))

    def scheduler(self, value: Any, path: tuple, vgpu: Optional[VgpuSpec]) -> SchedulerSpec:
        m = self.mapping(value, path, _SCHEDULER, "scheduler")
        policy = self.get(m, path, "policy", str, "scheduler")
        if policy not in POLICIES:
            near = difflib.get_close_matches(policy, POLICIES, n=1, cutoff=0.5)
            raise self.err(path + ("policy",), f"unknown scheduler policy {policy!r}",
                           hint=(f"did you mean {near[0]!r}? " if near else "") + "one of " + ", ".join(POLICIES))
        nums = {k: self.get(m, path, k, int, "scheduler", None)
                for k in ("timeslice_ms", "frequency_hz", "avg_factor")}
        if (nums["frequency_hz"] is None) != (nums["avg_factor"] is None):
            key = "frequency_hz" if nums["frequency_hz"] is not None else "avg_factor"
            raise self.err(path + (key,), "scheduler.frequency_hz and scheduler.avg_factor go together")
        arr_default = policy != SchedulerPolicy.BEST_EFFORT and nums["timeslice_ms"] is None
        arr = self.get(m, path, "arr", bool, "scheduler", arr_default)
        state = SchedulerState(policy, arr=arr, **nums)
        try:
            validate(state)
        except InputError as e:
            words = {"timeslice": "timeslice_ms", "time slice": "timeslice_ms", "frequency": "frequency_hz",
                     "averaging": "avg_factor", "arr": "arr"}
            key = next((k for w, k in words.items() if k in m and w in e.message.lower()), "policy")
            raise self.err(path + (key,), f"scheduler: {e.message}", e.hint) from None
        spec = SchedulerSpec(state, self.get(m, path, "persist", bool, "scheduler", False), self.where(path))
        if vgpu is not None:
            _check_fixed_mixed(spec, vgpu, spec.where)
        return spec


_TYPE_NAMES = {str: "a string", int: "a whole number", bool: "true or false", dict: "a mapping", list: "a list"}


def _show(v: Any) -> str:
    """A value from the file, as a message may show it (:func:`vgpuhost.model.yamldoc.shown`)."""
    return shown(v)


def _check_duplicate(seen: Sequence[Count], name: str, where: Where, what: str, noun: str = "type") -> None:
    """Names are compared without case (the driver's own spelling is used on the host), so a
    name given twice in two spellings is one name given twice."""
    first = next((c for c in seen if c.name.lower() == name.lower()), None)
    if first is not None:
        same = "" if first.name == name else f" (as {first.name})"
        raise where.error(f"duplicate {noun}: {what} names {name} twice{same}, first at line {first.where.line}",
                          hint="names are compared without regard to case; give each one once with its count")


def _check_fixed_mixed(sched: SchedulerSpec, vgpu: VgpuSpec, where: Where) -> None:
    if sched.state.policy == SchedulerPolicy.FIXED_SHARE and vgpu.mixed_size:
        raise where.error("fixed share is not available in mixed-size mode (docs/reference/hardware.md#vgpu-types, #vgpu-scheduling)",
                          hint="use equal-share or best-effort, or mixed_size: false")


def gi_name_for(profile: VgpuProfile) -> str:
    """The GPU-instance profile a MIG-backed type sits on: ``A100-3-20C`` -> ``3g.20gb``,
    ``H200X-1-18CME`` -> ``1g.18gb+me``, ``DC-1-24CGFX`` -> ``1g.24gb+gfx`` (same slices, same GB, the suffix's
    GPU-instance suffix; docs/reference/hardware.md#vgpu-types, #mig-profiles)."""
    return f"{profile.gi_slices}g.{profile.framebuffer_gb}gb{profile.gi_suffix}"


def _check_mig_vgpus(spec: MigSpec) -> None:
    """Each MIG-backed vGPU needs a GPU instance of its own profile (one vGPU per GPU instance)."""
    have = {c.name.lower(): c.count for c in spec.instances}
    need: Dict[str, List[Count]] = {}
    for v in spec.vgpus:
        if v.count:
            need.setdefault(gi_name_for(VgpuProfile.parse(v.name)), []).append(v)
    for gi, vs in need.items():
        n = sum(v.count for v in vs)
        if n > have.get(gi, 0):
            names = " + ".join(f"{v.count} x {v.name}" for v in vs)
            if not spec.instances_given:
                raise vs[-1].where.error(
                    f"{names} need{'s' if n == 1 else ''} {n} {gi} GPU instance{'s' if n != 1 else ''}, and "
                    "mig.instances is left out (the GPU then keeps the instances it has, which the layout "
                    "cannot count on)",
                    hint=f"declare the instances the vGPUs sit on: add instances: {{{gi}: {n}}} to mig")
            raise vs[-1].where.error(
                f"{names} need{'s' if n == 1 else ''} {n} {gi} GPU instance{'s' if n != 1 else ''}, "
                f"mig.instances has {have.get(gi, 0)}",
                hint=f"each MIG-backed vGPU sits on a GPU instance of its own: add {gi}: {n} to mig.instances")


# ---------------------------------------------------------------------------
# selector overlaps (load time: what the text alone shows)

def _check_pools(entries: Sequence[Entry]) -> None:
    """Entries naming one pool must want one scheduler policy (a pool has one policy)."""
    first: Dict[str, Entry] = {}
    for e in entries:
        if e.pool is None:
            continue
        key = e.pool.name.lower()
        if key in first and first[key].scheduler.state.policy != e.scheduler.state.policy:
            other = first[key]
            raise e.pool.where.error(
                f"pool {e.pool.name!r} has the {other.scheduler.state.policy} scheduler at {other.pool.where} and "
                f"{e.scheduler.state.policy} here: a pool has one scheduler policy",
                hint="name another pool, or give both entries one policy")
        if key in first and first[key].pool.ceiling != e.pool.ceiling:
            raise e.pool.where.error(f"pool {e.pool.name!r} has compute ceiling {first[key].pool.ceiling} at "
                                     f"{first[key].pool.where}, and {e.pool.ceiling} here: a pool has one ceiling",
                                     hint="give both entries one pool.ceiling")
        if key in first and first[key].pool.mixed_size != e.pool.mixed_size:
            raise e.pool.where.error(f"pool {e.pool.name!r} is {'' if first[key].pool.mixed_size else 'not '}mixed-size "
                                     f"at {first[key].pool.where}, and {'' if e.pool.mixed_size else 'not '}here: a "
                                     "pool has one vGPU mode", hint="give both entries one pool.mixed_size")
        if key in first and set(first[key].pool.serves) != set(e.pool.serves):
            raise e.pool.where.error(f"pool {e.pool.name!r} serves {', '.join(first[key].pool.serves)} at "
                                     f"{first[key].pool.where}, and {', '.join(e.pool.serves)} here")
        first.setdefault(key, e)


def _check_overlaps(entries: Sequence[Entry]) -> None:
    alls = [e for e in entries if e.select.kind == "all"]
    if alls and len(entries) > 1:
        other = next(e for e in entries if e is not alls[0])
        first, second = sorted([alls[0], other], key=lambda e: e.index)
        raise second.select.where.error(
            f"this entry and the one at line {first.select.where.line} both select GPUs, and 'all' leaves none "
            "for the other: one GPU may be claimed by one entry only",
            hint="select by address, board or device_id instead of all")
    seen: Dict[Tuple[str, Any], Entry] = {}
    for e in entries:
        for v in e.select.values:
            key = (e.select.kind, str(v).lower() if isinstance(v, str) else v)
            if key in seen:
                raise e.select.where.error(
                    f"{e.select.kind} {v if e.select.kind != 'device_id' else f'0x{v:04x}'} is already selected "
                    f"by the entry at line {seen[key].select.where.line}: one GPU may be claimed by one entry only",
                    hint="merge the two entries, or select the GPUs apart")
            seen[key] = e


# ---------------------------------------------------------------------------
# board tables (docs/reference/hardware.md#vgpu-types, #mig-profiles; the simulator catalog holds them)

@dataclass(frozen=True)
class BoardTable:
    """What vgpuhost knows of one board: ``name`` (product), vGPU ``board`` name,
    framebuffer (MiB), vGPU types ``{lower name: (name, max equal-size, max mixed-size,
    framebuffer MiB)}`` and GPU-instance profiles."""

    name: str
    board: Optional[str]
    framebuffer_mib: int
    types: Mapping[str, Tuple[str, int, int, int]]
    gi_profiles: Tuple[GiProfile, ...]


@lru_cache(maxsize=1)
def board_tables() -> Dict[int, BoardTable]:
    """PCI device id -> :class:`BoardTable` for the boards vgpuhost's catalog describes."""
    out: Dict[int, BoardTable] = {}
    for model in load_catalog().gpus.values():
        types = {t.name.lower(): (t.name, t.max_instances, t.max_instances_mixed, t.framebuffer_mib)
                 for t in model.vgpu_types}
        gis = tuple(GiProfile(p.profile_id, p.name, MigProfile.parse(p.name).slices,
                              p.memory_mib or MigProfile.parse(p.name).memory_gb * 1024, p.max_count,
                              tuple((s, p.size) for s in p.placement_starts))
                    for p in model.mig_profiles)
        out[model.ids.device] = BoardTable(model.key, model.vgpu_board, model.framebuffer_mib, types, gis)
    return out


def type_max(device_id: int, name: str, mixed: bool) -> Optional[int]:
    """The catalog's max instances of vGPU type ``name`` on a GPU of PCI ``device_id`` in mixed-size
    (``mixed``) or equal-size mode; None when the catalog does not describe that board or type.

    Mixed-size maxima are often lower (A40 and L40S 4C: 12 equal-size, 8 mixed-size; NVIDIA AI
    Enterprise 5.0 user guide appendix A); the time-sliced H200X types keep theirs (7C 20, 14C 10,
    28C 5).  docs/reference/hardware.md#vgpu-types.
    """
    table = board_tables().get(device_id)
    row = table.types.get(name.lower()) if table is not None else None
    if row is None:
        return None
    return row[2] if mixed else row[1]


def _mixed_grid(device_id: int, name: str, placed: Sequence[Tuple[str, Optional[int]]]):
    """``(units, size, mixed max, taken, present of name)`` for :func:`mixed_limit` and
    :func:`mixed_best_id`; None where the catalog cannot say (see :func:`mixed_limit`)."""
    table = board_tables().get(device_id)
    row = table.types.get(name.lower()) if table is not None else None
    if row is None or VgpuProfile.parse(row[0]).mig_backed:
        return None
    units = mixedsize.grid((r[3] // 1024, r[2]) for r in table.types.values() if not VgpuProfile.parse(r[0]).mig_backed)
    taken = []
    for n, pid in placed:
        other = table.types.get(n.lower())
        if other is None or pid is None:
            return None
        taken.append((pid, other[3] // 1024))
    present = sum(1 for n, _ in placed if n.lower() == name.lower())
    return units, row[3] // 1024, row[2], taken, present


def mixed_reserved(device_id: int, placed: Sequence[Tuple[str, Optional[int]]], missing: Sequence[str]
                   ) -> Optional[List[Tuple[str, int]]]:
    """``(type name, placement id)`` for each of ``missing`` (the type names of records whose vGPU is
    missing from a GPU of PCI ``device_id`` in mixed-size mode, kept for ``vgpuhost reconcile``), each
    at the best-fit placement id left free by ``placed`` and those before it, largest first: where
    ``reconcile`` re-creates them, so counting them there holds their placement as if present (trial 8
    retest R4).  None where the catalog cannot say, or no id is free for one of them (then nothing of
    another size fits beside them either: the caller counts framebuffer alone)."""
    table = board_tables().get(device_id)
    if table is None:
        return None
    out: List[Tuple[str, int]] = []
    rows = [table.types.get(n.lower()) for n in missing]
    if any(r is None or VgpuProfile.parse(r[0]).mig_backed for r in rows):
        return None
    for row in sorted(rows, key=lambda r: -r[3]):
        pid = mixed_best_id(device_id, row[0], list(placed) + out)
        if pid is None:
            return None
        out.append((row[0], pid))
    return out


def mixed_best_id(device_id: int, name: str, placed: Sequence[Tuple[str, Optional[int]]]) -> Optional[int]:
    """The best-fit free placement id for a new ``name`` on a GPU of ``device_id`` in mixed-size mode
    with ``placed`` on it (:func:`vgpuhost.model.mixedsize.best_id`); None where none is free or the
    catalog cannot say."""
    g = _mixed_grid(device_id, name, placed)
    if g is None or g[4] >= g[2]:
        return None
    return mixedsize.best_id(g[0], g[1], g[2], g[3])


def mixed_limit(device_id: int, name: str, placed: Sequence[Tuple[str, Optional[int]]]) -> Optional[int]:
    """The most vGPUs of ``name`` a GPU of PCI ``device_id`` in mixed-size mode can hold with
    ``placed`` on it (``(type name, placement id)`` of each time-sliced vGPU present): those of
    ``name`` present plus how many more fit at free placement ids
    (:func:`vgpuhost.model.mixedsize.fits_count`: fragmentation counted), at most the mixed-size
    max.  None where the catalog does not describe the board, the type, or a vGPU present (its id
    unknown or its type not in the catalog: the caller keeps the mode's max)."""
    g = _mixed_grid(device_id, name, placed)
    if g is None:
        return None
    units, size, mx, taken, present = g
    return present + mixedsize.fits_count(units, size, mx, taken, present)


def mode_limits(inv, name: str, mixed_size: Mapping[PciAddress, bool]) -> Dict[PciAddress, int]:
    """``{gpu: max instances of ``name`` in its current mode}`` for the GPUs of ``inv`` whose mode is
    known (``mixed_size``: GPU -> heterogeneous mode on, as NVML's ``heterogeneous_mode`` says) and
    whose board the catalog describes, for :func:`vgpuhost.policy.offers.offers`' ``limits``."""
    out: Dict[PciAddress, int] = {}
    for g in inv.gpus:
        if g.address in mixed_size:
            m = type_max(g.pci.device, name, bool(mixed_size[g.address]))
            if m is not None:
                out[g.address] = m
    return out


def _family(product: str) -> str:
    return product.split("-", 1)[0]


def board_names(device_id: int, vgpu_board: Optional[str] = None) -> List[str]:
    """Lower-case names a ``board:`` selector matches for a GPU of PCI ``device_id``:
    the product name (``A100-PCIE-40GB``), its family (``A100``) and the vGPU
    board name the types carry (``H200X``)."""
    names = set()
    if device_id in BOARDS:
        product = BOARDS[device_id].product
        names |= {product.lower(), _family(product).lower()}
    table = board_tables().get(device_id)
    if table is not None:
        names.add(table.name.lower())
        names.add(_family(table.name).lower())
        if table.board:
            names.add(table.board.lower())
    if vgpu_board:
        names.add(vgpu_board.lower())
    return sorted(names)


def tables_for(selector: Selector) -> List[Tuple[str, BoardTable]]:
    """``[(label, table)]`` the selector pins at load time (empty: not pinned, or ambiguous).

    A board name matching products of different framebuffer sizes (``A100``:
    40 GB and 80 GB, whose vGPU types and MIG tables differ) pins nothing.
    """
    tables = board_tables()
    out: List[Tuple[str, BoardTable]] = []
    if selector.kind == "device_id":
        for v in selector.values:
            if v in tables:
                out.append((f"device id 0x{v:04x} ({tables[v].name})", tables[v]))
        return out
    if selector.kind != "board":
        return out
    for v in selector.values:
        want = v.lower()
        ids = {d for d in tables if want in board_names(d)}
        ids |= {d for d, b in BOARDS.items() if want in (b.product.lower(), _family(b.product).lower())}
        sizes = {BOARDS[d].framebuffer_mib if d in BOARDS else tables[d].framebuffer_mib for d in ids}
        known = [d for d in ids if d in tables]
        if len(sizes) == 1 and known:
            out.append((f"board {v}", tables[known[0]]))
    return out


def check_vgpu_types(vgpu: VgpuSpec, table: BoardTable, label: str, *, mixed: Optional[bool] = None) -> None:
    """Each type exists on the board and its count fits (per-gpu counts); InputError ``FILE:LINE:``.

    Max instances (equal-size / mixed-size) and framebuffer: docs/reference/hardware.md#vgpu-types.
    """
    mixed = vgpu.mixed_size if mixed is None else mixed
    used = 0
    for t in vgpu.types:
        row = table.types.get(t.name.lower())
        if row is None:
            raise t.where.error(f"vGPU type {t.name} does not exist on {label}", hint=_near(t.name, [
                r[0] for r in table.types.values() if not (VgpuProfile.parse(r[0]).mig_backed)], "types"))
        if vgpu.counts != "per-gpu" or not t.count:
            continue
        name, mx, mxm, fb = row
        limit = mxm if mixed else mx
        if t.count > limit:
            raise t.where.error(f"{t.count} x {name} exceed the {limit} a GPU holds in "
                                f"{'mixed' if mixed else 'equal'}-size mode ({label}, docs/reference/hardware.md#vgpu-types)")
        used += t.count * fb
    if used > table.framebuffer_mib:
        last = [t for t in vgpu.types if t.count][-1]
        raise last.where.error(f"vgpu.types need {used} MiB of framebuffer per GPU; {label} has "
                               f"{table.framebuffer_mib} MiB")
    if mixed and vgpu.counts == "per-gpu":
        _check_placements(vgpu, table, label)


def _check_placements(vgpu: VgpuSpec, table: BoardTable, label: str) -> None:
    """Mixed-size mode: the entry's vGPUs of one GPU, made in the order apply makes them (by type
    name), each at the best-fit free placement id (:func:`vgpuhost.model.mixedsize.best_id`), all
    find one; InputError ``FILE:LINE:`` naming the first that does not (fragmentation)."""
    rows = [r for r in table.types.values() if not VgpuProfile.parse(r[0]).mig_backed]
    units = mixedsize.grid((r[3] // 1024, r[2]) for r in rows)
    taken: List[Tuple[int, int]] = []
    for t in sorted((t for t in vgpu.types if t.count), key=lambda t: t.name.lower()):
        name, _, mxm, fb = table.types[t.name.lower()]
        for _ in range(t.count):
            pid = mixedsize.best_id(units, fb // 1024, mxm, taken)
            if pid is None:
                raise t.where.error(
                    f"{t.count} x {name} do not all find a free placement id on {label} in mixed-size mode "
                    f"beside the entry's other vGPUs (a {fb // 1024} GB vGPU sits at a multiple of "
                    f"{max(fb // 1024, units // mxm)} GB; docs/reference/hardware.md#vgpu-types)",
                    hint="fewer or larger vGPUs of the small type, or fewer of the others")
            taken.append((pid, fb // 1024))


def check_mig(mig: MigSpec, profiles: Sequence[GiProfile], label: str, *,
              vgpu_names: Optional[Iterable[str]] = None) -> Dict[int, int]:
    """GPU-instance names exist in ``profiles`` and the layout fits; vGPU names exist
    (when ``vgpu_names`` is given).  Returns profile id -> count.  InputError ``FILE:LINE:``."""
    by_name = {p.name.lower(): p for p in profiles}
    wanted: Dict[int, int] = {}
    for c in mig.instances:
        p = by_name.get(c.name.lower())
        if p is None:
            raise c.where.error(f"GPU-instance profile {c.name} does not exist on {label}",
                                hint=_near(c.name, [q.name for q in profiles], "profiles"))
        if c.count:
            wanted[p.profile_id] = wanted.get(p.profile_id, 0) + c.count
    reason = why_not(profiles, wanted) if wanted else None
    if reason:
        where = mig.instances[-1].where if mig.instances else mig.where
        raise (where or Where("<config>", None)).error(
            f"MIG layout cannot fit {label}: {reason}",
            hint="larger profiles first; 8 memory slices per GPU (docs/reference/hardware.md#mig-profiles)")
    if vgpu_names is not None:
        names = {n.lower(): n for n in vgpu_names}
        for v in mig.vgpus:
            if v.name.lower() not in names:
                raise v.where.error(f"MIG-backed vGPU type {v.name} does not exist on {label}",
                                    hint=_near(v.name, sorted(names.values()), "MIG-backed types"))
    return wanted


def _near(name: str, known: Sequence[str], what: str) -> str:
    by_upper = {k.upper(): k for k in known}
    shown = [by_upper[n] for n in difflib.get_close_matches(name.upper(), list(by_upper), n=4, cutoff=0.6)]
    head = ("near matches: " + ", ".join(shown) + "; ") if shown else ""
    return head + f"{what} there: " + (", ".join(known[:12]) + (", ..." if len(known) > 12 else "") or "none")


def _check_board(entry: Entry) -> None:
    for label, table in tables_for(entry.select):
        if entry.vgpu is not None:
            check_vgpu_types(entry.vgpu, table, label)
        if entry.mig is not None:
            if not table.gi_profiles:
                raise entry.where.error(f"{label} is not MIG-capable", hint="use mode: vgpu or passthrough")
            mig_types = [r[0] for r in table.types.values() if VgpuProfile.parse(r[0]).mig_backed]
            check_mig(entry.mig, table.gi_profiles, label, vgpu_names=mig_types)


__all__ = ["load", "parse", "Config", "Layout", "Entry", "Selector", "Count", "VgpuSpec", "MigSpec",
           "PassthroughSpec", "SchedulerSpec", "HostSettings", "Where", "BoardTable", "board_tables",
           "board_names", "tables_for", "check_vgpu_types", "check_mig", "gi_name_for", "MODES"]
