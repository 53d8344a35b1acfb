"""`apply` prints one progress line per step on stderr with -v (or on a terminal), and none otherwise."""

from __future__ import annotations

import re
from pathlib import Path

from vgpuhost.cli.main import main

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "config" / "vgpu-a40.yaml"


def test_apply_progress_lines(make_host, capsys):
    quiet, loud = make_host("a40-mdev"), make_host("a40-mdev")
    assert main(["--root", str(quiet.root), "apply", "-c", str(CONFIG)]) == 0
    out, err = capsys.readouterr()
    assert "[1/" not in err and "applied 2 steps" in out
    assert main(["--root", str(loud.root), "-v", "apply", "-c", str(CONFIG)]) == 0
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.startswith("vgpuhost: [")]
    assert [re.sub(r"^(vgpuhost: \[\d+/\d+\] \S+ \S+): .*", r"\1", l) for l in lines] == ["vgpuhost: [1/2] scheduler 0000:81:00.0"] * 2 + \
        ["vgpuhost: [2/2] vgpu 0000:81:00.0"] * 2
    assert lines[0].endswith(" ...") and lines[1].endswith(": done") and lines[3].endswith(": done")
    assert "create 6 x A40-8Q ..." in lines[2]
    # the result is the same either way: stdout unchanged by -v
    assert "applied 2 steps" in out
