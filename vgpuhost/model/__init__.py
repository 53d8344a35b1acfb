"""model/: the values every layer shares.

Owns: errors (one family, exit codes, hints), value types (PciAddress,
VgpuProfile, MigProfile, ...), the small vocabularies (kinds: Owner, Backend,
VgpuState), the one board table (boards), the detailed catalog's values
(catalog), the doors' value types (nvml: NVML's; records and usage: the
state store's) and strict YAML parsing (yamldoc).  Must not: import anything
else of vgpuhost, touch files or the host, or import anything heavy at
module level in the modules every qemu hook start imports (nvml brings
dataclasses and typing, as io/nvml, only where NVML is called; catalog,
usage and yamldoc are off the hook's path).
"""
