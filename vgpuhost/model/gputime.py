"""A vGPU's expected GPU-time demand, and a pool's compute ceiling per GPU, as values.

Owns: :class:`ExpectedUse` (the share of one GPU's time a vGPU is expected
to use, and where that figure came from), the sources
(:data:`METERED`, :data:`TENANT_PROFILE`, :data:`PROFILE_SHARE`, :data:`IDLE`) and the
ceiling bounds (:data:`DEFAULT_CEILING`, :data:`MAX_CEILING`).  Must not:
read the metering store (``vgpuhost.ops.gputime`` computes estimates) or
decide placement (``vgpuhost.policy.compute`` does).  Imported on the qemu
hook's path: no ``typing``, no ``enum``.

Units: a share is a fraction of one physical GPU's time (1.0: the whole
GPU busy all the time), as the metering sampler's ``sm_busy_s / alloc_s``
reads it (docs/metering.md).
"""

from __future__ import annotations

from .values import record

#: where an estimate came from, most trusted first: the domain's own metered history; the mean of
#: its tenant's domains on the same profile; the profile's fixed share (framebuffer / GPU framebuffer,
#: what the fixed-share scheduler gives a vGPU of an equal-size GPU full of its type)
METERED, TENANT_PROFILE, PROFILE_SHARE = "metered", "tenant-profile", "profile"
#: a vGPU no domain holds (a layout's or a manual one, free to be lent): it expects no GPU time
IDLE = "idle"
SOURCES = (METERED, TENANT_PROFILE, PROFILE_SHARE, IDLE)

#: a pool's compute ceiling per GPU when the layout sets none (equal-share, fixed-share, best-effort)
DEFAULT_CEILING = 1.0
#: the highest ceiling a best-effort pool may declare (eight times overcommitted)
MAX_CEILING = 8.0


@record(frozen=True)
class ExpectedUse:
    """A vGPU's expected GPU-time demand: ``share`` of one GPU (0.0 to 1.0; float), ``source`` one of
    :data:`SOURCES`; ``samples_s``: the allocated seconds of metered history behind it (0 for
    :data:`PROFILE_SHARE`)."""

    share: float
    source: str = PROFILE_SHARE
    samples_s: float = 0.0

    def text(self) -> str:
        """``0.31 of a GPU (metered)``."""
        return f"{self.share:.2f} of a GPU ({self.source})"
