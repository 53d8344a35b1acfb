"""io/: the only doors to the outside world.

Owns: every file, /proc and /sys access (hostroot derives the paths, sysfs
reads and writes kernel files, files the other files), processes (process),
SQLite (state), libvirt-python (virt), NVML (nvml, nvml_pynvml), locks, the
catalog file, and the choice between the real outside and the simulator
(backends: it names the simulator's stand-ins and never imports vgpuhost.sim).  Must not: decide anything;
it reports what it read and raises typed errors.
"""
