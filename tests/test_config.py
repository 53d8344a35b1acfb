"""The declarative config file: strict validation with FILE:LINE errors, board checks, the examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vgpuhost.cli.main import main
from vgpuhost.policy.config import load, parse
from vgpuhost.model.errors import InputError
from vgpuhost.ops.layout import plan
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.io.state import StateStore
from vgpuhost.model.values import PciAddress

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "config"
BAD = Path(__file__).parent / "data" / "config"

# (file, line, words the one error must hold): one file per malformed case
MALFORMED = [
    ("unknown-key.yaml", 8, "unknown key 'vgpus' in layouts.lab.gpus[0]; did you mean 'vgpu'?"),
    ("unknown-key-nested.yaml", 10, "unknown key 'mixedsize' in vgpu; did you mean 'mixed_size'?"),
    ("wrong-type-count.yaml", 10, "vgpu.types.A40-8Q must be a whole number, found a string 'two'"),
    ("wrong-type-address.yaml", 7, "select.address must be a quoted PCI address"),
    ("bad-version.yaml", 2, "unsupported config version 2"),
    ("profile-not-on-board.yaml", 10, "vGPU type A40-8Q does not exist on board L40S; near matches: L40S-8Q"),
    ("mig-profile-not-on-board.yaml", 11,
     "GPU-instance profile 2g.20gb does not exist on device id 0x2335 (H200-SXM-141GB); near matches: 2g.35gb"),
    ("mig-does-not-fit.yaml", 11,
     "MIG layout cannot fit board H200: 2x3g.71gb + 1x4g.71gb needs 12 of 8 memory slices"),
    ("duplicate-gpu.yaml", 9, "address 0000:41:00.0 is already selected by the entry at line 6"),
    ("all-and-other.yaml", 8, "'all' leaves none for the other"),
    ("mig-vgpu-without-instance.yaml", 12, "1 x A100-3-20C needs 1 3g.20gb GPU instance, mig.instances has 0"),
    ("too-many-vgpus.yaml", 9, "7 x A40-8Q exceed the 6 a GPU holds in equal-size mode"),
    ("scheduler-out-of-range.yaml", 11, "timeslice 50 ms out of range 1..30"),
    ("mode-block-mismatch.yaml", 9, "a 'mig' block in an entry with mode: vgpu"),
    ("yaml-alias.yaml", 6, "YAML aliases (*name) are not allowed"),
    ("duplicate-type.yaml", 11, "duplicate type: vgpu.types names a40-8q twice (as A40-8Q), first at line 10"),
    ("wrong-type-version.yaml", 2, "version must be a whole number, found a string '1'"),
]


@pytest.mark.parametrize("name,line,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_each_malformed_file_gives_one_precise_error(name, line, words, capsys):
    path = BAD / name
    with pytest.raises(InputError) as ei:
        load(path)
    assert ei.value.message.startswith(f"{path}:{line}: "), ei.value.message
    assert words in ei.value.one_line()
    # the CLI: one line on stderr, exit 2, nothing on stdout
    code = main(["config", "check", "-c", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"vgpuhost: error: {path}:{line}: ")


def test_every_malformed_file_is_tested():
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(m[0] for m in MALFORMED)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_every_example_validates(path, capsys):
    cfg = load(path)
    assert cfg.layouts and cfg.default in cfg.layouts
    assert main(["--json", "config", "check", "-c", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "vgpuhost.config-check/v1" and doc["valid"]
    assert [x["name"] for x in doc["layouts"]] == list(cfg.layouts)


def test_examples_exist():
    assert {p.name for p in EXAMPLE_FILES} >= {"vgpu-a40.yaml", "vgpu-a100.yaml", "mig-h200.yaml",
                                               "passthrough.yaml", "mixed-fleet.yaml"}


# (example, simulated host): each layout plans there without a config error
PAIRS = [("vgpu-a40.yaml", "a40-mdev"), ("vgpu-a100.yaml", "a100-sriov-mdev"), ("mig-h200.yaml", "h200-mig"),
         ("passthrough.yaml", "turing-consumer")] + [
    ("mixed-fleet.yaml", h) for h in ("a40-mdev", "a100-sriov-mdev", "l40s-vendor-vfio", "h200-mig",
                                      "turing-consumer")]


@pytest.mark.parametrize("name,spec", PAIRS, ids=[f"{a}@{b}" for a, b in PAIRS])
def test_examples_plan_on_their_simulated_hosts(name, spec, make_host):
    host = make_host(spec)
    cfg = load(EXAMPLES / name)
    store = StateStore(host.state_dir, create=False)
    for layout in cfg.layouts:
        p = plan(host, store, cfg, layout)
        assert p.layout == layout
        # a blocked plan names an operator step, a blocker the host really has: never a config problem
        for b in p.blocked:
            assert "sriov-manage" in b or "nvidia-persistenced" in b or "nvidia_drm" in b, b
    assert not host.state_dir.joinpath("state.db").exists()       # planning wrote nothing


# ---------------------------------------------------------------------------
# the format

def cfg_text(body: str, head: str = "version: 1\n") -> str:
    return head + body


def test_single_layout_is_the_default_and_several_need_one():
    one = parse(cfg_text("layouts:\n  a:\n    gpus: [{select: all, mode: passthrough}]\n"), "one.yaml")
    assert one.default == "a" and one.layout().name == "a"
    two = parse(cfg_text("layouts:\n  a:\n    gpus: [{select: all, mode: passthrough}]\n"
                         "  b:\n    gpus: [{select: all, mode: passthrough}]\n"), "two.yaml")
    assert two.default is None
    with pytest.raises(InputError, match=r"^two.yaml: 2 layouts \(a, b\) and no default"):
        two.layout()
    with pytest.raises(InputError, match="no layout 'c'"):
        two.layout("c")
    assert two.layout("b").name == "b"
    with pytest.raises(InputError, match=r"^d.yaml:2: default names no layout: 'x'"):
        parse(cfg_text("default: x\nlayouts:\n  a:\n    gpus: [{select: all, mode: passthrough}]\n"), "d.yaml")


def test_selectors_and_settings_parse_to_values():
    cfg = parse(cfg_text("""
host:
  kernel_params: [intel_iommu=on, iommu=pt]
  vfio_modules: [vfio-pci]
layouts:
  a:
    scheduler: {policy: equal-share, frequency_hz: 960, avg_factor: 60}
    gpus:
      - select: {device_id: "10de:2235"}
        mode: vgpu
        vgpu: {types: {A40-8Q: 2}}
      - select: {address: ["0000:41:00.0", "0000:42:00.0"]}
        mode: vgpu
        vgpu: {types: {A100-4C: 1}}
        scheduler: {policy: fixed-share, timeslice_ms: 4, persist: true}
      - select: {uuid: GPU-0A1B2C3D-0000-1111-2222-333344445555}
        mode: mig
        mig: {instances: {7G.40GB: 1}}
"""), "s.yaml")
    e1, e2, e3 = cfg.layout().entries
    assert e1.select.kind == "device_id" and e1.select.values == (0x2235,)
    assert e1.scheduler.state == SchedulerState("equal-share", arr=True, frequency_hz=960, avg_factor=60)
    assert e2.select.values == (PciAddress.parse("0000:41:00.0"), PciAddress.parse("0000:42:00.0"))
    assert e2.scheduler.state == SchedulerState("fixed-share", arr=False, timeslice_ms=4) and e2.scheduler.persist
    assert e3.select.values == ("gpu-0a1b2c3d-0000-1111-2222-333344445555",)
    assert e3.mig.instances[0].name == "7g.40gb"
    assert cfg.host.vfio_modules[0][0] == "vfio_pci" and cfg.host.kernel_params[1][0] == "iommu=pt"
    assert e2.where.line == 13 and e2.scheduler.where.line == 16     # (the text starts with a blank line 2)


@pytest.mark.parametrize("body,line,words", [
    ("  - select: {uuid: GPU-0a1b2c3d-0000-1111-2222-333344445555}\n    mode: passthrough\n", 5,
     "select a passed-through GPU by address, board or device_id, not uuid"),
    ("  - select: {board: A40}\n    mode: vgpu\n    vgpu: {types: {A40-8Q: 1}, strategy: spread}\n", 7,
     "vgpu.strategy applies only with counts: total"),
    ("  - select: {board: A40}\n    mode: vgpu\n    vgpu: {types: {A40-8Q: 1, A40-4Q: 1}}\n", 7,
     "vgpu.types holds 2 framebuffer sizes (4 GB, 8 GB)"),
    ("  - select: {board: A40}\n    mode: vgpu\n    vgpu: {types: {A40-8Q: 1}, mixed_size: true}\n"
     "    scheduler: {policy: fixed-share}\n", 8, "fixed share is not available in mixed-size mode"),
    ("  - select: {board: A100}\n    mode: vgpu\n    vgpu: {types: {A100-1-5C: 1}}\n", 7,
     "A100-1-5C is a MIG-backed vGPU type: it belongs in mode: mig"),
    ("  - select: {board: A100}\n    mode: mig\n    mig: {instances: {1g.5gb: 1}}\n"
     "    scheduler: {policy: equal-share}\n",
     8, "no vGPU scheduler before Blackwell (Software Scheduler is not supported in MIG mode"),
    ("  - select: {address: \"41:00.0\"}\n    mode: passthrough\n", 5, "did you mean 0000:41:00.0?"),
    ("  - select: {board: A40, address: \"0000:41:00.0\"}\n    mode: passthrough\n", 5,
     "select needs exactly one of address, uuid, board, device_id"),
    ("  - select: {board: A40}\n    mode: vpgu\n", 6, "unknown mode 'vpgu'; did you mean 'vgpu'?"),
    ("  - select: {all: true}\n    mode: passthrough\n", 5, "write select: all"),
    ("  - select: {board: A40}\n    mode: vgpu\n", 5, "has mode: vgpu but no 'vgpu' block"),
    ("  - select: {board: A40}\n    mode: vgpu\n    vgpu: {types: {A40-8Q: 1, L40S-8Q: 1}}\n", 7,
     "vgpu.types mixes boards (A40, L40S)"),
    ("  - select: {board: A40}\n    mode: vgpu\n    vgpu: {types: {A40-8Q: 1}}\n"
     "  - select: {device_id: [0x2235]}\n    mode: passthrough\n"
     "  - select: {device_id: 0x2235}\n    mode: passthrough\n",
     10, "device_id 0x2235 is already selected by the entry at line 8"),
])
def test_more_precise_errors(body, line, words):
    text = cfg_text("layouts:\n lab:\n  gpus:\n" + body)
    with pytest.raises(InputError) as ei:
        parse(text, "x.yaml")
    assert ei.value.message.startswith(f"x.yaml:{line}: "), ei.value.message
    assert words in ei.value.one_line()


def test_an_ambiguous_board_is_checked_on_the_host_not_at_load(make_host):
    # 'A100' names 40 GB and 80 GB boards, whose MIG tables differ: load accepts 3g.40gb (an 80 GB name) ...
    text = cfg_text("layouts:\n  m:\n    gpus:\n      - select: {board: A100}\n        mode: mig\n"
                    "        mig: {instances: {3g.40gb: 1}}\n")
    cfg = parse(text, "amb.yaml")
    # ... and the plan on an A100-40GB refuses it at the same line, naming what the device offers
    host = make_host("a100-sriov-mdev")
    with pytest.raises(InputError) as ei:
        plan(host, StateStore(host.state_dir, create=False), cfg)
    assert ei.value.message.startswith("amb.yaml:7: GPU-instance profile 3g.40gb does not exist on 0000:41:00.0")
    assert "near matches: " in ei.value.one_line() and "profiles there: 1g.5gb" in ei.value.one_line()


def test_lint_and_plan_agree_on_counts(make_host):
    by_board = "      - select: {board: A40}\n"
    by_address = "      - select: {address: \"0000:81:00.0\"}\n"
    body = "        mode: vgpu\n        vgpu: {types: {A40-8Q: 7}}\n"
    with pytest.raises(InputError) as lint:
        parse(cfg_text("layouts:\n  l:\n    gpus:\n" + by_board + body), "c.yaml")
    cfg = parse(cfg_text("layouts:\n  l:\n    gpus:\n" + by_address + body), "c.yaml")
    host = make_host("a40-mdev")
    with pytest.raises(InputError) as planned:
        plan(host, StateStore(host.state_dir, create=False), cfg)
    for e in (lint.value, planned.value):
        assert e.message.startswith("c.yaml:7: 7 x A40-8Q exceed the 6 a GPU holds in equal-size mode")


def test_a_plan_time_type_error_names_the_line_and_near_matches(make_host):
    cfg = parse(cfg_text("layouts:\n  l:\n    gpus:\n      - select: all\n        mode: vgpu\n"
                         "        vgpu:\n          types: {L40S-4Q: 1}\n"), "t.yaml")
    host = make_host("a40-mdev")
    with pytest.raises(InputError) as ei:
        plan(host, StateStore(host.state_dir, create=False), cfg)
    assert ei.value.message.startswith("t.yaml:8: vGPU type L40S-4Q does not exist on 0000:81:00.0 (A40)")
    assert "near matches: A40-4Q" in ei.value.one_line()


def test_limits_and_non_files(tmp_path):
    with pytest.raises(InputError, match="is not a regular file"):
        load(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_text("version: 1\n" + "#" * (1 << 20))
    with pytest.raises(InputError, match="over the"):
        load(big)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(InputError, match="empty"):
        load(empty)


# ---------------------------------------------------------------------------
# review 1 regressions

def test_messages_name_a_key_by_its_path():
    # review 1, item 16: "the config file.version must be a whole number"
    for text, line, words in [
        ("version: !!python/object {}\nlayouts: {}\n", 1, "version must be a whole number, found a mapping {}"),
        ("version: 1\nlayouts:\n  a:\n    description: 3\n    gpus: []\n", 4,
         "layouts.a.description must be a string, found a number 3"),
        ("version: 1\nlayouts:\n  a:\n    gpus: {}\n", 4, "layouts.a.gpus must be a list, found a mapping {}"),
        ("version: 1\ndefault: 1\nlayouts:\n  a:\n    gpus: []\n", 2, "default must be a string"),
    ]:
        with pytest.raises(InputError) as ei:
            parse(text, "m.yaml")
        assert ei.value.message.startswith(f"m.yaml:{line}: {words}"), ei.value.message
        assert "the config file." not in ei.value.message


@pytest.mark.parametrize("block,line,words", [
    ("mig: {instances: {1g.5gb: 2, 1G.5GB: 1}}", 7, "duplicate profile: mig.instances names 1G.5GB twice (as 1g.5gb)"),
    ("mig: {instances: {1g.5gb: 2}, vgpus: {A100-1-5C: 1, a100-1-5c: 1}}", 7,
     "duplicate type: mig.vgpus names a100-1-5c twice (as A100-1-5C)"),
])
def test_duplicate_names_in_mig_blocks(block, line, words):
    text = cfg_text(f"layouts:\n lab:\n  gpus:\n  - select: {{board: A100}}\n    mode: mig\n    {block}\n")
    with pytest.raises(InputError) as ei:
        parse(text, "x.yaml")
    assert ei.value.message.startswith(f"x.yaml:{line}: {words}"), ei.value.message


def test_a_layout_may_hold_nothing(capsys, tmp_path):
    # review 1, item 20: gpus: [] is "this layout holds nothing"; a bare "gpus:" is still an error
    cfg = parse(cfg_text("layouts:\n  idle:\n    gpus: []\n"), "e.yaml")
    assert cfg.layout().entries == ()
    with pytest.raises(InputError) as ei:
        parse(cfg_text("layouts:\n  idle:\n    gpus:\n"), "e.yaml")
    assert ei.value.message.startswith("e.yaml:4: layouts.idle.gpus is empty") and "gpus: []" in ei.value.one_line()
    path = tmp_path / "e.yaml"
    path.write_text(cfg_text("layouts:\n  idle:\n    gpus: []\n"))
    assert main(["--json", "config", "check", "-c", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layouts"] == [{"name": "idle", "entries": 0, "modes": []}]
