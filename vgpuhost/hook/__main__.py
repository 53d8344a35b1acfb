"""``python -m vgpuhost.hook NAME OP SUBOP EXTRA``: the qemu hook's runtime (:mod:`vgpuhost.hook.runtime`)."""

import gc

gc.disable()        # a short-lived process that ends with os._exit: see hook/install.py's boot line

from .runtime import run  # noqa: E402

run()
