"""Reading the YAML files vgpuhost is given: a config, a layout, a simulated host's spec.

Owns: :func:`read_text_file`, the checked read of such a file (a regular
file, size-capped, UTF-8) that comes before parsing it with
:func:`vgpuhost.model.yamldoc.load_located`.  Must not: parse or know any
schema.
"""

from __future__ import annotations

import os
import stat

from ..model.errors import InputError

MAX_FILE_BYTES = 1 << 20


def read_text_file(path: "str | os.PathLike[str]", what: str, *, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of a regular file of at most ``max_bytes``; InputError otherwise.

    Refuses FIFOs, devices and directories (reading them could block or never
    end) and files that are not UTF-8.
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} {p!r} is not a regular file", hint="name a YAML file")
        if st.st_size > max_bytes:
            raise InputError(f"{what} {p!r} is {st.st_size} bytes, over the {max_bytes}-byte limit")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputError(f"cannot read {what} {p!r}: {e.strerror}", hint="check the path") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} {p!r} is over the {max_bytes}-byte limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{what} {p!r} is not UTF-8 text") from None
