"""The concepts of vgpuhost.model.concepts and every copy of them: one definition, copies held equal.

The qemu hook's modules compare with plain-``str`` copies (model/kinds.py, model/tenancy.py: the
hook does not import ``enum``), and the OpenAPI document and the JSON schemas cannot import at all;
each copy is asserted equal to its enum here, so a new member added to an enum fails this test
until its copies have it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest
import yaml

from vgpuhost.model import concepts, kinds, tenancy, usage
from vgpuhost.model.errors import InputError

REPO = Path(__file__).resolve().parents[1]
OPENAPI = REPO / "vgpuhost" / "agent" / "openapi.yaml"
SCHEMAS = REPO / "docs" / "schemas"


# ---------------------------------------------------------------------------
# the enums

@pytest.mark.parametrize("cls", concepts.ALL, ids=lambda c: c.__name__)
def test_a_member_is_its_spelling(cls):
    for m in cls:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value
        assert json.dumps(m) == json.dumps(m.value)
        assert cls(m.value) is m
    assert len(set(cls.values())) == len(cls.values())


def test_parse_names_the_choices():
    assert concepts.parse(concepts.QosClass, "burstable", "QoS class") is concepts.QosClass.BURSTABLE
    with pytest.raises(InputError, match="QoS class 'gold' is not one of guaranteed, burstable, best-effort"):
        concepts.parse(concepts.QosClass, "gold", "QoS class")


# ---------------------------------------------------------------------------
# the plain copies the hook's modules use

def test_kinds_copies_equal_the_enums():
    assert kinds.Backend.ALL == concepts.Backend.values()
    assert kinds.PlacementStrategy.ALL == concepts.PlacementStrategy.values()
    assert kinds.SchedulerPolicy.ALL == concepts.SchedulerPolicy.values()
    assert (kinds.Owner.DOMAIN,) + kinds.Owner.POOL == concepts.OwnerKind.values()
    assert kinds.QosClass.ALL == concepts.QosClass.values()
    assert kinds.Isolation.ALL == concepts.Isolation.values()
    assert set(kinds.PlacementStrategy.FITTING) | set(kinds.PlacementStrategy.RESERVING) \
        == set(kinds.PlacementStrategy.ALL)
    assert set(kinds.PlacementStrategy.OFFERED) <= set(kinds.PlacementStrategy.ALL)
    assert set(concepts.DeviceKind.values()) == set(concepts.Backend.values()) | {"passthrough"}


def test_tenancy_copies_equal_the_enums():
    assert tenancy.QOS_CLASSES == concepts.QosClass.values()
    assert tenancy.ISOLATIONS == concepts.Isolation.values()
    assert set(tenancy.POLICY_CLASS) == set(concepts.SchedulerPolicy.values())
    assert set(tenancy.POLICY_CLASS.values()) <= set(concepts.QosClass.values())
    for v in (tenancy.DEFAULT_QOS, tenancy.UNTENANTED_QOS):
        assert v in concepts.QosClass.values()
    assert tenancy.DEFAULT_ISOLATION in concepts.Isolation.values()


def test_the_hook_runtime_does_not_import_enum():
    """The reason kinds and tenancy keep plain copies: the hook's entry module imports no ``enum``."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-I", "-S", "-c", "import vgpuhost.hook.runtime"],
                         capture_output=True, text=True, cwd=REPO)
    names = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "vgpuhost.hook.runtime" in names, out.stderr[-2000:]
    assert "enum" not in names and "vgpuhost.model.concepts" not in names


@pytest.mark.parametrize("case", ["mdev", "vendor-vfio", "passthrough"])
def test_the_hook_does_not_import_the_concepts(make_host, tmp_path, case):
    """A hook's ``prepare begin`` and ``release end`` (vGPUs on both backends, passthrough) compare with the
    plain copies: the concepts module is not imported (``enum`` itself may come with ``re`` or ``json``)."""
    from test_hook import A100, A100_AUDIO, DOM1, MDEV1, a100_vfs_off, install, pt_domain, vf_domain, vgpu_domain
    from test_hook_bundle import _run_handler
    from vgpuhost.io import modbundle
    if case == "mdev":
        host, xml = make_host("a40-mdev"), vgpu_domain("vm", DOM1, MDEV1)
    elif case == "vendor-vfio":
        host, xml = make_host("l40s-vendor-vfio"), vf_domain("vm", DOM1, "0000:21:00.4", "L40S-4Q")
    else:
        host = a100_vfs_off(make_host)
        xml = pt_domain("vm", DOM1, A100, [A100, A100_AUDIO])
    install(host, tmp_path)
    proc = _run_handler(host, modbundle.bundle_path(str(host.root)), xml,
                        tail="print('vgpuhost.model.concepts' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[0].startswith("[0, 0]"), proc.stdout
    assert lines[-1] == "False", proc.stdout


# ---------------------------------------------------------------------------
# the documents that cannot import: OpenAPI and the JSON schemas

#: property name -> the vocabulary its ``enum`` must list (in order; ``null`` aside)
OPENAPI_ENUMS = {
    "strategy": kinds.PlacementStrategy.OFFERED,
    "qos": concepts.QosClass.values(),
    "isolation": concepts.Isolation.values(),
    "policy": concepts.SchedulerPolicy.values(),
}
#: the config schema: a layout's vgpu.strategy takes the fitting strategies only (policy/config.py)
CONFIG_ENUMS = {
    "strategy": kinds.PlacementStrategy.FITTING,
    "policy": concepts.SchedulerPolicy.values(),
}


def _enums(node: Any, name: str = "") -> Iterator[Tuple[str, List[Any]]]:
    """``(property name, enum list)`` for every ``enum`` in a schema tree."""
    if isinstance(node, dict):
        if isinstance(node.get("enum"), list):
            yield name, node["enum"]
        for k, v in node.items():
            yield from _enums(v, k if isinstance(k, str) else name)
    elif isinstance(node, list):
        for v in node:
            yield from _enums(v, name)


_CONCEPT_VALUES = {v for cls in concepts.ALL for v in cls.values()}


def _check(doc: Any, expected: dict, where: str) -> int:
    seen = 0
    for name, values in _enums(doc):
        plain = tuple(v for v in values if v is not None)
        if name in expected:
            assert plain == tuple(expected[name]), f"{where}: enum of {name!r}"
            seen += 1
        else:
            assert not (set(plain) & _CONCEPT_VALUES) or name == "mode", \
                f"{where}: enum of {name!r} lists concept values; add it to this test's table"
    return seen


def test_openapi_enums_equal_the_enums():
    doc = yaml.safe_load(OPENAPI.read_text())
    assert _check(doc, OPENAPI_ENUMS, "openapi.yaml") >= 8     # 3 strategy, 3+ qos, 2 isolation, 1 policy


def test_schema_documents_equal_the_enums():
    seen = 0
    for path in sorted(SCHEMAS.glob("*.schema.json")):
        expected = CONFIG_ENUMS if path.name == "config.v1.schema.json" else OPENAPI_ENUMS
        if path.name == "bill.v1.schema.json":      # a bill line's device kind ("": a line of no device)
            expected = {**expected, "kind": ("",) + usage.METERED_KINDS}
        seen += _check(json.loads(path.read_text()), expected, path.name)
    assert seen >= 2
