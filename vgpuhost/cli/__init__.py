"""cli/: the ``vgpuhost`` command line (click).

Owns: the root group and the one registry of command families (main), the
shared helpers (common: Context, emit, store, printable, actor), one module
per command family, and the documented output (output).  Must not: hold
logic of its own, or import another cli module's private names.
"""
