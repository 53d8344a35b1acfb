"""Host readiness checks: pure functions from an Inventory to findings.

Owns: deciding whether a host is ready for GPU virtualisation, and saying
why and how to fix each problem.  Must not: read files (it gets an
:class:`~vgpuhost.inventory.Inventory`) or change the host.

Facts behind each check: docs/reference/hardware.md#pci-and-iommu (IOMMU, group viability, bridges,
companions, boot VGA, blockers: nvidia-persistenced, nvidia_drm, boot
framebuffer, built-in vfio-pci), #mdev, #vendor-vfio (vGPU backends, SR-IOV).

Severities: ``error`` (a GPU cannot be used as intended until fixed; the
host is not ready: exit 1), ``warning`` (works with a caveat or after an
operator step), ``info`` and ``ok``.

Beside the findings, :func:`mode_verdicts` gives one verdict per GPU and
mode (passthrough, vGPU, MIG) that says what the command for that mode
would do now; the host is ready only when no finding is an error and every
GPU can serve some mode (:func:`host_ready`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Dict, List, Mapping, Optional, Tuple

from ..model.concepts import Backend
from ..model.errors import VgpuhostError
from ..model.values import PciAddress, record
from ..observe.inventory import Gpu, Inventory, PciDevice, unread_count
from .iommu import VFIO_PCI, group_endpoints, prepare_blockers, vmd_refusal

SEVERITIES = ("error", "warning", "info", "ok")
VFIO_MODULES = ("vfio", "vfio_pci", "vfio_iommu_type1")


@record(frozen=True)
class Finding:
    """One result of ``host check``: ``code`` is stable, ``fix`` may be empty."""

    severity: str
    code: str
    subject: str
    message: str
    fix: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)          # the fields, in order (asdict of plain strings)


def is_ready(findings: List[Finding]) -> bool:
    return not any(f.severity == "error" for f in findings)


def check_host(inv: Inventory) -> List[Finding]:
    """All findings for ``inv``, host-level first, then per GPU (BDF order)."""
    out: List[Finding] = []
    out += _check_cpu(inv)
    out += _check_iommu(inv)
    out += _check_vfio_modules(inv)
    out += _check_host_blockers(inv)
    out += _check_selinux(inv)
    for gpu in inv.gpus:
        out += check_gpu(inv, gpu)
    if not inv.gpus:
        out.append(Finding("warning", "NO_GPUS", "host", "no NVIDIA GPU found under sys/bus/pci/devices",
                           "check that the GPU is seated and visible in lspci"))
    return out


def _iommu_param_fix(inv: Inventory) -> str:
    """The fix for an IOMMU that is off and not asked for.  AMD's IOMMU driver starts by itself when
    the firmware enables AMD-Vi: ``amd_iommu=`` takes no ``on`` (its values: ``off``, ``fullflush``,
    ``force_isolation``, ``force_enable``, ...; docs/reference/hardware.md, from the kernel's
    admin-guide/kernel-parameters.txt); Intel's needs ``intel_iommu=on`` where the kernel's default is off."""
    if inv.host.cpu_vendor == "AuthenticAMD":
        return ("enable the IOMMU (AMD-Vi, often named 'IOMMU' or 'SVM/IOMMU') in the firmware setup and reboot; "
                "the kernel turns it on by itself (amd_iommu= takes no 'on'); 'iommu=pt' in GRUB_CMDLINE_LINUX "
                "is the usual companion")
    return ("add 'intel_iommu=on iommu=pt' to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub "
            "(or grub2-mkconfig -o /boot/grub2/grub.cfg), enable VT-d in the firmware setup, and reboot")


def _iommu_turned_off(args) -> Optional[str]:
    """The kernel parameter that turns the IOMMU off (``iommu=off``, ``amd_iommu=off``, ``intel_iommu=off``), if any."""
    for key in ("iommu", "amd_iommu", "intel_iommu"):
        if "off" in str(args.get(key) or "").split(","):
            return f"{key}={args[key]}"
    return None


def _check_cpu(inv: Inventory) -> List[Finding]:
    if inv.host.cpu_vendor and not inv.host.cpu_virt_flags:
        return [Finding("error", "CPU_VIRT_OFF", "host",
                        "the CPU shows no vmx/svm flag: hardware virtualisation is off",
                        "enable Intel VT-x / AMD-V (SVM) in the firmware setup")]
    return []


def _check_iommu(inv: Inventory) -> List[Finding]:
    args = inv.host.cmdline_args
    out: List[Finding] = []
    if not inv.iommu_enabled:
        off = _iommu_turned_off(args)
        asked = args.get("intel_iommu") == "on"
        if off:
            out.append(Finding("error", "IOMMU_OFF", "host",
                               f"the kernel command line turns the IOMMU off ({off}): no device can be given to a VM",
                               f"remove '{off}' from GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub "
                               "(or grub2-mkconfig -o /boot/grub2/grub.cfg) and reboot"))
        elif asked:
            out.append(Finding("error", "IOMMU_OFF", "host",
                               "the kernel command line asks for the IOMMU but no IOMMU groups exist: "
                               "it is disabled in the firmware",
                               "enable VT-d in the firmware setup and reboot"))
        else:
            out.append(Finding("error", "IOMMU_OFF", "host",
                               "the IOMMU is off (no IOMMU groups): no device can be given to a VM",
                               _iommu_param_fix(inv)))
        return out
    out.append(Finding("ok", "IOMMU_ON", "host", f"IOMMU on: {len(inv.groups)} IOMMU groups"))
    if "iommu" not in args:
        out.append(Finding("info", "IOMMU_PT", "host",
                           "'iommu=pt' is not set: host devices use DMA translation too",
                           "add 'iommu=pt' to the kernel command line for host I/O performance"))
    ir = inv.host.interrupt_remapping
    if ir is True:
        out.append(Finding("ok", "IR_ON", "host", "interrupt remapping is on"))
    elif ir is False:
        out.append(Finding("warning", "IR_OFF", "host",
                           "interrupt remapping is off: vfio refuses device assignment unless "
                           "vfio_iommu_type1 allow_unsafe_interrupts=1 is set (insecure)",
                           "enable interrupt remapping (x2APIC / IR) in the firmware setup"))
    else:
        out.append(Finding("info", "IR_UNKNOWN", "host",
                           "interrupt remapping state is not visible (no proc/interrupts)"))
    return out


def _check_vfio_modules(inv: Inventory) -> List[Finding]:
    h = inv.host
    out: List[Finding] = []
    missing, unloaded = [], []
    for m in VFIO_MODULES:
        if m in h.modules_loaded or m in h.modules_builtin:
            continue
        if m in h.modules_available:
            unloaded.append(m)
        else:
            missing.append(m)
    if missing:
        out.append(Finding("error", "VFIO_MISSING", "host",
                           f"vfio modules not available for this kernel: {', '.join(missing)}",
                           "install a kernel with VFIO support (CONFIG_VFIO_PCI) and reboot into it"))
    elif unloaded:
        out.append(Finding("info", "VFIO_NOT_LOADED", "host",
                           f"vfio modules available but not loaded: {', '.join(unloaded)}",
                           "they load on first use; to load at boot list them in "
                           "/etc/modules-load.d/vfio.conf"))
    else:
        out.append(Finding("ok", "VFIO_LOADED", "host", "vfio modules loaded: " + ", ".join(VFIO_MODULES)))
    if "vfio_pci" in h.modules_builtin:
        out.append(Finding("info", "VFIO_BUILTIN", "host",
                           "vfio-pci is built into the kernel: it cannot be unloaded, and early binding "
                           "must use vfio-pci.ids= on the kernel command line instead of modprobe.d"))
    return out


def _check_selinux(inv: Inventory) -> List[Finding]:
    """libvirt's hooks under SELinux (docs/reference/libvirt.md#selinux): Fedora's policy runs them in
    virt_hook_unconfined_t only with the boolean virt_hooks_unconfined on (off by default; rhbz#2276917),
    and a hooks directory made by hand inherits /etc/libvirt's type instead of its own."""
    se = inv.host.selinux
    if se is None or not se.enforcing:
        return []
    out: List[Finding] = []
    if se.hooks_unconfined is False:
        out.append(Finding("warning", "SELINUX_HOOKS_CONFINED", "host",
                           "SELinux is enforcing and virt_hooks_unconfined is off: libvirt runs its hooks "
                           "confined, so vgpuhost's hook is denied the GPUs' sysfs files and every VM start "
                           "with a vGPU fails",
                           "setsebool -P virt_hooks_unconfined on"))
    if se.hooks_label is not None and se.hooks_label == se.etc_label:
        out.append(Finding("warning", "SELINUX_HOOKS_LABEL", "host",
                           f"/etc/libvirt/hooks has the SELinux type of /etc/libvirt ({se.hooks_label}), as a "
                           "directory made by hand inherits: the policy's rules for hooks do not apply to it",
                           "restorecon -Rv /etc/libvirt/hooks"))
    return out


#: how long before a vGPU licence expires host check warns (and the alert VgpuhostVgpuLicenceExpiring fires)
LICENCE_WARN_S = 7 * 86400


def licence_findings(licences: Mapping[str, Tuple[str, Optional[float]]], now: float) -> List[Finding]:
    """One finding per vGPU from its licence (``{device: (state, expiry seconds since the epoch or None)}``,
    NVML's ``nvmlVgpuInstanceGetLicenseInfo_v2``): ``VGPU_UNLICENSED`` (a warning) for any state but
    ``licensed``, ``VGPU_LICENCE_EXPIRING`` (a warning) within :data:`LICENCE_WARN_S` of its expiry,
    else ``VGPU_LICENSED`` (ok, with the expiry where the driver gives one)."""
    out: List[Finding] = []
    for device, (state, expiry) in sorted(licences.items()):
        until = ""
        if expiry is not None:
            stamp = datetime.fromtimestamp(expiry, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            until = f" until {stamp}"
        if state != "licensed":
            out.append(Finding("warning", "VGPU_UNLICENSED", device, f"licence state {state}{until}: an unlicensed "
                               "vGPU runs degraded after its grace period",
                               "check the licence server and the guest's licence client (nvidia-gridd)"))
        elif expiry is not None and expiry - now < LICENCE_WARN_S:
            days = max(0.0, (expiry - now) / 86400)
            out.append(Finding("warning", "VGPU_LICENCE_EXPIRING", device,
                               f"licensed{until}: expires in {days:.1f} days",
                               "renew it on the licence server, or check that the guest's licence client renews"))
        else:
            out.append(Finding("ok", "VGPU_LICENSED", device, f"licensed{until}"))
    return out


def _check_host_blockers(inv: Inventory) -> List[Finding]:
    """Blockers to unbinding a GPU from nvidia (docs/reference/hardware.md#pci-and-iommu)."""
    h = inv.host
    nvidia_gpus = [g for g in inv.gpus if g.pci.driver == "nvidia"]
    out: List[Finding] = []
    if not nvidia_gpus:
        return out
    if h.running("nvidia-persistenced"):
        out.append(Finding("warning", "PERSISTENCED", "host",
                           "nvidia-persistenced is running: unbinding a GPU from nvidia hangs "
                           "('non-zero usage count') until it stops",
                           "before passthrough: systemctl stop nvidia-persistenced (and disable it, "
                           "or exclude the GPU from it)"))
    if "nvidia_drm" in h.modules_loaded:
        out.append(Finding("warning", "NVIDIA_DRM", "host",
                           "nvidia_drm is loaded and holds the GPUs for display: unbinding for "
                           "passthrough fails while it is in use",
                           "modprobe -r nvidia_drm nvidia_modeset, or blacklist them on passthrough hosts"))
    return out


def check_gpu(inv: Inventory, gpu: Gpu) -> List[Finding]:
    """Findings about one GPU: group viability, console use, vGPU backend."""
    subject = str(gpu.address)
    out: List[Finding] = []
    dev = gpu.pci
    if inv.iommu_enabled:
        out += _check_group(inv, gpu)
    if dev.boot_vga:
        out.append(Finding("warning", "BOOT_VGA", subject,
                           f"{gpu.model} drives the host console (boot_vga=1): passing it through "
                           "takes the console away",
                           "select another primary display (iGPU/BMC) in the firmware setup, or pass "
                           "--allow-boot-vga to passthrough"))
    fbs = inv.host.boot_framebuffers.get(subject)
    if fbs:
        out.append(Finding("warning", "BOOT_FRAMEBUFFER", subject,
                           f"a boot framebuffer ({', '.join(fbs)}) holds BAR 0: vfio-pci fails with "
                           "\"BAR 0: can't reserve\"",
                           "add 'initcall_blacklist=sysfb_init' to the kernel command line and reboot"))
    out += _check_vgpu(inv, gpu)
    for u in gpu.unreadable:            # discovery went on without it (docs/reference/hardware.md#vendor-vfio)
        out.append(Finding("warning", "VGPU_UNREADABLE", subject, f"unreadable {u.describe()}",
                           "read it again later ('vgpuhost gpus'); if it stays, see the driver's messages "
                           "(dmesg)"))
    return out


def _describe(dev: Optional[PciDevice], addr: object) -> str:
    if dev is None:
        return str(addr)
    drv = f", {dev.driver}" if dev.driver else ", no driver"
    return f"{addr} ({dev.class_name}{drv})"


def _check_group(inv: Inventory, gpu: Gpu) -> List[Finding]:
    subject = str(gpu.address)
    if gpu.vmd is not None:             # its group is the VMD's: no ACS advice helps (#intel-vmd)
        return [Finding("warning", "BEHIND_VMD", subject, "passthrough and vendor-VFIO vGPUs are refused: "
                        + vmd_refusal(inv, gpu.address),
                        "put the GPU in a slot outside VMD, or turn VMD off for its ports in the firmware "
                        "setup; classic mdev vGPUs are not refused behind VMD (not verified on hardware)")]
    group = inv.group_of(gpu.address)
    if group is None:
        return [Finding("error", "NO_IOMMU_GROUP", subject, "the GPU has no IOMMU group",
                        "check that the IOMMU covers this PCI segment (dmesg | grep -i -e DMAR -e IOMMU)")]
    others = [m for m in group.members if m != gpu.address]
    foreign, companions, bridges = [], [], []
    for m in others:
        d = inv.devices.get(m)
        if d is not None and d.stays_in_group:
            bridges.append(m)
        elif m.slot_address == gpu.address.slot_address:
            companions.append(m)
        else:
            foreign.append(m)
    if foreign:
        names = "; ".join(_describe(inv.devices.get(m), m) for m in foreign)
        return [Finding("error", "GROUP_NOT_VIABLE", subject,
                        f"not viable for passthrough: IOMMU group {group.number} also holds {names}, "
                        "which would have to be given to the same VM",
                        "move the GPU to a slot whose upstream port supports ACS (check the board "
                        "manual), or use vGPU instead; the ACS override patch hides the problem but "
                        "breaks isolation")]
    out = []
    if companions:
        names = ", ".join(_describe(inv.devices.get(m), m) for m in companions)
        out.append(Finding("info", "GROUP_COMPANIONS", subject,
                           f"IOMMU group {group.number}: {names} must move with the GPU "
                           "(passthrough binds every function of the group to vfio-pci together)"))
    pci_bridges = [m for m in bridges if inv.devices[m].is_bridge]
    host_bridges = [m for m in bridges if not inv.devices[m].is_bridge]
    bridge_note = f" (bridges {', '.join(map(str, pci_bridges))} stay on pcieport)" if pci_bridges else ""
    if host_bridges:        # driverless host bridges (AMD's dummy host bridge): the kernel accepts them
        bridge_note += f" (driverless host bridges {', '.join(map(str, host_bridges))} stay unbound)"
    out.append(Finding("ok", "GROUP_VIABLE", subject,
                       f"IOMMU group {group.number} is viable for passthrough{bridge_note}"))
    return out


def _check_vgpu(inv: Inventory, gpu: Gpu) -> List[Finding]:
    subject = str(gpu.address)
    dev = gpu.pci
    if dev.driver == "vfio-pci":
        return [Finding("info", "BOUND_VFIO", subject, f"{gpu.model} is bound to vfio-pci (passthrough)")]
    if gpu.vgpu_backend and gpu.vfs and not inv.iommu_enabled:
        return [Finding("error", "VF_NEEDS_IOMMU", subject,
                        f"{gpu.model}: vGPUs on SR-IOV VFs need the IOMMU, which is off",
                        _iommu_param_fix(inv))]
    if gpu.vmd is not None and gpu.vgpu_backend == Backend.VENDOR_VFIO and inv.iommu_enabled:
        return []                       # BEHIND_VMD (_check_group) says why its VFs serve no VM
    if gpu.vgpu_backend:
        n_types = len({t.type_id for t in inv.vgpu_types if t.gpu == gpu.address})
        where = f"on {len(gpu.vfs)} SR-IOV VFs" if gpu.vfs else "on the physical function"
        if n_types:
            out = [Finding("ok", "VGPU_READY", subject,
                           f"{gpu.model}: vGPU via {gpu.vgpu_backend} {where}, {n_types} types")]
        elif gpu.unreadable:        # not "none offered": the driver's answer was not read (VGPU_UNREADABLE)
            out = [Finding("warning", "VGPU_NO_TYPES", subject,
                           f"{gpu.model}: vGPU via {gpu.vgpu_backend} {where}, but {unread_count(gpu)}, "
                           "so its vGPU types are unknown (VGPU_UNREADABLE)",
                           "read it again later ('vgpuhost host check'); if it stays, see the driver's "
                           "messages (dmesg)")]
        else:       # the backend is there, but nothing can be created on it now
            out = [Finding("warning", "VGPU_NO_TYPES", subject,
                           f"{gpu.model}: vGPU via {gpu.vgpu_backend} {where}, but "
                           f"{'no VF offers' if gpu.vfs else 'it offers no'} vGPU type",
                           "with MIG mode on, MIG-backed types appear once GPU instances exist "
                           f"(vgpuhost mig apply --gpu {subject} LAYOUT); otherwise check the NVIDIA vGPU "
                           "manager (nvidia-smi vgpu)")]
        if gpu.vfs:
            shared = [v for v in gpu.vfs if (g := inv.group_of(v)) is not None and len(g.members) > 1]
            if shared:
                out.append(Finding("warning", "VF_GROUP_SHARED", subject,
                                   f"{len(shared)} VFs share an IOMMU group with other devices",
                                   "each VF needs its own IOMMU group; enable ACS on the upstream port"))
        return out
    if dev.sriov_totalvfs and not dev.sriov_numvfs and dev.driver == "nvidia":
        return [Finding("info", "SRIOV_DISABLED", subject,
                        f"{gpu.model} supports SR-IOV ({dev.sriov_totalvfs} VFs) but no VF is enabled, "
                        "so no vGPU types are visible",
                        f"with the NVIDIA vGPU manager installed: /usr/lib/nvidia/sriov-manage -e {subject}")]
    if dev.driver == "nvidia":
        return [Finding("info", "NO_VGPU_TYPES", subject,
                        f"{gpu.model} shows no vGPU types: passthrough only",
                        "for vGPU install the NVIDIA vGPU manager (nvidia_vgpu_vfio) on a vGPU-capable board")]
    if dev.driver is None:
        return [Finding("info", "UNBOUND", subject, f"{gpu.model} is bound to no driver")]
    return []


# --- one verdict per mode (issue 12 #4i) ------------------------------------------------------

MODES = ("passthrough", "vgpu", "mig")
MODE_NAMES = {"passthrough": "passthrough", "vgpu": "vGPU", "mig": "MIG"}
VERDICTS = ("ready", "blocked", "unsupported", "unknown")


@record(frozen=True)
class GpuFacts:
    """What ``host check`` knows of one GPU beyond sysfs (the caller reads them: this module reads nothing).

    ``vgpu_board``: the board catalog lists vGPU types for the board (None:
    a board the catalog does not know).  ``mig_capable``: NVML reports a
    MIG mode, else the catalog's word (None: neither knows).  ``mig_on`` /
    ``mig_pending``: NVML's current and pending MIG mode (None: not read).
    ``gpu_instances``, ``active_vgpus``: NVML's counts (None: not read).
    ``nvml_error``: why NVML gave no answer for this GPU ("" when it did).
    ``mig_on_demand``: the GPU is opted in to MIG on demand (a start makes the GPU instance of its
    MIG-backed vGPU: docs/guide/nvml-mig-scheduler.md#mig-on-demand).
    """

    vgpu_board: Optional[bool] = None
    mig_capable: Optional[bool] = None
    mig_on: Optional[bool] = None
    mig_pending: Optional[bool] = None
    gpu_instances: Optional[int] = None
    active_vgpus: Optional[int] = None
    nvml_error: str = ""
    mig_on_demand: bool = False


@record(frozen=True)
class ModeVerdict:
    """Can ``gpu`` serve ``mode`` now, as the command for that mode would answer?

    ``verdict``: ``ready`` (the command goes ahead), ``blocked`` (it refuses
    until the ``fix`` is done), ``unsupported`` (the board or its software
    cannot), ``unknown`` (NVML could not be asked).  ``reason``: one line,
    what the command would say (for ``ready``, what the GPU offers).
    """

    gpu: str
    mode: str
    verdict: str
    reason: str
    fix: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def mode_verdicts(inv: Inventory, facts: Optional[Mapping[PciAddress, GpuFacts]] = None) -> List[ModeVerdict]:
    """Per GPU (BDF order), one :class:`ModeVerdict` for each of :data:`MODES`.

    The passthrough verdict is the refusal ``passthrough prepare BDF``
    gives before any write (:func:`vgpuhost.policy.iommu.group_endpoints`,
    :func:`~vgpuhost.policy.iommu.prepare_blockers`, without
    ``--allow-boot-vga``); the vGPU verdict is whether the GPU offers any vGPU
    type now; the MIG verdict is whether ``mig enable``/``mig apply`` go ahead.
    """
    facts = facts or {}
    out: List[ModeVerdict] = []
    for gpu in inv.gpus:
        f = facts.get(gpu.address, GpuFacts())
        out.append(_out_of_service(inv, _passthrough_verdict(inv, gpu)))
        out.append(_out_of_service(inv, _vgpu_verdict(inv, gpu, f)))
        out.append(_out_of_service(inv, _mig_verdict(gpu, f)))
    return out


def _out_of_service(inv: Inventory, v: ModeVerdict) -> ModeVerdict:
    """``v``, or ``blocked`` where it said ``ready`` for a GPU out of service (``inv.out_of_service``:
    unhealthy or cordoned), in each mode: ``vgpu create --gpu`` and ``passthrough prepare`` refuse it, and
    placement, a layout's MIG steps (``plan`` shows them BLOCKED) and MIG-backed vGPUs leave it out."""
    why = inv.out_of_service.get(PciAddress.parse(v.gpu))
    if why is None or v.verdict != "ready":
        return v
    return ModeVerdict(v.gpu, v.mode, "blocked", f"out of service: {why}",
                       f"repair it, then 'vgpuhost gpu uncordon {v.gpu}'")


def host_verdicts(verdicts: List[ModeVerdict]) -> Dict[str, str]:
    """``{mode: verdict}`` for the host: ``ready`` when some GPU is ready for it, else ``blocked``
    when some GPU is blocked, ``unknown`` when some is unknown, else ``unsupported``."""
    out: Dict[str, str] = {}
    for mode in MODES:
        seen = {v.verdict for v in verdicts if v.mode == mode}
        out[mode] = next((v for v in VERDICTS if v in seen), "unsupported")
    return out


def idle_gpus(verdicts: List[ModeVerdict]) -> List[str]:
    """The GPUs that can serve no mode now (no verdict ``ready``), BDF order."""
    gpus = list(dict.fromkeys(v.gpu for v in verdicts))
    return [g for g in gpus if not any(v.gpu == g and v.verdict == "ready" for v in verdicts)]


def host_ready(findings: List[Finding], verdicts: List[ModeVerdict]) -> bool:
    """The host is ready when no finding is an error and every GPU can serve some mode now."""
    return is_ready(findings) and not idle_gpus(verdicts)


def _passthrough_verdict(inv: Inventory, gpu: Gpu) -> ModeVerdict:
    subject = str(gpu.address)
    try:
        group, endpoints, _ = group_endpoints(inv, gpu.address)
    except VgpuhostError as e:
        fix = (e.hint or "").replace("; 'vgpuhost host check' says more", "")
        return ModeVerdict(subject, "passthrough", "blocked", e.message, fix)
    if all(d.driver == VFIO_PCI for d in endpoints):
        return ModeVerdict(subject, "passthrough", "ready",
                           f"IOMMU group {group} is bound to vfio-pci (passed through, or ready for a VM)")
    blockers = prepare_blockers(inv, gpu.address, endpoints, allow_boot_vga=False)
    if blockers:
        return ModeVerdict(subject, "passthrough", "blocked", "; ".join(blockers),
                           "each reason names its fix; then 'vgpuhost passthrough prepare " + subject + "'")
    n = len(endpoints)
    return ModeVerdict(subject, "passthrough", "ready",
                       f"IOMMU group {group}: {n} function{'s' if n != 1 else ''} would move to vfio-pci")


def _vgpu_verdict(inv: Inventory, gpu: Gpu, f: GpuFacts) -> ModeVerdict:
    subject = str(gpu.address)
    dev = gpu.pci

    def v(verdict: str, reason: str, fix: str = "") -> ModeVerdict:
        return ModeVerdict(subject, "vgpu", verdict, reason, fix)

    if dev.driver == "vfio-pci":
        return v("blocked", f"{gpu.model} is passed through (bound to vfio-pci): it carries no vGPUs",
                 f"vgpuhost passthrough release {subject}")
    if gpu.vgpu_backend:
        if gpu.vfs and not inv.iommu_enabled:
            return v("blocked", "vGPUs on SR-IOV VFs need the IOMMU, which is off", _iommu_param_fix(inv))
        if gpu.vmd is not None and gpu.vgpu_backend == Backend.VENDOR_VFIO:
            return v("blocked", "vendor-VFIO vGPUs are refused: " + (vmd_refusal(inv, gpu.address) or ""),
                     "put the GPU in a slot outside VMD, or turn VMD off for its ports in the firmware setup")
        types = [t for t in inv.vgpu_types if t.gpu == gpu.address]
        n_types = len({t.type_id for t in types})
        where = f"on {len(gpu.vfs)} SR-IOV VFs" if gpu.vfs else "on the physical function"
        if not n_types:
            if gpu.unreadable:
                return v("blocked", f"vGPU via {gpu.vgpu_backend} {where}, but {unread_count(gpu)}, "
                                    "so its vGPU types are unknown",
                         "read it again later ('vgpuhost host check'); if it stays, see the driver's messages (dmesg)")
            if f.mig_on and f.mig_on_demand:
                return v("ready", f"vGPU via {gpu.vgpu_backend} {where}: MIG on demand: a start makes the GPU "
                                  "instance of its MIG-backed type ('vgpuhost capacity' counts what fits)")
            if f.mig_on:
                return v("blocked", f"vGPU via {gpu.vgpu_backend} {where}, but no VF offers a vGPU type: MIG mode "
                                    "is on and MIG-backed types appear only on GPU instances",
                         f"create GPU instances: vgpuhost mig apply --gpu {subject} LAYOUT (or vgpu create "
                         "--create-gi)")
            return v("blocked", f"vGPU via {gpu.vgpu_backend} {where}, but "
                                f"{'no VF offers' if gpu.vfs else 'it offers no'} vGPU type",
                     "check the NVIDIA vGPU manager (nvidia-smi vgpu, its kernel log) and its licence of this board")
        free = len({t.type_id for t in types if t.available_instances > 0})
        return v("ready", f"vGPU via {gpu.vgpu_backend} {where}: {n_types} types, {free} with a free instance now")
    if f.vgpu_board is False:
        return v("unsupported", f"{gpu.model} has no vGPU support (passthrough only)")
    if dev.sriov_totalvfs and not dev.sriov_numvfs and dev.driver == "nvidia":
        return v("blocked", f"{gpu.model}: no SR-IOV VF is enabled, so no vGPU type is visible",
                 f"with the NVIDIA vGPU manager installed: /usr/lib/nvidia/sriov-manage -e {subject}")
    if dev.driver is None:
        return v("blocked", f"{gpu.model} is bound to no driver", "bind it to nvidia (the vGPU manager's driver)")
    if dev.driver != "nvidia":
        return v("blocked", f"{gpu.model} is bound to {dev.driver}", "bind it to nvidia (the vGPU manager's driver)")
    return v("blocked", f"{gpu.model} shows no vGPU types", "install the NVIDIA vGPU manager (nvidia_vgpu_vfio)")


def _mig_verdict(gpu: Gpu, f: GpuFacts) -> ModeVerdict:
    subject = str(gpu.address)

    def v(verdict: str, reason: str, fix: str = "") -> ModeVerdict:
        return ModeVerdict(subject, "mig", verdict, reason, fix)

    if f.mig_capable is False:
        return v("unsupported", f"{gpu.model} is not MIG-capable")
    if gpu.pci.driver == "vfio-pci":
        return v("blocked", f"{gpu.model} is passed through (bound to vfio-pci): NVML does not see it",
                 f"vgpuhost passthrough release {subject}")
    if f.mig_on is None:
        if f.mig_capable is None:
            return v("unknown" if f.nvml_error else "unsupported",
                     f"NVML: {f.nvml_error}" if f.nvml_error else f"{gpu.model} reports no MIG mode")
        return v("unknown", f"{gpu.model} is MIG-capable; NVML: {f.nvml_error or 'no answer'}",
                 "is the NVIDIA driver loaded? ('vgpuhost mig show')")
    if f.mig_pending is not None and f.mig_pending != f.mig_on:
        return v("blocked", f"MIG mode {'on' if f.mig_pending else 'off'} is pending until the GPU is reset",
                 "reset the GPU (nvidia-smi -r -i BDF) or reboot")
    if f.mig_on:
        n = f.gpu_instances or 0
        return v("ready", f"MIG mode on, {n} GPU instance{'s' if n != 1 else ''}")
    if gpu.vgpu_backend == Backend.VENDOR_VFIO and gpu.vfs:
        return v("blocked", f"MIG mode is off, and it can change only while the {len(gpu.vfs)} SR-IOV VFs are "
                            "disabled",
                 f"/usr/lib/nvidia/sriov-manage -d {subject}; vgpuhost mig enable --gpu {subject}; "
                 f"/usr/lib/nvidia/sriov-manage -e {subject}")
    if f.active_vgpus:
        return v("blocked", f"MIG mode is off, and {f.active_vgpus} vGPU(s) exist: it cannot change while they do",
                 "remove them first ('vgpuhost vgpu list')")
    return v("ready", f"MIG mode off: 'vgpuhost mig enable --gpu {subject}' turns it on")
