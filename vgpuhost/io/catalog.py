"""Reading the board catalog file shipped in the package.

Owns: :func:`load_catalog`, the catalog file (the data file
``vgpuhost/data/catalog.yaml`` by default, which real hosts and the
simulator both read) read and parsed into
:class:`vgpuhost.model.catalog.Catalog` values, once per process.
Must not: be imported on the qemu hook's path (YAML).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import yaml

from ..model.catalog import Catalog, parse_catalog
from . import files

#: the shipped catalog file, in the package's data folder (:func:`vgpuhost.io.files.data_path`)
CATALOG_FILE = "catalog.yaml"


@lru_cache(maxsize=4)
def load_catalog(path: Optional[str] = None) -> Catalog:
    """Load the catalog (the shipped one by default); raises OSError / yaml.YAMLError / KeyError when it is broken."""
    text = files.read_text_capped(path, 1 << 22) if path else files.data_text(CATALOG_FILE)
    if text is None:
        raise FileNotFoundError(2, "no such catalog file", path)
    return parse_catalog(yaml.safe_load(text))
