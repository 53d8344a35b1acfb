"""Host specs: the YAML that describes a simulated host.

Owns: parsing and validating a host spec (strict: unknown keys, wrong types,
unknown models and bad addresses are errors naming the file and line).
Must not: write files (that is :mod:`vgpuhost.sim.build`).

Format (``version: 1``)::

    name: a40-mdev
    summary: one line
    host:
      cpu_vendor: GenuineIntel | AuthenticAMD
      cmdline: "... intel_iommu=on iommu=pt"
      iommu: true                 # false: no IOMMU groups at all
      interrupt_remapping: true   # shows as IR-PCI-MSI in proc/interrupts
      kernel_release: 6.1.0-27-amd64
      modules: [vfio_pci, ...]    # loaded (proc/modules)
      builtin_modules: []         # built into the kernel (modules.builtin)
      processes: [nvidia-persistenced]
      driver_version: 580.65.05   # the nvidia module's version (sys/module/nvidia/version): the vGPU manager's
    devices:
      - bdf: "0000:41:00.0"
        model: A40                # a key of catalog.yaml gpus or devices
        upstream: "0000:40:01.1"  # the bridge above it (path in sys/devices)
        numa_node: 0
        driver: nvidia            # default: the model's; null: unbound
        boot_vga: false
        boot_framebuffer: false   # efifb/simpledrm holds BAR0 (proc/iomem)
        iommu_group: 31           # default: derived from ACS and slots
        vgpu: {backend: mdev | vendor-vfio | none, sriov_numvfs: 16, mixed_size: false}
        mig: {mode: false}
    faults:                       # kernel failures to inject (tests, demos)
      - {op: bind, device: "0000:0a:00.2", errno: EIO, count: 1}
      - {op: read, attr: creatable_vgpu_types, device: "0000:41:00.4", errno: EINVAL, count: 0}
    load:                         # simulated NVML load for metering (vgpuhost/sim/metering.py)
      default: {sm: 30, fb_mib: 2048}
      "type:A40-8Q": {sm: {square: {high: 90, low: 10, period_s: 60}}, license: unlicensed}
"""

from __future__ import annotations

import errno as _errno
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..io.yamlutil import read_text_file
from ..model.errors import InputError, SimulatorError
from ..model.values import PciAddress
from ..model.yamldoc import Located, load_located, require_versioned, shown
from .catalog import Catalog, load_catalog
from .metering import check_trace

BACKENDS = ("mdev", "vendor-vfio", "none")
#: ``nvml``: an NVML write on the GPU (MIG mode, GPU instance create/destroy, scheduler, mixed-size mode),
#: which fails with NVMLError_GpuIsLost for EIO/ENODEV (:mod:`vgpuhost.sim.nvml`)
FAULT_OPS = ("bind", "unbind", "probe", "create", "remove", "set_type", "driver_override", "read", "nvml")
#: attributes a ``read`` fault can fail: the driver's, whose show function queries the GPU and returns
#: that query's error (EINVAL from creatable_vgpu_types when the query failed, docs/guide/simulator.md)
READ_FAULT_ATTRS = ("creatable_vgpu_types", "current_vgpu_type", "vgpu_params", "available_instances",
                    "description", "name", "device_api")
_UNSET = object()
#: kernel driver, module and release names: no '/', no '..', short (they become path names)
_NAME_RE = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.+-]{1,64}$")



@dataclass(frozen=True)
class VgpuSpec:
    backend: str = "none"
    sriov_numvfs: int = 0
    mixed_size: bool = False


@dataclass(frozen=True)
class DeviceSpec:
    bdf: PciAddress
    model: str
    is_gpu: bool
    upstream: Optional[PciAddress] = None
    numa_node: int = -1
    driver: Optional[str] = None
    boot_vga: bool = False
    boot_framebuffer: bool = False
    iommu_group: Optional[int] = None
    vgpu: VgpuSpec = VgpuSpec()
    mig_mode: bool = False


@dataclass(frozen=True)
class FaultSpec:
    op: str
    device: Optional[str] = None
    errno: int = _errno.EIO
    count: int = 1           # times it fires; 0 = every time
    effect: str = "error"    # "error" or "ignore" (the write succeeds and does nothing)
    attr: Optional[str] = None   # op "read": the attribute whose read(2) fails


@dataclass(frozen=True)
class HostSpec:
    name: str
    summary: str
    cpu_vendor: str
    cmdline: str
    iommu: bool
    interrupt_remapping: bool
    kernel_release: str
    modules: Tuple[str, ...]
    builtin_modules: Tuple[str, ...]
    processes: Tuple[str, ...]
    devices: Tuple[DeviceSpec, ...]
    faults: Tuple[FaultSpec, ...] = ()
    source: str = "<spec>"
    load: Tuple[Tuple[str, str], ...] = ()      # (trace key, trace as JSON): simulated NVML load
    driver_version: str = "580.65.05"           # the vGPU manager's (vGPU 19.0, NVIDIA's release notes)


_TOP = {"version", "name", "summary", "host", "devices", "faults", "load"}
_HOST = {"cpu_vendor", "cmdline", "iommu", "interrupt_remapping", "kernel_release",
         "modules", "builtin_modules", "processes", "driver_version"}
_DEVICE = {"bdf", "model", "upstream", "numa_node", "driver", "boot_vga", "boot_framebuffer",
           "iommu_group", "vgpu", "mig"}
_VGPU = {"backend", "sriov_numvfs", "mixed_size"}
_MIG = {"mode"}
_FAULT = {"op", "device", "errno", "count", "effect", "attr"}


class _Reader:
    """Typed access to located data, raising file:line errors."""

    def __init__(self, loc: Located):
        self.loc = loc

    def mapping(self, value: Any, path: tuple, allowed: set) -> Dict[str, Any]:
        if value is None and not path:
            raise self.loc.error(path, "the spec is empty", hint="start with 'version: 1'")
        if not isinstance(value, dict):
            raise self.loc.error(path, f"expected a mapping at {_dotted(path) or 'the top level'}, "
                                       f"found {type(value).__name__}",
                                 hint="see the spec format in docs/guide/simulator.md")
        for key in value:
            if key not in allowed:
                raise self.loc.error(path + (key,), f"unknown key {shown(key)} in {_dotted(path) or 'spec'}",
                                     hint="allowed: " + ", ".join(sorted(allowed)))
        return value

    def get(self, m: Dict[str, Any], path: tuple, key: str, typ: Any, default: Any = _UNSET) -> Any:
        if key not in m:
            if default is _UNSET:
                raise self.loc.error(path, f"missing required key {key!r} in {_dotted(path) or 'spec'}")
            return default
        value = m[key]
        if default is None and value is None:
            return None
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            raise self.loc.error(path + (key,), f"{_dotted(path + (key,))} must be {tname}, "
                                                f"found {value!r}")
        return value

    def str_list(self, m: Dict[str, Any], path: tuple, key: str, pattern: "re.Pattern[str]" = _NAME_RE) -> Tuple[str, ...]:
        value = self.get(m, path, key, list, [])
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.loc.error(path + (key, i), f"{_dotted(path + (key,))} items must be strings")
            self.name(item, path + (key, i), pattern)
        return tuple(value)

    def name(self, value: str, path: tuple, pattern: "re.Pattern[str]" = _NAME_RE) -> str:
        if not pattern.match(value):
            raise self.loc.error(path, f"{_dotted(path)} {value[:80]!r} is not a valid name",
                                 hint="letters, digits and _ . + - only, no '/', at most 64 characters")
        return value

    def int_range(self, m: Dict[str, Any], path: tuple, key: str, lo: int, hi: int, default: Any) -> Any:
        value = self.get(m, path, key, int, default)
        if value is not None and not lo <= value <= hi:
            raise self.loc.error(path + (key,), f"{_dotted(path + (key,))} {value} is out of range {lo}..{hi}")
        return value

    def bdf(self, value: Any, path: tuple) -> PciAddress:
        if not isinstance(value, str):
            raise self.loc.error(path, f"{_dotted(path)} must be a quoted PCI address like \"0000:41:00.0\"",
                                 hint="unquoted, YAML may read an address as a number")
        try:
            return PciAddress.parse(value)
        except InputError as e:
            raise self.loc.error(path, e.message, e.hint) from None


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def load_spec(path: "str | Path", *, catalog: Optional[Catalog] = None) -> HostSpec:
    """Read and validate a host spec file (a regular file, at most 1 MiB, UTF-8).

    Raises InputError (file:line: what).
    """
    return parse_spec(read_text_file(path, "host spec"), source=str(path), catalog=catalog)


def _vfs_of(devices: List[DeviceSpec], cat: Catalog) -> List[PciAddress]:
    out = []
    for d in devices:
        if d.is_gpu and d.vgpu.sriov_numvfs:
            g = cat.gpus[d.model]
            out += [d.bdf.with_devfn(d.bdf.devfn + g.sriov_offset + k * g.sriov_stride)
                    for k in range(d.vgpu.sriov_numvfs)]
    return out


def parse_spec(text: str, *, source: str = "<spec>", catalog: Optional[Catalog] = None) -> HostSpec:
    """Validate spec text; see the module docstring for the format."""
    cat = catalog or load_catalog()
    loc = load_located(text, source)
    r = _Reader(loc)
    top = r.mapping(require_versioned(loc, "spec"), (), _TOP)
    version = r.get(top, (), "version", int)
    if version != 1:
        raise loc.error(("version",), f"unsupported spec version {version}", hint="use version: 1")
    name = r.get(top, (), "name", str)
    summary = r.get(top, (), "summary", str, "")
    host = r.mapping(r.get(top, (), "host", dict, {}), ("host",), _HOST)
    hp = ("host",)
    cpu_vendor = r.get(host, hp, "cpu_vendor", str, "GenuineIntel")
    if cpu_vendor not in ("GenuineIntel", "AuthenticAMD"):
        raise loc.error(hp + ("cpu_vendor",), f"cpu_vendor must be GenuineIntel or AuthenticAMD, found {cpu_vendor!r}")
    devices: List[DeviceSpec] = []
    seen: Dict[PciAddress, int] = {}
    for i, raw in enumerate(r.get(top, (), "devices", list)):
        devices.append(_parse_device(r, cat, i, raw, seen))
    faults = [_parse_fault(r, cat, i, raw, devices, seen)
              for i, raw in enumerate(r.get(top, (), "faults", list, []))]
    load = _parse_load(r, top)
    return HostSpec(
        name=name, summary=summary, cpu_vendor=cpu_vendor,
        cmdline=r.get(host, hp, "cmdline", str, "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet"),
        iommu=r.get(host, hp, "iommu", bool, True),
        interrupt_remapping=r.get(host, hp, "interrupt_remapping", bool, True),
        kernel_release=r.name(r.get(host, hp, "kernel_release", str, "6.1.0-27-amd64"), hp + ("kernel_release",)),
        modules=r.str_list(host, hp, "modules"),
        builtin_modules=r.str_list(host, hp, "builtin_modules"),
        processes=r.str_list(host, hp, "processes"),
        devices=tuple(devices), faults=tuple(faults), source=source, load=tuple(load),
        driver_version=_driver_version(r, host, hp))


def _driver_version(r: "_Reader", host: dict, hp: tuple) -> str:
    """``host.driver_version``: dotted numbers (``580.65.05``), the nvidia module's version."""
    raw = r.get(host, hp, "driver_version", str, "580.65.05")
    parts = raw.split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise r.loc.error(hp + ("driver_version",), f"driver_version must be dotted numbers like 580.65.05, "
                                                     f"found {raw!r}")
    return raw


def _parse_device(r: _Reader, cat: Catalog, i: int, raw: Any, seen: Dict[PciAddress, int]) -> DeviceSpec:
    """``devices[i]``: a catalog model at a BDF not listed before (``seen``: BDF -> index, which
    this adds to), its upstream bridge listed before it, its driver, vGPU and MIG settings
    as the model allows.  Raises the spec's ``FILE:LINE:`` error otherwise."""
    loc = r.loc
    dp = ("devices", i)
    d = r.mapping(raw, dp, _DEVICE)
    bdf = r.bdf(d["bdf"] if "bdf" in d else r.get(d, dp, "bdf", str), dp + ("bdf",))
    if bdf in seen:
        raise loc.error(dp + ("bdf",), f"device {bdf} is listed twice (first at devices[{seen[bdf]}])")
    model = r.get(d, dp, "model", str)
    if model in cat.gpus:
        is_gpu = True
        default_driver: Optional[str] = cat.gpus[model].driver
    elif model in cat.devices:
        is_gpu = False
        default_driver = cat.devices[model].driver
    else:
        raise loc.error(dp + ("model",), f"unknown model {model!r}",
                        hint="known models: " + ", ".join(cat.model_names()))
    upstream = None
    if "upstream" in d:
        upstream = r.bdf(d["upstream"], dp + ("upstream",))
        if upstream not in seen:
            raise loc.error(dp + ("upstream",), f"upstream {upstream} must be listed before {bdf}")
    seen[bdf] = i
    driver = d["driver"] if "driver" in d else default_driver
    if driver is not None and not isinstance(driver, str):
        raise loc.error(dp + ("driver",), f"devices[{i}].driver must be a driver name or null")
    if driver is not None:
        r.name(driver, dp + ("driver",))
    vg = r.mapping(r.get(d, dp, "vgpu", dict, {}), dp + ("vgpu",), _VGPU)
    vp = dp + ("vgpu",)
    backend, numvfs = _parse_vgpu_backend(r, cat, vg, vp, model, is_gpu)
    mig = r.mapping(r.get(d, dp, "mig", dict, {}), dp + ("mig",), _MIG)
    mig_mode = r.get(mig, dp + ("mig",), "mode", bool, False)
    if mig_mode and not (is_gpu and cat.gpus[model].mig_capable):
        raise loc.error(dp + ("mig", "mode"), f"{model} is not MIG-capable")
    return DeviceSpec(
        bdf=bdf, model=model, is_gpu=is_gpu, upstream=upstream,
        numa_node=r.int_range(d, dp, "numa_node", -1, 1023, -1), driver=driver,
        boot_vga=r.get(d, dp, "boot_vga", bool, False),
        boot_framebuffer=r.get(d, dp, "boot_framebuffer", bool, False),
        iommu_group=r.int_range(d, dp, "iommu_group", 0, 1_000_000, None),
        vgpu=VgpuSpec(backend, numvfs, r.get(vg, vp, "mixed_size", bool, False)),
        mig_mode=mig_mode)


def _parse_vgpu_backend(r: _Reader, cat: Catalog, vg: Dict[str, Any], vp: Tuple[Any, ...], model: str,
                        is_gpu: bool) -> Tuple[str, int]:
    """A device's ``vgpu`` mapping (at path ``vp``): ``(backend, sriov_numvfs)``, a backend for
    GPUs with vGPU types only, VFs within the model's ``sriov_totalvfs`` and required by
    vendor-vfio.  Raises the spec's ``FILE:LINE:`` error otherwise."""
    loc = r.loc
    backend = r.get(vg, vp, "backend", str, "none")
    if backend not in BACKENDS:
        raise loc.error(vp + ("backend",), f"vgpu.backend must be one of {', '.join(BACKENDS)}, found {backend!r}")
    numvfs = r.get(vg, vp, "sriov_numvfs", int, 0)
    if backend != "none" and not is_gpu:
        raise loc.error(vp, f"vgpu settings apply to GPUs only; {model} is not a GPU")
    if numvfs:
        total = cat.gpus[model].sriov_totalvfs if is_gpu else 0
        if not 0 < numvfs <= total:
            raise loc.error(vp + ("sriov_numvfs",),
                            f"sriov_numvfs {numvfs} out of range for {model} (sriov_totalvfs {total})")
    if backend == "vendor-vfio" and not numvfs:
        raise loc.error(vp, "the vendor-vfio backend needs SR-IOV VFs: set sriov_numvfs")
    if is_gpu and backend != "none" and not cat.gpus[model].vgpu_types:
        raise loc.error(vp + ("backend",), f"{model} supports no vGPU types")
    return backend, numvfs


def _parse_fault(r: _Reader, cat: Catalog, i: int, raw: Any, devices: List[DeviceSpec],
                 seen: Dict[PciAddress, int]) -> FaultSpec:
    """``faults[i]``: an operation to fail (with an errno name) or ignore, on a device of the
    spec or one of its VFs (``devices``, ``seen``: BDF -> index), a number of times."""
    loc = r.loc
    fp = ("faults", i)
    f = r.mapping(raw, fp, _FAULT)
    op = r.get(f, fp, "op", str)
    if op not in FAULT_OPS:
        raise loc.error(fp + ("op",), f"fault op must be one of {', '.join(FAULT_OPS)}, found {op!r}")
    err_name = r.get(f, fp, "errno", str, "EIO")
    if not hasattr(_errno, err_name):
        raise loc.error(fp + ("errno",), f"unknown errno name {err_name!r}", hint="e.g. EIO, EBUSY, ENODEV")
    dev = r.get(f, fp, "device", str, None)
    if dev is not None:
        dev_addr = r.bdf(dev, fp + ("device",))
        if dev_addr not in seen and not any(dev_addr == vf for vf in _vfs_of(devices, cat)):
            raise loc.error(fp + ("device",), f"fault device {dev_addr} is not in the spec")
        dev = str(dev_addr)
    effect = r.get(f, fp, "effect", str, "error")
    if effect not in ("error", "ignore"):
        raise loc.error(fp + ("effect",), "fault effect must be 'error' or 'ignore'")
    if effect == "ignore" and "errno" in f:
        raise loc.error(fp + ("errno",), "a fault with effect 'ignore' takes no errno")
    attr = r.get(f, fp, "attr", str, None)
    if op == "read":
        if attr not in READ_FAULT_ATTRS:
            raise loc.error(fp + ("attr",), f"a read fault needs attr, one of {', '.join(READ_FAULT_ATTRS)}"
                            + (f"; found {shown(attr)}" if attr is not None else ""))
        if effect != "error":
            raise loc.error(fp + ("effect",), "a read fault fails the read: effect 'ignore' is for writes")
    elif attr is not None:
        raise loc.error(fp + ("attr",), "attr is for read faults (op: read)")
    if op == "nvml" and effect != "error":
        raise loc.error(fp + ("effect",), "an nvml fault fails the NVML call: effect 'ignore' is for kernel writes")
    return FaultSpec(op, dev, getattr(_errno, err_name), r.int_range(f, fp, "count", 0, 1_000_000, 1), effect,
                     attr)


def _parse_load(r: _Reader, top: Dict[str, Any]) -> List[Tuple[Any, str]]:
    """The spec's ``load`` traces, checked: ``[(key, trace as sorted JSON)]``."""
    load = []
    for key, trace in r.get(top, (), "load", dict, {}).items():
        why = check_trace(trace) if isinstance(key, str) else "a trace key is a string"
        if why:
            raise r.loc.error(("load", key), f"invalid load trace {key!r}: {why}",
                              hint="keys: a device id, type:<vGPU type name> or default (vgpuhost/sim/metering.py)")
        load.append((key, json.dumps(trace, sort_keys=True)))
    return load


def spec_error(message: str) -> SimulatorError:
    return SimulatorError(message)
