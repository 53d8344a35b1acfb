"""Prometheus's HTTP API, read-only: instant queries (``GET /api/v1/query``).

Owns: one query and its vector result as ``[(labels, value)]``.  Must
not: interpret the series (``ops/fleet.py`` does).  Uses the standard
library's urllib; a URL that is not http(s) is refused.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Dict, List, Tuple

from ..model.errors import HostEnvironmentError, InputError


def query(base_url: str, promql: str, *, timeout_s: float = 30.0) -> List[Tuple[Dict[str, str], float]]:
    """The instant vector ``promql`` evaluates to now.  Raises InputError for a bad URL,
    HostEnvironmentError when Prometheus cannot be reached or answers with an error."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"invalid Prometheus URL {base_url!r}", hint="give http://HOST:PORT (e.g. http://127.0.0.1:9090)")
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            doc = json.loads(resp.read(64 * 1024 * 1024))
    except urllib.error.HTTPError as e:
        raise HostEnvironmentError(f"Prometheus at {base_url} answered {e.code} to {promql!r}",
                                   hint="check the URL and the query") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise HostEnvironmentError(f"cannot query Prometheus at {base_url}: {getattr(e, 'reason', e)}",
                                   hint="check that Prometheus runs and the URL") from None
    if doc.get("status") != "success" or doc.get("data", {}).get("resultType") != "vector":
        raise HostEnvironmentError(f"Prometheus at {base_url} did not answer {promql!r} with a vector",
                                   hint=str(doc.get("error", ""))[:200] or "check the query")
    out = []
    for item in doc["data"]["result"]:
        try:
            out.append((dict(item["metric"]), float(item["value"][1])))
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    return out
