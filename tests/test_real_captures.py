"""vgpuhost's parsers and catalog agree with output published from real NVIDIA hosts (tests/data/real/).

Each fixture names its source and driver in its header (tests/data/real/README.md).  Checked: every
type name parses with the right board, series and size; every GPU-instance profile name parses,
and the name vgpuhost builds when the driver gives none (the v1 profile-info struct) is NVIDIA's,
from the real memory figures; the catalog's L40S and H200 ids and GI table match.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vgpuhost.io.catalog import load_catalog
from vgpuhost.io.nvml_pynvml import profile_name
from vgpuhost.io.vgpudev import parse_creatable_vgpu_types
from vgpuhost.model.values import MigProfile, VgpuProfile, mig_memory_gb, parse_description, parse_size_mib

REAL = Path(__file__).parent / "data" / "real"
MIG_FILES = sorted(p.name for p in REAL.glob("mig-lgip-*.txt"))
#: the pynvml profile index name whose tail gives each suffix (io/nvml_pynvml._PROFILE_SUFFIX)
INDEX_OF = {"": "NVML_GPU_INSTANCE_PROFILE_{g}_SLICE", "+me": "NVML_GPU_INSTANCE_PROFILE_{g}_SLICE_REV1",
            "-me": "NVML_GPU_INSTANCE_PROFILE_{g}_SLICE_NO_ME", "+me.all": "NVML_GPU_INSTANCE_PROFILE_{g}_SLICE_ALL_ME",
            "+gfx": "NVML_GPU_INSTANCE_PROFILE_{g}_SLICE_GFX"}


def body(name: str) -> str:
    """The fixture without its ``#`` header."""
    return "".join(line for line in (REAL / name).read_text().splitlines(keepends=True) if not line.startswith("#"))


def lgip(name: str):
    """``(device memory MiB or None, [(profile name, id or None, total count or None, memory MiB)])``."""
    total, rows = None, []
    for line in body(name).splitlines():
        f = line.split()
        if f[0] == "device_memory_mib":
            total = int(f[1])
            continue
        pid = None if f[1] == "-" else int(f[1])
        count = None if f[2] == "-" else int(f[2].split("/")[1])
        rows.append((f[0], pid, count, round(float(f[3]) * 1024)))
    return total, rows


def test_every_capture_has_a_source_and_rows():
    files = sorted(p.name for p in REAL.glob("*.txt"))
    assert len(files) >= 9 and all(f in (REAL / "README.md").read_text() for f in files)
    for f in files:
        header = "".join(line for line in (REAL / f).read_text().splitlines() if line.startswith("#"))
        assert "https://" in header or "RFC" in header, f
        assert "driver" in header, f
        assert body(f).strip(), f


# --- GPU-instance profiles --------------------------------------------------------------------

@pytest.mark.parametrize("fixture", MIG_FILES)
def test_gpu_instance_profile_names_parse(fixture):
    _total, rows = lgip(fixture)
    for name, _pid, _count, memory_mib in rows:
        p = MigProfile.parse(name)
        assert str(p) == name
        assert memory_mib <= p.memory_gb * 1024, name      # a GPU instance has at most what its name says


@pytest.mark.parametrize("fixture", [f for f in MIG_FILES if lgip(f)[0]])
def test_names_built_from_memory_are_nvidias(fixture):
    """NVIDIA names a profile by the board's memory x the share (go-nvlib getMigMemorySizeGB)."""
    total, rows = lgip(fixture)
    for name, _pid, _count, memory_mib in rows:
        p = MigProfile.parse(name)
        assert mig_memory_gb(memory_mib, total) == p.memory_gb, name
        index = INDEX_OF[p.suffix].format(g=p.slices)
        assert profile_name(index, p.slices, memory_mib, None, total) == name


def test_the_old_rounding_got_the_h200_wrong():
    """What vgpuhost built before: ceil(MiB / 1024) gives 1g.16gb, 1g.33gb, 3g.70gb (mig-parted #120)."""
    _total, rows = lgip("mig-lgip-h200.txt")
    mem = {name: m for name, _p, _c, m in rows}
    assert [math.ceil(mem[n] / 1024) for n in ("1g.18gb", "1g.35gb", "3g.71gb")] == [16, 33, 70]
    assert profile_name("NVML_GPU_INSTANCE_PROFILE_1_SLICE", 1, mem["1g.18gb"], None, 143771) == "1g.18gb"


def test_catalog_h200_table_is_the_real_one():
    _total, rows = lgip("mig-lgip-h200.txt")
    table = {p.name: p for p in load_catalog().gpus["H200-SXM-141GB"].mig_profiles}
    assert {r[0] for r in rows} == set(table)
    for name, pid, count, memory_mib in rows:
        p = table[name]
        assert (p.profile_id, p.max_count, p.memory_mib) == (pid, count, memory_mib), name


# --- vGPU type names ------------------------------------------------------------------------

def test_l40s_creatable_types_parse_and_match_the_catalog():
    listed = parse_creatable_vgpu_types(body("creatable-l40s.txt"))
    assert len(listed) == 23
    ids = sorted(int(t) for t, _ in listed)
    assert ids == list(range(1145, 1167)) + [2164]
    for tid, name in listed:
        p = VgpuProfile.parse(name)
        assert p.board == "L40S" and p.series in "QBA" and not p.mig_backed
        assert str(p) == name.removeprefix("NVIDIA ")
    assert VgpuProfile.parse(dict(listed)["2164"]) == VgpuProfile("L40S", 3, "B")
    catalog = {str(t.type_id): t.name for t in load_catalog().gpus["L40S"].vgpu_types}
    for tid, name in listed:
        assert catalog.get(tid) == name.removeprefix("NVIDIA "), tid


def test_rtx6000_ada_creatable_types_parse():
    listed = parse_creatable_vgpu_types(body("creatable-rtx6000-ada.txt"))
    assert [int(t) for t, _ in listed] == list(range(941, 951))
    parsed = [VgpuProfile.parse(n) for _, n in listed]
    assert {(p.board, p.series, p.mig_backed) for p in parsed} == {("RTX6000-Ada", "Q", False)}
    assert [p.framebuffer_gb for p in parsed] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


def test_v100_mdev_type_parses():
    [line] = body("mdev-types-v100.txt").splitlines()
    type_id, name, description = (f.strip() for f in line.split("|"))
    p = VgpuProfile.parse(name)
    assert (type_id, p.board, p.framebuffer_gb, p.series) == ("nvidia-300", "V100", 8, "C")
    d = parse_description(description)
    assert parse_size_mib(d["framebuffer"]) == 8192 == p.framebuffer_gb * 1024 and d["max_instance"] == "2"


def test_catalog_h200x_141c_id():
    """issue 25 #11: H200X-141C is type 1428."""
    ids = {t.name: t.type_id for t in load_catalog().gpus["H200-SXM-141GB"].vgpu_types}
    assert ids["H200X-141C"] == 1428
