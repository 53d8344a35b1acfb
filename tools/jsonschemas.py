#!/usr/bin/env python3
"""JSON Schemas for vgpuhost's ``--json`` documents (docs/schemas/), inferred from real output.

    python tools/jsonschemas.py infer RECORD_DIR [--only NAME ...]

reads the documents the test suite recorded (``VGPUHOST_JSON_RECORD=RECORD_DIR``:
tests/jsonschema_plugin.py appends every document the CLI prints to
``RECORD_DIR/<schema name>.jsonl``) and writes one schema per document name to
``docs/schemas/<name>.schema.json`` (``vgpuhost.gpus/v1`` -> ``gpus.v1.schema.json``).
``make schemas`` runs the suite in record mode, then this. Review the diff:
the schemas are the published contract, and the tests validate every document
against them.

Inference: the union of what was seen. A key present in every sample of an
object is required; other keys are optional; objects stay open
(``additionalProperties``), because documents only ever gain fields. An
object whose keys are data (BDFs, type names, anything but a lower-case
identifier) is a map. integer and number merge to number; a scalar may also
be null (absent values are null in the documents, and a few samples may not
show it); a field seen only as null accepts anything.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "docs" / "schemas"
IDENT = re.compile(r"[a-z_][a-z0-9_]*\Z")


def file_name(schema: str) -> str:
    """``vgpuhost.gpus/v1`` -> ``gpus.v1.schema.json``."""
    m = re.fullmatch(r"vgpuhost\.([a-z0-9-]+)/(v[0-9]+)", schema)
    if not m:
        raise ValueError(f"not a vgpuhost document name: {schema!r}")
    return f"{m.group(1)}.{m.group(2)}.schema.json"


def _type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise TypeError(type(value))


class Shape:
    """What was seen at one place in the documents."""

    def __init__(self):
        self.types = set()
        self.items = None          # Shape of array items
        self.props = {}            # key -> Shape
        self.counts = {}           # key -> objects holding it
        self.objects = 0
        self.is_map = False

    def add(self, value) -> None:
        t = _type(value)
        self.types.add(t)
        if t == "array":
            if self.items is None:
                self.items = Shape()
            for v in value:
                self.items.add(v)
        elif t == "object":
            self.objects += 1
            if any(not IDENT.match(k) for k in value):
                self.is_map = True
            for k, v in value.items():
                self.props.setdefault(k, Shape()).add(v)
                self.counts[k] = self.counts.get(k, 0) + 1

    def schema(self) -> dict:
        types = set(self.types)
        if {"integer", "number"} <= types:
            types.discard("integer")
        if types <= {"null"}:
            return {}
        if types & {"string", "integer", "number", "boolean"}:
            types.add("null")      # a scalar may be null where the value is absent (few samples show it)
        out: dict = {"type": sorted(types)[0] if len(types) == 1 else sorted(types)}
        if "array" in types and self.items is not None and self.items.types:
            out["items"] = self.items.schema()
        if "object" in types:
            if self.is_map:
                merged = Shape()
                for shape in self.props.values():
                    merged.types |= shape.types
                    if shape.items is not None:
                        merged.items = merged.items or Shape()
                        merged.items.types |= shape.items.types
                        merged.items.props.update(shape.items.props)
                    merged.props.update(shape.props)
                out["additionalProperties"] = merged.schema() if merged.types else {}
            else:
                out["properties"] = {k: s.schema() for k, s in self.props.items()}
                required = [k for k in self.props if self.counts.get(k) == self.objects]
                if required:
                    out["required"] = required
        return out


def infer(name: str, docs) -> dict:
    shape = Shape()
    for doc in docs:
        shape.add(doc)
    body = shape.schema()
    body.setdefault("properties", {})["schema"] = {"const": name}
    stem = file_name(name)[:-len(".schema.json")]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://vgpuhost.dev/schemas/{stem}.schema.json",
            "title": f"vgpuhost --json document {name}",
            "description": f"Inferred by tools/jsonschemas.py from {len(docs)} document(s) the tests printed; "
                           "objects are open: documents only ever gain fields.",
            **body}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    inf = sub.add_parser("infer")
    inf.add_argument("record_dir", type=Path)
    inf.add_argument("--only", nargs="*", help="document names to (re)write; default all recorded")
    args = ap.parse_args(argv)
    SCHEMAS.mkdir(parents=True, exist_ok=True)
    for path in sorted(args.record_dir.glob("*.jsonl")):
        docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        name = docs[0]["schema"]
        if args.only and name not in args.only:
            continue
        target = SCHEMAS / file_name(name)
        target.write_text(json.dumps(infer(name, docs), indent=2) + "\n")
        print(f"{target.relative_to(REPO)}: {len(docs)} document(s)")
    write_listing()
    return 0


LISTING_START = "<!-- schemas: generated by tools/jsonschemas.py -->"
LISTING_END = "<!-- /schemas -->"


def write_listing() -> None:
    """The list of schema files in docs/reference/json.md, between its markers."""
    page = REPO / "docs" / "reference" / "json.md"
    text = page.read_text()
    rows = ["| document | schema |", "|---|---|"]
    for path in sorted(SCHEMAS.glob("*.schema.json")):
        const = json.loads(path.read_text()).get("properties", {}).get("schema", {}).get("const")
        what = f"`{const}`" if const else "the layout config file (YAML, `version: 1`)"
        rows.append(f"| {what} | [schemas/{path.name}](../schemas/{path.name}) |")
    block = "\n".join([LISTING_START, *rows, LISTING_END])
    if LISTING_START in text:
        head, rest = text.split(LISTING_START, 1)
        text = head + block + rest.split(LISTING_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    page.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
