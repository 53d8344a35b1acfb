"""observe/: discovery, turned into immutable snapshots.

Owns: reading the host through io/ once per operation (inventory, HostView)
and handing out frozen values.  Must not: change the host or decide policy.
"""
