"""``make demo``: vgpuhost's main job on the bundled simulated hosts.

Builds simulated hosts under ``./demo-host/`` (or the directory given as
the first argument) and runs the commands an operator would, printing each
command line first.  Nothing outside that directory is touched.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .cli import main as vgpuhost

STEPS = [
    ("a40-mdev", [["host", "check"], ["gpus"], ["types", "--available"],
                  ["vgpu", "create", "--profile", "A40-8Q", "--params", "frame_rate_limiter=0"],
                  ["vgpu", "create", "--profile", "A40-4C"],          # refused: equal-size mode
                  ["vgpu", "list"], ["types", "--available"]]),
    ("l40s-vendor-vfio", [["gpus"],
                          ["vgpu", "create", "--profile", "l40s-8q", "--numa-node", "1", "--strategy", "best-fit"],
                          ["vgpu", "list"]]),
    ("turing-consumer", [["host", "check"], ["passthrough", "prepare", "0000:01:00.0"]]),
    ("sata-shared-group", [["host", "check"], ["passthrough", "prepare", "0000:03:00.0"]]),
    ("iommu-off", [["host", "check"]]),
    ("a100-sriov-mdev", [["passthrough", "prepare", "--dry-run", "0000:41:00.0"],
                         ["passthrough", "prepare", "0000:41:00.0"], ["gpus"],
                         ["passthrough", "release", "0000:41:00.0"], ["audit"]]),
]


def run(argv) -> int:
    print(f"\n$ vgpuhost {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    code = vgpuhost(argv)
    print(f"[exit {code}]", flush=True)
    return code


def main(args=None) -> int:
    args = sys.argv[1:] if args is None else args
    base = Path(args[0] if args else "demo-host").absolute()
    print(f"vgpuhost demo: simulated hosts under {base}")
    for spec, commands in STEPS:
        root = base / spec
        if run(["sim", "create", "--force", spec, str(root)]) != 0:
            return 2
        for cmd in commands:
            run(["--root", str(root)] + cmd)
    print("\nDone. Try your own: vgpuhost --root", base / "a40-mdev", "--json types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
