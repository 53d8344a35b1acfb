"""vgpuhost: share NVIDIA GPUs between libvirt/KVM virtual machines.

Whole GPUs by VFIO passthrough, time-sliced vGPUs (classic mdev and the
vendor-specific VFIO interface of vGPU 17+) and MIG-backed vGPUs.  See
docs/development/architecture.md for the architecture; every kernel path is derived from
:class:`vgpuhost.hostroot.HostRoot`.
"""

__version__ = "0.2.0"
