"""Points in time as operators write them: ISO 8601, or an age (``30m``, ``2h``, ``7d``).

Owns: :func:`parse_since`, shared by ``vgpuhost audit --since`` and the
agent's ``GET /v1/audit?since=``.  Must not: read the host.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from ..model.errors import InputError
from ..model.values import clipped


def parse_since(text: str, name: str = "--since") -> str:
    """``text`` as a UTC ISO 8601 time with microseconds (the audit log's spelling).

    An age (``30m``, ``2h``, ``7d``, ``45s``) counts back from now; a time
    without an offset is UTC.  Raises InputError for anything else, naming
    the value as ``name`` (the CLI's option, the API's query parameter) and
    showing at most :data:`~vgpuhost.model.values.SHOWN_MAX` characters of it.
    """
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*([smhd])\s*", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        try:
            return (datetime.now(timezone.utc) - timedelta(**{unit: int(m[1])})).isoformat(timespec="microseconds")
        except OverflowError:
            return datetime.min.replace(tzinfo=timezone.utc).isoformat(timespec="microseconds")
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InputError(f"invalid {name} {clipped(text)!r}",
                         hint="give an ISO 8601 time (2026-11-29T10:00, UTC unless an offset is given) "
                              "or an age like 30m, 2h, 7d") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat(timespec="microseconds")
