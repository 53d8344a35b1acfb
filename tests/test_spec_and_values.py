"""Host spec validation, value parsing, and the one-door rules of the codebase."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from vgpuhost.cli.main import main
from vgpuhost.model.errors import InputError
from vgpuhost.sim.spec import parse_spec
from vgpuhost.model.values import MigProfile, PciAddress, VgpuProfile, parse_description, parse_uuid

PKG = Path(__file__).resolve().parent.parent / "vgpuhost"

GOOD = """version: 1
name: t
devices:
  - {bdf: "0000:81:00.0", model: A40}
"""


@pytest.mark.parametrize("text, line, needle", [
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40, colour: red}\n", 4, "unknown key 'colour'"),
    ("version: 2\nname: t\ndevices: []\n", 1, "unsupported spec version 2"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"41:00.0\", model: A40}\n", 4, "invalid PCI address '41:00.0'"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: Z9000}\n", 4, "unknown model 'Z9000'"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40, numa_node: one}\n", 4, "numa_node must be int"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40}\n  - {bdf: \"0000:81:00.0\", model: A40}\n", 5, "listed twice"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40, vgpu: {backend: vendor-vfio}}\n", 4, "needs SR-IOV VFs"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: L40S, vgpu: {backend: mdev, sriov_numvfs: 64}}\n", 4, "out of range"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40, mig: {mode: true}}\n", 4, "not MIG-capable"),
    ("version: 1\nname: t\ndevices:\n  - {bdf: \"0000:81:00.0\", model: A40, upstream: \"0000:80:03.0\"}\n", 4, "must be listed before"),
    ("version: 1\nname: t\ndevices: [\n", 4, "malformed YAML"),
    ("version: 1\nname: t\nname: u\ndevices: []\n", 3, "duplicate key 'name'"),
    ("version: 1\nname: t\ndevices: []\nfaults:\n  - {op: explode}\n", 5, "fault op must be one of"),
])
def test_malformed_specs_name_the_line(text, line, needle):
    with pytest.raises(InputError) as ei:
        parse_spec(text, source="host.yaml")
    msg = ei.value.message
    assert msg.startswith(f"host.yaml:{line}: "), msg
    assert needle in msg


def test_good_spec_parses():
    spec = parse_spec(GOOD)
    assert spec.devices[0].bdf == PciAddress.parse("0000:81:00.0") and spec.iommu is True


def test_malformed_spec_file_via_cli_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nname: t\ndevices:\n  - {bdf: 0000:41:00.0, model: A40}\n")  # YAML 1.1 reads this as a number
    code = main(["sim", "create", str(bad), str(tmp_path / "root")])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert f"{bad}:4:" in err and "quoted PCI address" in err
    assert not (tmp_path / "root").exists()   # nothing built


def test_binary_spec_file(tmp_path, capsys):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    code = main(["sim", "create", str(bad), str(tmp_path / "root")])
    assert code == 2 and "Traceback" not in capsys.readouterr().err


# --- values -----------------------------------------------------------------

@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_pci_address_round_trip(domain, bus, slot, fn):
    a = PciAddress(domain, bus, slot, fn)
    assert PciAddress.parse(str(a)) == a
    assert PciAddress.parse(str(a).upper()) == a
    assert a.with_devfn(a.devfn) == a


@given(st.text(max_size=20))
def test_pci_address_parse_never_crashes(text):
    try:
        a = PciAddress.parse(text)
    except InputError as e:
        assert "invalid PCI address" in e.message
    else:
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", str(a))


@pytest.mark.parametrize("name, board, fb, series, slices, me", [
    ("GRID A100-4C", "A100", 4, "C", None, False),
    ("NVIDIA A40-8Q", "A40", 8, "Q", None, False),
    ("A100-1-5CME", "A100", 5, "C", 1, True),
    ("A100-1-5C", "A100", 5, "C", 1, False),
    ("NVIDIA H200X-1-18C", "H200X", 18, "C", 1, False),
    ("L40S-1B", "L40S", 1, "B", None, False),
    ("a40-8a", "A40", 8, "A", None, False),
])
def test_vgpu_profile_parse(name, board, fb, series, slices, me):
    p = VgpuProfile.parse(name)
    assert (p.board, p.framebuffer_gb, p.series, p.gi_slices, p.media_extensions) == (board, fb, series, slices, me)


def test_me_is_not_stripped():
    assert VgpuProfile.parse("A100-1-5CME") != VgpuProfile.parse("A100-1-5C")
    assert str(VgpuProfile.parse("A100-1-5CME")) == "A100-1-5CME"


@pytest.mark.parametrize("bad", ["A40", "A40-8X", "A40-Ada-1-8Q", "A40-8QGFX", "A40-08Q", "A100-12-5C", "A40-8QME", "-8Q", ""])
def test_vgpu_profile_rejects(bad):
    with pytest.raises(InputError):
        VgpuProfile.parse(bad)


@given(st.sampled_from(["A100", "A40", "L40S", "H200X"]), st.integers(1, 200),
       st.sampled_from("QBAC"), st.one_of(st.none(), st.integers(1, 7)), st.booleans())
def test_vgpu_profile_round_trip(board, fb, series, slices, me):
    if slices is None:
        me = False        # a suffix belongs to a MIG-backed type; any series may be MIG-backed
    p = VgpuProfile(board, fb, series, slices, me)
    assert VgpuProfile.parse(str(p)) == p


def test_description_and_mig_and_uuid():
    d = parse_description("num_heads=4, frl_config=60, framebuffer=2048M, max_resolution=7680x4320, max_instance=4")
    assert d == {"num_heads": "4", "frl_config": "60", "framebuffer": "2048M",
                 "max_resolution": "7680x4320", "max_instance": "4"}
    assert str(MigProfile.parse("1g.10gb+me")) == "1g.10gb+me" and MigProfile.parse("3g.40gb").slices == 3
    with pytest.raises(InputError):
        MigProfile.parse("3g")
    assert parse_uuid("2B9A4C1E-5D3F-4E7A-8C6B-0F1E2D3C4B5A") == "2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a"
    with pytest.raises(InputError):
        parse_uuid("2b9a4c1e5d3f4e7a8c6b0f1e2d3c4b5a")


# --- one door per outside system ------------------------------------------------

def test_no_literal_kernel_paths_outside_hostroot():
    """Every kernel path comes from HostRoot (STYLE.md: mdevctl's Environment)."""
    pattern = re.compile(r"""["'](/sys|/proc|/dev/vfio)(/|["'])""")
    offenders = [f"{p.relative_to(PKG)}:{i}" for p in PKG.rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_only_sysfs_module_opens_kernel_files_for_writing():
    writers = []
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "sim" or rel.name == "sysfs.py":
            continue
        text = p.read_text()
        if re.search(r"open\([^)]*['\"]w", text) or ".write_text(" in text:
            writers.append(str(rel))
    assert writers == []


# --- hostile specs: one line, exit 2, nothing written outside the target ----------

@pytest.mark.parametrize("fragment, needle", [
    ('  - {bdf: "0000:81:00.0", model: A40, driver: "/tmp/victim"}\n', "is not a valid name"),
    ('  - {bdf: "0000:81:00.0", model: A40, driver: "../../../../etc"}\n', "is not a valid name"),
    ('  - {bdf: "0000:81:00.0", model: A40, driver: ""}\n', "is not a valid name"),
    ('  - {bdf: "0000:81:00.0", model: A40, upstream: "0000:81:00.0"}\n', "must be listed before"),
    ('  - {bdf: "0000:81:00.0", model: A40, numa_node: -7}\n', "out of range"),
    ('  - {bdf: "0000:81:00.0", model: A40, iommu_group: -1}\n', "out of range"),
])
def test_hostile_device_fields(fragment, needle):
    with pytest.raises(InputError, match=needle):
        parse_spec("version: 1\nname: t\ndevices:\n" + fragment)


@pytest.mark.parametrize("host_fragment", [
    'host: {kernel_release: "/tmp/x/kr"}', 'host: {modules: ["/tmp/x/mod"]}',
    'host: {builtin_modules: [".."]}', 'host: {kernel_release: "' + "k" * 300 + '"}',
    'host: {processes: ["evil\\nname"]}',
])
def test_hostile_host_names(host_fragment):
    with pytest.raises(InputError, match="is not a valid name"):
        parse_spec(f"version: 1\nname: t\n{host_fragment}\ndevices: []\n")


def test_fault_rules():
    base = 'version: 1\nname: t\ndevices:\n  - {bdf: "0000:81:00.0", model: A40}\nfaults:\n'
    with pytest.raises(InputError, match="not in the spec"):
        parse_spec(base + '  - {op: bind, device: "0000:09:00.0"}\n')
    with pytest.raises(InputError, match="out of range"):
        parse_spec(base + '  - {op: bind, count: -1}\n')
    with pytest.raises(InputError, match="takes no errno"):
        parse_spec(base + '  - {op: probe, effect: ignore, errno: EIO}\n')


def test_yaml_alias_bomb_is_refused_fast():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        bomb += f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
    with pytest.raises(InputError, match="aliases"):
        parse_spec(bomb)


def test_deep_nesting_and_empty_specs():
    with pytest.raises(InputError, match="nested too deeply"):
        parse_spec("[" * 100000)
    with pytest.raises(InputError, match="nested too deeply"):
        parse_spec("a:\n" + "".join("  " * i + f"b{i}:\n" for i in range(1, 60)))
    with pytest.raises(InputError, match="the spec is empty"):
        parse_spec("# only a comment\n")


def test_spec_must_be_a_small_regular_file(tmp_path, capsys):
    from vgpuhost.sim.spec import load_spec
    with pytest.raises(InputError, match="not a regular file"):
        load_spec("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="not a regular file"):
        load_spec(tmp_path / "fifo")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20))
    with pytest.raises(InputError, match="limit"):
        load_spec(big)


def test_hostile_spec_writes_nothing_outside_target(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "bind").write_text("precious")
    spec = tmp_path / "evil.yaml"
    spec.write_text(f'version: 1\nname: t\ndevices:\n  - {{bdf: "0000:81:00.0", model: A40, driver: "{victim}"}}\n')
    code = main(["sim", "create", str(spec), str(tmp_path / "root")])
    assert code == 2 and "not a valid name" in capsys.readouterr().err
    assert (victim / "bind").read_text() == "precious" and not (tmp_path / "root").exists()


def _under_a_file(t):
    (t / "afile").write_text("x")
    return t / "afile" / "sub"


def _broken_link(t):
    os.symlink(t / "nowhere", t / "broken")
    return t / "broken"


def _a_file(t):
    (t / "afile2").write_text("x")
    return t / "afile2"


@pytest.mark.parametrize("make_dest", [_under_a_file, _broken_link, _a_file])
def test_sim_create_odd_destinations_are_one_line(tmp_path, capsys, make_dest):
    dest = make_dest(tmp_path)
    assert dest.is_absolute()
    code = main(["sim", "create", "a40-mdev", str(dest)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vgpuhost: error:") and err.count("\n") == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no half-built tree left


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    from vgpuhost.sim import build
    from vgpuhost.sim.spec import load_spec
    from vgpuhost.sim.data import bundled_specs

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(build, "_lay_proc", boom)
    with pytest.raises(Exception, match="No space left"):
        build.materialise(load_spec(bundled_specs()["a40-mdev"]), tmp_path / "root")
    assert list(tmp_path.iterdir()) == []
