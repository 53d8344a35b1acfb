"""plan/: plans as data.

Owns: typed Step values and the one audited Executor (execute, verify, audit,
undo on failure), and the pure planners: plan(desired, HostView) -> Plan.
Must not: read the host while planning.
"""
