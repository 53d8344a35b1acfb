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
"""

from __future__ import annotations

from ..observe.inventory import Gpu, Inventory, PciDevice
from ..model.values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import List, Optional

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
    for gpu in inv.gpus:
        out += check_gpu(inv, gpu)
    if not inv.gpus:
        out.append(Finding("warning", "NO_GPUS", "host", "no NVIDIA GPU found under sys/bus/pci/devices",
                           "check that the GPU is seated and visible in lspci"))
    return out


def _iommu_param_fix(inv: Inventory) -> str:
    if inv.host.cpu_vendor == "AuthenticAMD":
        return ("enable the IOMMU (AMD-Vi) in the firmware setup; add 'amd_iommu=on iommu=pt' to "
                "GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub (or grub2-mkconfig -o "
                "/boot/grub2/grub.cfg) and reboot")
    return ("add 'intel_iommu=on iommu=pt' to GRUB_CMDLINE_LINUX in /etc/default/grub, run update-grub "
            "(or grub2-mkconfig -o /boot/grub2/grub.cfg), enable VT-d in the firmware setup, and reboot")


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
        asked = args.get("intel_iommu") == "on" or args.get("amd_iommu") == "on"
        if asked:
            out.append(Finding("error", "IOMMU_OFF", "host",
                               "the kernel command line asks for the IOMMU but no IOMMU groups exist: "
                               "it is disabled in the firmware",
                               "enable VT-d (Intel) or AMD-Vi/IOMMU (AMD) in the firmware setup and reboot"))
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
    return out


def _describe(dev: Optional[PciDevice], addr: object) -> str:
    if dev is None:
        return str(addr)
    drv = f", {dev.driver}" if dev.driver else ", no driver"
    return f"{addr} ({dev.class_name}{drv})"


def _check_group(inv: Inventory, gpu: Gpu) -> List[Finding]:
    subject = str(gpu.address)
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
    if gpu.vgpu_backend:
        n_types = len({t.type_id for t in inv.vgpu_types if t.gpu == gpu.address})
        where = f"on {len(gpu.vfs)} SR-IOV VFs" if gpu.vfs else "on the physical function"
        out = [Finding("ok", "VGPU_READY", subject,
                       f"{gpu.model}: vGPU via {gpu.vgpu_backend} {where}, {n_types} types")]
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
