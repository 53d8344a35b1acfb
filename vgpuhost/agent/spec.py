"""The agent's API document (OpenAPI 3.0, ``vgpuhost/agent/openapi.yaml``), as shipped bytes.

Owns: reading the document from the installed package.  Must not: change it;
tests check it against the served endpoints.
"""

from __future__ import annotations

import pkgutil

from ..model.errors import HostEnvironmentError

DOCUMENT = "openapi.yaml"


def document_bytes() -> bytes:
    """The OpenAPI document's bytes (YAML).  Raises HostEnvironmentError when the package lacks it."""
    data = pkgutil.get_data("vgpuhost.agent", DOCUMENT)
    if data is None:
        raise HostEnvironmentError("the agent's API document is missing from the installed package",
                                   hint="reinstall vgpuhost")
    return data
