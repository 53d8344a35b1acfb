"""Jinja2 templates shipped in ``vgpuhost/data/templates`` (``templates/`` in the repo).

Owns: loading and rendering the package's templates (libvirt XML snippets)
so they are found from a source checkout and from an installed wheel alike.
Must not: decide which hostdev form a device gets (policy lives with the
libvirt integration).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, List

import jinja2

from ..io import files


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The package's template environment: strict undefined, XML autoescaped."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(files.data_path("templates")),
        autoescape=jinja2.select_autoescape(["xml", "xml.j2"], default_for_string=True),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def render(name: str, **context: Any) -> str:
    """Render template ``name`` (e.g. ``hostdev-pci.xml.j2``); raises jinja2 errors on missing values."""
    return environment().get_template(name).render(**context)


def template_names() -> List[str]:
    return sorted(environment().list_templates(extensions=["j2"]))
