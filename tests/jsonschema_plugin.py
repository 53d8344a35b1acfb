"""Every ``--json`` document the CLI prints during the tests is checked against its published schema.

A pytest plugin (tests/conftest.py loads it): an autouse fixture wraps
``vgpuhost.cli.output.dumps``, through which every ``--json`` document is
printed, so each document a test makes the CLI print in-process is validated
against ``docs/schemas/<name>.schema.json`` (the name is the document's
``schema`` field). A document without a ``schema`` name, or with one that has
no schema file, fails the test that printed it.

``VGPUHOST_JSON_RECORD=DIR`` appends every document to ``DIR/<name>.jsonl``
instead of validating; ``tools/jsonschemas.py infer DIR`` (``make schemas``)
turns those into schema files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "docs" / "schemas"
RECORD = os.environ.get("VGPUHOST_JSON_RECORD")
_validators = {}


def schema_file(name: str) -> Path:
    import re
    m = re.fullmatch(r"vgpuhost\.([a-z0-9-]+)/(v[0-9]+)", name)
    assert m, f"--json document name {name!r} is not vgpuhost.<name>/v<N>"
    return SCHEMAS / f"{m.group(1)}.{m.group(2)}.schema.json"


def validate_document(doc) -> None:
    """Raise AssertionError unless ``doc`` is a named document valid against its schema (in record
    mode: nothing; the document was recorded on its way out)."""
    if RECORD:
        return
    import jsonschema
    assert isinstance(doc, dict) and isinstance(doc.get("schema"), str), \
        f"--json document without a 'schema' name: {str(doc)[:200]}"
    name = doc["schema"]
    if name not in _validators:
        path = schema_file(name)
        assert path.is_file(), (f"no JSON Schema {path.relative_to(REPO)} for --json document {name!r}: "
                                "run `make schemas` and review the new file")
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        _validators[name] = jsonschema.Draft202012Validator(schema)
    errors = sorted(_validators[name].iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, (f"--json document {name} does not match {schema_file(name).relative_to(REPO)}: "
                        + "; ".join(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}"
                                    for e in errors[:5]))


def _record(doc) -> None:
    name = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(name, str):
        name = "vgpuhost.unnamed/v0"
    directory = Path(RECORD)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / (name.replace("/", "@") + ".jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(doc) + "\n")


@pytest.fixture(autouse=True)
def json_contract(monkeypatch):
    """Validate (or record) every --json document printed through vgpuhost.cli.output.dumps."""
    try:
        from vgpuhost.cli import output
    except ImportError:          # a test module that never loads the CLI
        yield
        return
    real = output.dumps

    def checked(doc):
        text = real(doc)
        printed = json.loads(text)          # what a reader gets (tuples are arrays there)
        if RECORD:
            _record(printed)
        else:
            validate_document(printed)
        return text

    monkeypatch.setattr(output, "dumps", checked)
    yield
