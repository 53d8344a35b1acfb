"""model/: the values every layer shares.

Owns: errors (one family, exit codes, hints), value types (PciAddress,
VgpuProfile, MigProfile, ...), the small vocabularies (kinds: Owner, Backend,
VgpuState), the one board table (boards) and the detailed catalog's values
(catalog).  Must not: import anything else of vgpuhost, touch files or the
host, or import anything heavy at module level (the qemu hook uses it).
"""
