"""``python -m vgpuhost.hook NAME OP SUBOP EXTRA``: the qemu hook's runtime (:mod:`vgpuhost.hook.runtime`)."""

from .runtime import run

run()
