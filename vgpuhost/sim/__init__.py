"""The host simulator: a product feature, not a test helper.

Builds a faithful host root (sysfs tree with real symlinks, proc files,
kernel module lists) from a YAML host spec and a shipped board catalog, and
stands in for the kernel when vgpuhost writes to that tree (see
:mod:`vgpuhost.sim.kernel`).  State lives in the tree on disk, so separate
processes (CLI, hook, mdevctl) see one host.

Public entry points: :func:`vgpuhost.sim.spec.load_spec`,
:func:`vgpuhost.sim.build.materialise`, :func:`vgpuhost.sim.data.bundled_specs`.
Product code reaches the simulator only through :mod:`vgpuhost.io.backends`.
"""
