"""What a device asks for and what admission decided: the values the qemu hook records.

Owns: :class:`Demand` (one device's ask), :func:`vgpu_demand`,
:func:`passthrough_demand`, :class:`Admission` (a decision), :class:`Allocation`
(a device held, as admission counts it) and :func:`allocation`.  The rules
that decide live in :mod:`vgpuhost.policy.admission`, which re-exports these;
they are apart so that a domain start on a host without tenants (the hook's
path) records its allocations without importing the rules.  Pure: no I/O.
"""

from __future__ import annotations

from ..model.tenancy import BEST_EFFORT
from ..model.values import VgpuProfile, field, record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Optional, Tuple
    from ..model.gputime import ExpectedUse

VGPU, PASSTHROUGH = "vgpu", "passthrough"


@record(frozen=True)
class Demand:
    """What one device asks for.  ``framebuffer_mib``: the vGPU's framebuffer (MiB); ``mig_slices``:
    GPU-instance compute slices of a MIG-backed vGPU (0: time-sliced or passthrough); ``use``: its
    expected GPU-time demand (:class:`vgpuhost.model.gputime.ExpectedUse`, estimated by
    ``vgpuhost.ops.gputime``; None: the profile's fixed share, :mod:`vgpuhost.policy.compute`)."""

    kind: str
    profile: str = ""
    series: str = ""
    framebuffer_mib: int = 0
    mig_slices: int = 0
    use: Optional[ExpectedUse] = None

    @property
    def mig_backed(self) -> bool:
        return self.kind == VGPU and self.mig_slices > 0

    @property
    def hardware(self) -> bool:
        """A hardware partition: passthrough or a MIG-backed vGPU."""
        return self.kind == PASSTHROUGH or self.mig_backed

    def amount(self, dim: str) -> int:
        if dim == "vgpus":
            return 1 if self.kind == VGPU else 0
        if dim == "passthrough_gpus":
            return 1 if self.kind == PASSTHROUGH else 0
        return getattr(self, dim)

    def text(self) -> str:
        return f"vGPU {self.profile}" if self.kind == VGPU else "a passthrough GPU"


def vgpu_demand(profile: str, framebuffer_mib: Optional[int] = None) -> Demand:
    """The demand of one vGPU of ``profile`` (framebuffer from the type when known, else from the name)."""
    p = VgpuProfile.try_parse(profile)
    fb = framebuffer_mib if framebuffer_mib is not None else (p.framebuffer_gb * 1024 if p else 0)
    return Demand(VGPU, profile, p.series if p else "", fb, (p.gi_slices or 0) if p else 0)


def passthrough_demand() -> Demand:
    return Demand(PASSTHROUGH)


@record(frozen=True)
class Allocation:
    """A device a domain holds, as admission counts it.  ``tenant`` None: no tenant; ``burst``: admitted
    above the tenant's guaranteed limit; ``use``: its expected GPU-time demand (not stored: ops fills it
    from the metered history, ``vgpuhost.ops.gputime``; None: the profile's fixed share); ``reserved``:
    not made yet, reserved for an incoming live migration (nothing runs that a stop or detach frees)."""

    device: str
    owner: str
    tenant: Optional[str]
    gpu: str
    kind: str
    profile: str = ""
    framebuffer_mib: int = 0
    mig_slices: int = 0
    qos: str = BEST_EFFORT
    burst: bool = False
    use: Optional[ExpectedUse] = None
    reserved: bool = False

    @property
    def demand(self) -> Demand:
        return Demand(self.kind, self.profile, _series(self.profile), self.framebuffer_mib, self.mig_slices,
                      self.use)


#: profile name -> its series, parsed once per process (admission asks for every allocation's demand
#: on every decision; ``capacity --tenant`` makes thousands of decisions)
_SERIES: dict = {}


def _series(profile: str) -> str:
    s = _SERIES.get(profile)
    if s is None:
        p = VgpuProfile.try_parse(profile) if profile else None
        s = _SERIES[profile] = p.series if p else ""
    return s


def allocation(device: str, owner: str, gpu: str, demand: Demand, decision: "Admission") -> Allocation:
    """The allocation an admitted ``decision`` makes for ``device`` on ``gpu``."""
    return Allocation(device, owner, decision.tenant, gpu, demand.kind, demand.profile, demand.framebuffer_mib,
                      demand.mig_slices, decision.qos, decision.burst, demand.use)


@record(frozen=True)
class Admission:
    """The decision.  ``code``: ``ok`` or the rule that refused (``unknown-tenant``, ``series``,
    ``quota``, ``isolation``, ``qos``, ``pool``, ``capacity``, ``burst``: use no guarantee covers, a
    burst or not, would take room other tenants' unused guarantees hold; ``gpu-time``: no GPU where the
    framebuffer fits has room under its pool's compute ceiling for the expected GPU-time demand); ``quota``: the dimension that
    refused; ``gpu``/``parent``/``type_id``: the placement (vGPU) or the GPU (passthrough);
    ``candidates``: every GPU the request may use under the rules (placement may take any that fits);
    ``frees``: what would free room."""

    admitted: bool
    reason: str
    tenant: Optional[str]
    qos: str
    burst: bool = False
    code: str = "ok"
    quota: str = ""
    gpu: Optional[str] = None
    parent: Optional[str] = None
    type_id: Optional[str] = None
    candidates: Tuple[str, ...] = ()
    pool: Optional[str] = None
    frees: Tuple[str, ...] = field(default=())

    def remedy(self) -> Optional[str]:
        """What to do, or None: ``to free room: ...`` where room is what is short (quota, capacity,
        burst), ``to be admitted: ...`` for the other rules (an unknown tenant is added, not freed)."""
        if self.admitted or not self.frees:
            return None
        lead = "to free room" if self.code in ROOM_CODES else "to be admitted"
        return f"{lead}: " + "; ".join(self.frees)

    def one_line(self) -> str:
        remedy = self.remedy()
        return self.reason if remedy is None else f"{self.reason}; {remedy}"


#: the rules that refuse for want of room: their remedies free some
ROOM_CODES = frozenset({"quota", "capacity", "burst", "gpu-time"})


#: the start of the tail a refused admission row's value ends with (:func:`refusal_tag`)
REFUSAL_TAG = "refusal="


def refusal_tag(code: str, profile: str, qos: str, tenant: "Optional[str]") -> str:
    """The tail of a refused ``(admission)`` audit row's value, for the reader of the log:
    ``refusal=CODE profile=PROFILE qos=CLASS tenant=NAME`` (``tenant=`` empty: a domain without one).
    ``code``: :attr:`Admission.code`.  Nothing parses it back: the value echoes tenant-written text (the
    domain's name), so what admission decided is also stored in its own columns
    (``StateStore.audit_refusal``), which the capacity reconciler reads (trial 10 F4)."""
    return f"{REFUSAL_TAG}{code} profile={profile} qos={qos} tenant={tenant or ''}"
