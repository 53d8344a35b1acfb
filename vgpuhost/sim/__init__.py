"""The host simulator: a product feature, not a test helper.

Builds a faithful host root (sysfs tree with real symlinks, proc files,
kernel module lists) from a YAML host spec and a shipped board catalog, and
stands in for the kernel when vgpuhost writes to that tree (see
:mod:`vgpuhost.sim.kernel`).  State lives in the tree on disk, so separate
processes (CLI, hook, mdevctl) see one host.

Public entry points: :func:`vgpuhost.sim.spec.load_spec`,
:func:`vgpuhost.sim.build.materialise`, :func:`vgpuhost.sim.data.bundled_specs`
(``vgpuhost sim ...``), and :mod:`vgpuhost.sim.libvirtd` (the demo's private
libvirtd).  The stand-ins for the outside (:class:`~vgpuhost.sim.kernel.SimKernel`,
:class:`~vgpuhost.sim.nvml.SimNvml`, :class:`~vgpuhost.sim.metering.SimMetering`)
are loaded by name, on a simulated root only, by :mod:`vgpuhost.io.backends`
(its ``SIMULATED`` table), which never imports this package: the simulator
builds on ``io``, not ``io`` on it.
"""
