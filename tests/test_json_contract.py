"""The --json contract: errors are JSON documents too, and every document has a published schema.

Every --json document a test prints in-process is validated against
docs/schemas/<name>.schema.json by tests/jsonschema_plugin.py. This file adds
the error documents, a matrix of commands over simulated hosts (so each
document name is exercised here, whatever other tests do), and checks that
the schema files are valid JSON Schema and listed in docs/reference/json.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jsonschema_plugin import SCHEMAS, validate_document
from vgpuhost.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, code, kind, words", [
    (["--root", "/nonexistent", "--json", "gpus"], 2, "HostEnvironmentError", "is not a directory"),
    (["--json", "gpus", "--colour"], 2, "UsageError", "No such option"),
    (["--json", "vgpu", "create", "--profile", "A40-8Q", "--root", "/"], 2, "UsageError", "global option"),
    (["--json", "scheduler", "decode", "0xzz"], None, None, None),
])
def test_errors_under_json_are_documents(capsys, argv, code, kind, words):
    got, out, err = run(capsys, *argv)
    if code is None:                      # a command that reports its own finding as a document
        assert got in (1, 2) and json.loads(out)["schema"].startswith("vgpuhost.")
        return
    assert got == code
    doc = json.loads(out)
    validate_document(doc)
    assert doc["schema"] == "vgpuhost.error/v1" and doc["exit_code"] == code and doc["type"] == kind
    assert words in doc["error"] + (doc["hint"] or "")
    # the one line on stderr stays, for people and logs
    assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1


def test_refusal_under_json_carries_hint_and_exit_code(make_host, capsys):
    host = make_host("a40-mdev")
    code, out, err = run(capsys, "--root", str(host.root), "--json", "vgpu", "create", "--profile", "A40-99Q")
    assert code == 2
    doc = json.loads(out)
    validate_document(doc)
    assert doc["type"] == "InputError" and doc["hint"] and doc["exit_code"] == 2
    assert err == f"vgpuhost: error: {doc['error']}; {doc['hint']}\n"
    # without --json: the line only, stdout empty
    code, out, err = run(capsys, "--root", str(host.root), "vgpu", "create", "--profile", "A40-99Q")
    assert code == 2 and out == "" and err.startswith("vgpuhost: error: ")


COMMANDS = [
    ("a40-mdev", ["host", "check"]), ("a40-mdev", ["gpus"]), ("a40-mdev", ["types"]),
    ("a40-mdev", ["vgpu", "list"]), ("a40-mdev", ["audit"]), ("a40-mdev", ["hook", "status"]),
    ("a40-mdev", ["vgpu", "create", "--profile", "A40-8Q", "--dry-run"]),
    ("a40-mdev", ["render", "--profile", "A40-8Q"]), ("a40-mdev", ["reconcile", "--check"]),
    ("a40-mdev", ["scheduler", "show"]), ("a40-mdev", ["scheduler", "decode", "0x3c3c0001"]),
    ("a40-mdev", ["passthrough", "prepare", "0000:81:00.0", "--dry-run"]),   # a PF without SR-IOV VFs enabled
    ("a100-sriov-mdev", ["passthrough", "modprobe-config", "0000:41:00.0"]),
    ("h200-mig", ["mig", "show"]), ("a40-mdev", ["hook", "install", "--dry-run"]),
    ("a40-mdev", ["install-units", "--dry-run"]), ("a40-mdev", ["capacity"]), ("a40-mdev", ["tenant", "list"]),
    ("a40-mdev", ["scheduler", "set", "--gpu", "0000:81:00.0", "--policy", "equal-share"]),
    ("a40-mdev", ["scheduler", "set", "--gpu", "0000:81:00.0", "--policy", "equal-share", "--persist"]),
    ("l40s-vendor-vfio", ["vgpu", "mode", "--gpu", "0000:21:00.0", "--mixed-size", "on", "--dry-run"]),
    ("a40-mdev", ["tenant", "usage"]), ("a40-mdev", ["tenant", "openstack"]), ("a40-mdev", ["tenant", "policy"]),
    ("a40-mdev", ["usage"]), ("a40-mdev", ["advise"]),
    ("a40-mdev", ["gpu", "cordon", "0000:81:00.0", "--dry-run"]), ("a40-mdev", ["gpu", "drain", "0000:81:00.0"]),
    ("a40-mdev", ["gpu", "uncordon", "0000:81:00.0"]),
    (None, ["sim", "specs"]),
]


@pytest.mark.parametrize("spec, argv", COMMANDS, ids=[" ".join(a) for _, a in COMMANDS])
def test_json_documents_match_their_schemas(make_host, capsys, spec, argv):
    base = ["--root", str(make_host(spec).root)] if spec else []
    code, out, err = run(capsys, *base, "--json", *argv)
    assert code in (0, 1), err
    validate_document(json.loads(out))      # the plugin validated it too, on the way out


def test_sim_create_document(tmp_path, capsys):
    code, out, err = run(capsys, "--json", "sim", "create", "a40-mdev", str(tmp_path / "host"))
    assert code == 0, err
    validate_document(json.loads(out))


def test_config_check_and_plan_documents(make_host, capsys):
    host = make_host("a40-mdev")
    config = REPO / "examples" / "config" / "vgpu-a40.yaml"
    for argv in (["config", "check", "-c", str(config)], ["plan", "-c", str(config)],
                 ["assert", "-c", str(config)]):
        code, out, err = run(capsys, "--root", str(host.root), "--json", *argv)
        assert code in (0, 1, 2), err
        validate_document(json.loads(out))


def test_schema_files_are_valid_and_listed():
    import jsonschema
    files = sorted(SCHEMAS.glob("*.schema.json"))
    assert files, "no schemas in docs/schemas"
    listing = (REPO / "docs" / "reference" / "json.md").read_text()
    for path in files:
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert f"schemas/{path.name}" in listing, f"{path.name} is not listed in docs/reference/json.md"


def test_config_file_schema():
    """docs/schemas/config.v1.schema.json accepts every shipped example config and refuses the
    structural mistakes vgpuhost refuses (unknown keys, wrong types, version, ranges)."""
    import jsonschema
    import yaml
    from vgpuhost.policy import config as vconfig
    validator = jsonschema.Draft202012Validator(json.loads((SCHEMAS / "config.v1.schema.json").read_text()))
    examples = sorted((REPO / "examples" / "config").glob("*.yaml"))
    assert examples
    for path in examples:
        vconfig.load(path)
        errors = list(validator.iter_errors(yaml.safe_load(path.read_text())))
        assert not errors, (path.name, errors[0].message)
    data = REPO / "tests" / "data" / "config"
    for case in ("unknown-key", "unknown-key-nested", "wrong-type-count", "wrong-type-version", "bad-version",
                 "scheduler-out-of-range"):
        doc = yaml.safe_load((data / f"{case}.yaml").read_text())
        assert list(validator.iter_errors(doc)), f"{case}.yaml passes the schema"
        with pytest.raises(Exception):
            vconfig.load(data / f"{case}.yaml")
