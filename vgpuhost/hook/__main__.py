"""``python -m vgpuhost.hook NAME OP SUBOP EXTRA``: the qemu hook's handler, by hand."""

from .handler import run

run()
