"""vgpuhost.values.record: what @dataclass would make, without importing dataclasses (the qemu hook's path)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import vgpuhost
from vgpuhost.model.values import PciAddress, field, record, replace


@record(frozen=True, order=True)
class Point:
    x: int
    y: int = 0


@record
class Bag:
    name: str
    items: list = field(default_factory=list)
    note: str = ""


def test_init_repr_eq_hash_order_match_dataclass():
    @dataclasses.dataclass(frozen=True, order=True)
    class DPoint:
        x: int
        y: int = 0

    for a, b in [((1,), (1, 0)), ((1, 2), (2, 1)), ((3, 4), (3, 5))]:
        assert (Point(*a) == Point(*b)) == (DPoint(*a) == DPoint(*b))
        assert (Point(*a) < Point(*b)) == (DPoint(*a) < DPoint(*b))
        assert (Point(*a) >= Point(*b)) == (DPoint(*a) >= DPoint(*b))
        assert hash(Point(*a)) == hash(DPoint(*a))
    assert repr(Point(1, y=2)) == "Point(x=1, y=2)"
    assert Point(1) != (1, 0) and Point.__match_args__ == ("x", "y")
    with pytest.raises(TypeError):
        Point(1) < (1, 0)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        Point()


def test_frozen_and_mutable():
    p = Point(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        del p.y
    b, c = Bag("a"), Bag("a")
    b.items.append(1)
    assert c.items == [] and b.__dict__ == {"name": "a", "items": [1], "note": ""}
    b.note = "n"
    assert b.note == "n" and Bag.__hash__ is None


def test_dataclasses_functions_accept_records():
    p = PciAddress.parse("0000:41:00.0")
    assert dataclasses.is_dataclass(p) and [f.name for f in dataclasses.fields(p)] == ["domain", "bus", "slot", "function"]
    assert dataclasses.replace(p, function=1) == PciAddress.parse("0000:41:00.1") == replace(p, function=1)
    assert dataclasses.asdict(Bag("a", [1])) == {"name": "a", "items": [1], "note": ""}
    assert dataclasses.replace(Bag("a", [1]), note="x") == Bag("a", [1], "x")
    with pytest.raises(TypeError):
        replace(p, nope=1)


def test_definition_errors():
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):
        @record
        class Bad:
            a: int = 0
            b: int


def test_records_do_not_import_dataclasses():
    code = ("import sys\nfrom vgpuhost.model.values import PciAddress\nfrom vgpuhost.observe.inventory import discover\n"
            "p = PciAddress.parse('0000:41:00.0'); hash(p); sorted([p, p]); repr(p)\n"
            "print(sorted(m for m in ('dataclasses', 'inspect', 'typing') if m in sys.modules))")
    pkg_parent = str(Path(vgpuhost.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = [{pkg_parent!r}]\n" + code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
