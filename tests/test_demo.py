"""``make demo`` part 2 (the tour): what docs/guide/quickstart.md says it shows."""

from __future__ import annotations

from vgpuhost import demo


def test_the_tour_shows_a_refused_then_a_successful_passthrough(tmp_path, capsys):
    done = demo.tour(tmp_path)
    out = capsys.readouterr().out
    assert done is not None, out
    codes = {(spec, " ".join(argv)): code for spec, argv, code in done}
    a100 = "0000:41:00.0"
    # with its SR-IOV VFs enabled the A100 is refused, naming the documented way to disable them
    assert codes[("a100-sriov-mdev", f"passthrough prepare --dry-run {a100}")] == 2
    assert "sriov-manage -d" in out
    # with its VFs off: a dry run, prepare and release, each exit 0 (docs/guide/quickstart.md)
    for argv in (f"passthrough prepare --dry-run {a100}", f"passthrough prepare {a100}",
                 f"passthrough release {a100}"):
        assert codes[(demo.VFS_OFF, argv)] == 0, argv
    assert "0000:41:00.0: nvidia -> vfio-pci" in out and "0000:41:00.0: vfio-pci -> nvidia" in out
    # vGPU creation on both vGPU paths works
    assert codes[("a40-mdev", "vgpu create --profile A40-8Q --params frame_rate_limiter=0")] == 0
    assert codes[("l40s-vendor-vfio", "vgpu create --profile l40s-8q --numa-node 1 --strategy best-fit")] == 0
