"""vGPU type names as NVIDIA's drivers spell them parse (issue 25 item 5), and junk is refused in one line.

The grammar is NVIDIA/vgpu-device-manager's (``pkg/types/vgpu_type.go``): a board of
``[A-Z0-9]+(-[a-zA-Z]+)*``, any series for MIG-backed types, suffixes ``ME``, ``NOME``, ``MEALL``
and ``GFX``; widened to boards with spaces (``RTX Pro 6000 Blackwell DC-3Q``).
docs/reference/hardware.md#vgpu-types.
"""

from __future__ import annotations

import pytest

from vgpuhost.libvirt.domxml import Metadata, VgpuRequest, parse_domain
from vgpuhost.model.errors import InputError
from vgpuhost.model.values import MigProfile, PciAddress, VgpuProfile


@pytest.mark.parametrize("name, board, gb, series, slices, me, attr", [
    ("NVIDIA RTX6000-Ada-1Q", "RTX6000-Ada", 1, "Q", None, False, ""),
    ("RTX5000-Ada-32C", "RTX5000-Ada", 32, "C", None, False, ""),
    ("DC-1-24Q", "DC", 24, "Q", 1, False, ""),
    ("DC-1-24CGFX", "DC", 24, "C", 1, False, "GFX"),
    ("NVIDIA RTX Pro 6000 Blackwell DC-3Q", "RTX Pro 6000 Blackwell DC", 3, "Q", None, False, ""),
    ("A100-1-5CNOME", "A100", 5, "C", 1, False, "NOME"),
    ("A100-1-5CMEALL", "A100", 5, "C", 1, False, "MEALL"),
    ("A100-1-5CME", "A100", 5, "C", 1, True, ""),
    ("A100D-80C", "A100D", 80, "C", None, False, ""),
    ("M60-0Q", "M60", 0, "Q", None, False, ""),
    ("DC-4-96Q", "DC", 96, "Q", 4, False, ""),
])
def test_real_type_names_parse(name, board, gb, series, slices, me, attr):
    p = VgpuProfile.parse(name)
    assert (p.board, p.framebuffer_gb, p.series, p.gi_slices, p.media_extensions, p.attribute) == (
        board, gb, series, slices, me, attr)
    assert VgpuProfile.parse(str(p)) == p
    assert str(p) == name.removeprefix("NVIDIA ")


def test_suffixes_are_distinct_types_and_name_their_gpu_instance():
    names = ["A100-1-5C", "A100-1-5CME", "A100-1-5CNOME", "A100-1-5CMEALL", "A100-1-5CGFX"]
    parsed = [VgpuProfile.parse(n) for n in names]
    assert len(set(parsed)) == 5           # never one for another (A100-1-5CME is not A100-1-5C)
    assert [p.gi_suffix for p in parsed] == ["", "+me", "-me", "+me.all", "+gfx"]


@pytest.mark.parametrize("bad", [
    "A40-8QME",            # a suffix without GPU-instance slices
    "RTX6000-Ada-1-8C",    # a MIG-backed board has no -<letters> part
    "A40-08Q", "A40-8X", "A40", "-8Q", "A40--8Q", "A 40 -8Q", "A40-1-2-8C", "A40-8Q\n<x>",
])
def test_junk_is_refused_in_one_line(bad):
    with pytest.raises(InputError) as e:
        VgpuProfile.parse(bad)
    assert "\n" not in str(e.value)


def test_a_long_bad_name_is_cut_in_the_message():
    with pytest.raises(InputError) as e:
        VgpuProfile.parse("X" * 500)
    assert len(str(e.value)) < 200


def test_domain_metadata_names_such_profiles():
    """docs/reference/metadata.md: ``profile=`` takes every vGPU type name the driver reports (the hook
    reads it with the same grammar)."""
    names = ["RTX6000-Ada-2Q", "DC-1-24CGFX", "RTX Pro 6000 Blackwell DC-3Q"]
    m = Metadata(vgpus=[VgpuRequest(n, vf=PciAddress.parse(f"0000:c1:00.{i + 5}")) for i, n in enumerate(names)])
    doc = (f"<domain type='kvm'><name>vm1</name><uuid>6695eb01-f6a4-8304-79aa-97f2502e193f</uuid>"
           f"<metadata>{m.to_xml()}</metadata><devices/></domain>")
    got = parse_domain(doc).metadata
    assert got == m and [str(v.profile) for v in got.vgpus] == names


@pytest.mark.parametrize("name, slices, gb, suffix", [
    ("1g.24gb-me", 1, 24, "-me"), ("2g.48gb+gfx", 2, 48, "+gfx"), ("2g.48gb+me.all", 2, 48, "+me.all"),
    ("1g.18gb+me", 1, 18, "+me"), ("7g.141gb", 7, 141, ""),
])
def test_blackwell_gpu_instance_names_parse(name, slices, gb, suffix):
    """Names from ``nvidia-smi mig -lgip`` on an RTX PRO 6000 Blackwell (bigstack-oss/cubecos issue 312)."""
    p = MigProfile.parse(name)
    assert (p.slices, p.memory_gb, p.suffix, str(p)) == (slices, gb, suffix, name)
