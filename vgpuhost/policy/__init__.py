"""policy/: pure decisions.

Owns: placement, host checks, the config schema, the qemu hook's request
policy and allow-list parsing, admission, and the other rules vgpuhost
applies to snapshots.  Must not: do I/O (callers pass what io/ and observe/
read).
"""
