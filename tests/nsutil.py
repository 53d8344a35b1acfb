"""Run Debian's ``mdevctl`` against a simulated host root, in a private mount namespace.

mdevctl has no ``--root`` option: it reads the kernel's sysfs at a fixed
place.  To let it read a tree made by :func:`vgpuhost.sim.build.materialise`
we start it under ``unshare -m --propagation private`` and bind-mount
``<root>/sys`` over the sysfs mount point *inside that new namespace only*
(the tree uses relative symlinks, so it resolves there exactly as it does
under the root).  The namespace is private: no mount made in it propagates
back, and it disappears with the process, so the host's sysfs is never
touched.  mdevctl's config directory is shadowed by the root's own
``etc/mdevctl.d`` the same way, so the host's defined devices and callout
scripts stay out of the picture.

Needs root (or CAP_SYS_ADMIN) and util-linux ``unshare``.  Used by
tests/test_mdevctl_parity.py and bench/inventory.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Namespace-private mount targets: these absolute paths are mounted over only
# inside the ``unshare -m --propagation private`` namespace started below,
# never in the caller's namespace.  This is the one place the sysfs mount
# point is spelled.
NS_SYSFS_TARGET = "/sys"
NS_MDEVCTL_CONF_TARGET = "/etc/mdevctl.d"

UNSHARE_ARGS = ("unshare", "--mount", "--propagation", "private")

# sh -c script; $1 = host root; the rest ("$@" after shift) is the command.
# The config shadow is mounted only when the target exists (a bind mount
# needs an existing mount point; without it mdevctl has no defined devices).
_NS_SCRIPT = (
    'root="$1"; shift; '
    f'mount --bind "$root/sys" {NS_SYSFS_TARGET} || exit 125; '
    f'if [ -d {NS_MDEVCTL_CONF_TARGET} ]; then '
    f'mount --bind "$root/etc/mdevctl.d" {NS_MDEVCTL_CONF_TARGET} || exit 125; fi; '
    'exec "$@"'
)


def mdevctl_path() -> Optional[str]:
    """The mdevctl executable (Debian installs it in /usr/sbin), or None."""
    found = shutil.which("mdevctl")
    if found:
        return found
    for d in ("/usr/sbin", "/usr/bin", "/sbin"):
        p = os.path.join(d, "mdevctl")
        if os.access(p, os.X_OK):
            return p
    return None


def unavailable_reason() -> Optional[str]:
    """Why mdevctl cannot be run in a private namespace here, or None when it can.

    Probes once with a trivial bind mount between two scratch directories
    inside a private namespace (nothing outside the scratch directories is
    mounted over).
    """
    if os.geteuid() != 0:
        return f"needs root for a private mount namespace (euid {os.geteuid()})"
    if mdevctl_path() is None:
        return "mdevctl is not installed (Debian: apt-get install mdevctl)"
    if shutil.which("unshare") is None:
        return "util-linux 'unshare' is not installed"
    with tempfile.TemporaryDirectory(prefix="vgpuhost-nsprobe-") as tmp:
        a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        os.mkdir(a)
        os.mkdir(b)
        try:
            proc = subprocess.run([*UNSHARE_ARGS, "sh", "-c", 'mount --bind "$1" "$2"', "sh", a, b],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"'unshare -m' could not be run: {e}"
        if proc.returncode != 0:
            return (f"'unshare -m' + bind mount not permitted here (rc {proc.returncode}): "
                    f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return None


def ns_argv(root: "str | Path", argv: Sequence[str]) -> List[str]:
    """The command line that runs ``argv`` with ``root``'s sysfs mounted in a private namespace."""
    return [*UNSHARE_ARGS, "sh", "-c", _NS_SCRIPT, "sh", str(root), *argv]


def prepare_root(root: "str | Path") -> None:
    """Make sure ``root/etc/mdevctl.d`` exists (the config shadow's source).

    mdevctl 1.2 refuses to run without ``scripts.d/callouts`` (and
    ``notifiers``): empty ones mean no callouts run.
    """
    for sub in ("callouts", "notifiers"):
        Path(root, "etc", "mdevctl.d", "scripts.d", sub).mkdir(parents=True, exist_ok=True)


def run_mdevctl(root: "str | Path", *args: str, timeout: float = 60) -> str:
    """Run ``mdevctl ARGS`` against ``root``; its stdout.  Raises AssertionError on failure."""
    prepare_root(root)
    exe = mdevctl_path()
    assert exe, "mdevctl is not installed"
    argv = ns_argv(root, [exe, *args])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{argv!r} failed ({proc.returncode})\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr\n{proc.stderr}")
    return proc.stdout


def sysfs_mount_lines() -> List[str]:
    """This namespace's mountinfo lines for the sysfs mount point (to prove nothing leaked)."""
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if line.split()[4] == NS_SYSFS_TARGET
                or line.split()[4].startswith(NS_SYSFS_TARGET + "/")]


# --- mdevctl --dumpjson shapes (mdevctl 1.2.0, found empirically) ----------
#
# types:  [{"<parent>": [{"<type id>": {"available_instances": 6, "device_api": "vfio-pci",
#                                       "name": "NVIDIA A40-8Q", "description": "num_heads=4, ..."}},
#                        ...]}, ...]
# list:   [{"<parent>": [{"<uuid>": {"mdev_type": "nvidia-566", "start": "manual", "attrs": []}},
#                        ...]}, ...]
# Both print "[]" when there is nothing (list) or no parent (types).

def _pairs(doc: object, what: str) -> List[Tuple[str, str, dict]]:
    """Flatten ``[{outer: [{inner: {...}}]}]`` into ``(outer, inner, value)``."""
    assert isinstance(doc, list), f"mdevctl {what} --dumpjson: expected a list, found {type(doc).__name__}"
    out = []
    for item in doc:
        assert isinstance(item, dict), f"mdevctl {what}: expected objects in the list, found {item!r}"
        for outer, inners in item.items():
            assert isinstance(inners, list), f"mdevctl {what}: {outer}: expected a list, found {inners!r}"
            for inner in inners:
                assert isinstance(inner, dict), f"mdevctl {what}: {outer}: expected objects, found {inner!r}"
                for key, value in inner.items():
                    out.append((outer, key, value))
    return out


def split_description(text: Optional[str]) -> Optional[Dict[str, str]]:
    """``"num_heads=4, frl_config=60"`` -> ``{"num_heads": "4", "frl_config": "60"}`` (independent of vgpuhost)."""
    if text is None:
        return None
    out: Dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_types(text: str) -> Dict[str, Dict[str, dict]]:
    """``mdevctl types --dumpjson`` -> ``{parent: {type_id: {available_instances, name, description, device_api}}}``."""
    out: Dict[str, Dict[str, dict]] = {}
    for parent, tid, v in _pairs(json.loads(text), "types"):
        types = out.setdefault(parent, {})
        assert tid not in types, f"mdevctl types lists {parent} {tid} twice"
        types[tid] = {"available_instances": v.get("available_instances"), "name": v.get("name"),
                      "description": split_description(v.get("description")),
                      "device_api": v.get("device_api")}
    return out


def parse_list(text: str) -> Dict[str, Tuple[str, str]]:
    """``mdevctl list --dumpjson`` -> ``{uuid: (parent, type_id)}``."""
    out: Dict[str, Tuple[str, str]] = {}
    for parent, uuid, v in _pairs(json.loads(text), "list"):
        assert uuid not in out, f"mdevctl list shows {uuid} twice"
        out[uuid] = (parent, v.get("mdev_type"))
    return out


def skip_or_fail(reason: Optional[str], what: str) -> None:
    """Skip a namespace test with ``reason``; under CI (``CI`` true) fail instead, so CI cannot
    silently skip it.  No-op when ``reason`` is None."""
    if reason is None:
        return
    import pytest
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run {what}, but: {reason}", pytrace=False)
    pytest.skip(reason)
