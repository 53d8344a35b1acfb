"""ops/: orchestration.

Owns: the operations that change the host (passthrough, vgpu, mig,
scheduler, layout apply, attach/detach, a domain's devices, tenancy), each
observing once, deciding with policy/ and plan/, and writing through io/.
Must not: be imported by the layers below it; entry points (hook, agent,
cli) call it.
"""
