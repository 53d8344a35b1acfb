"""Points in time as operators write them: ISO 8601, or an age (``30m``, ``2h``, ``7d``).

Owns: :func:`parse_when`, the one parser of points in time (``usage``/``advise``
``--since``/``--until``), and :func:`parse_since` on it, shared by ``vgpuhost audit
--since`` and the agent's ``GET /v1/audit?since=``.  Must not: read the host.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Optional

from ..model.errors import InputError
from ..model.values import clipped


#: the latest time accepted: an hour's end (``--until`` rounds up to it) and a month after it stay
#: within :class:`datetime`'s range (year 9999)
LATEST = datetime(9999, 12, 1, tzinfo=timezone.utc)
#: the earliest time accepted (any offset still converts to UTC)
EARLIEST = datetime(1, 1, 2, tzinfo=timezone.utc)
HINT = ("give an ISO 8601 time (2026-11-29T10:00, UTC unless an offset is given; years 0001 to 9999-11) "
         "or an age like 30m, 2h, 7d")


def parse_when(text: str, now: datetime) -> Optional[datetime]:
    """``2026-11-29T10:00`` (UTC unless an offset is given) or an age before ``now``
    (``30m``, ``2h``, ``7d``, ``90s``) as an aware UTC datetime, within :data:`EARLIEST` ..
    :data:`LATEST` (an age older than that: :data:`EARLIEST`); None when it is neither, or a
    time out of that range (trial 9 F3: ``9999-12-31T23:30`` overflowed as its hour was rounded up)."""
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*([smhd])\s*", text)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m[2]]
        try:
            return max(EARLIEST, now - timedelta(**{unit: int(m[1])}))
        except OverflowError:
            return EARLIEST
    try:
        when = datetime.fromisoformat(text.strip())
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        when = when.astimezone(timezone.utc)
    except (ValueError, OverflowError):
        return None
    return when if EARLIEST <= when <= LATEST else None


def parse_since(text: str, name: str = "--since") -> str:
    """``text`` as a UTC ISO 8601 time with microseconds (the audit log's spelling).

    An age (``30m``, ``2h``, ``7d``, ``45s``) counts back from now; a time
    without an offset is UTC.  Raises InputError for anything else, naming
    the value as ``name`` (the CLI's option, the API's query parameter) and
    showing at most :data:`~vgpuhost.model.values.SHOWN_MAX` characters of it.
    """
    when = parse_when(text, datetime.now(timezone.utc))
    if when is None:
        raise InputError(f"invalid {name} {clipped(text)!r}", hint=HINT)
    return when.isoformat(timespec="microseconds")
