"""The built wheel carries the package data and a working console script.

Builds a wheel of the checkout, installs it (without dependencies) into a
fresh venv and checks, from outside the repository, that the installed
package -- not the checkout or the editable install -- has its templates,
simulator catalog and hosts and ``vgpuhost`` command.

The runtime dependencies (libvirt-python is compiled from source, so slow to
reinstall) are borrowed from the interpreter running the tests: a ``.pth``
file in the fresh venv appends the directories that hold them.  A ``.pth``
line only appends a path; it does not process that directory's own ``.pth``
files, so the editable finder of the dev venv is never installed, and the
fresh venv's site-packages precedes anything a ``.pth`` appends.
"""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

# Top-level import names of the runtime dependencies (install_requires).
RUNTIME_MODULES = ["click", "jinja2", "markupsafe", "yaml", "lxml", "pynvml",
                   "libvirt"]


def _dependency_dirs():
    """The sys.path entries that hold the runtime dependencies."""
    dirs = []
    for name in RUNTIME_MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not installed"
        origin = Path(spec.origin)
        top = origin.parent.parent if spec.submodule_search_locations else origin.parent
        if str(top) not in dirs:
            dirs.append(str(top))
    assert str(REPO) not in dirs
    return dirs


def _clean_env():
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV",
                "PYTHONNOUSERSITE", "PYTHONSAFEPATH"):
        env.pop(var, None)
    return env


def _run(args, cwd, env=None):
    proc = subprocess.run(args, cwd=cwd, env=env or _clean_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"{args!r} failed ({proc.returncode})\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc.stdout


CHECK = r"""
import importlib.resources, json, sys
from pathlib import Path
import vgpuhost
root = importlib.resources.files("vgpuhost")
print(json.dumps({
    "file": vgpuhost.__file__,
    "catalog": (root / "data" / "catalog.yaml").is_file(),
    "hosts": sorted(p.name for p in Path(str(root / "sim" / "hosts")).glob("*.yaml")),
    "templates": sorted(p.name for p in Path(str(root / "data" / "templates")).glob("*.j2")),
    "rendered": __import__("vgpuhost.libvirt.templating", fromlist=["render"]).render(
        "hostdev-mdev.xml.j2", uuid="2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a", display=False, ramfb=False),
    "path": sys.path,
}))
"""


def test_wheel_installs_package_data_and_console_script(tmp_path):
    import json

    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
          "--outdir", str(dist), str(REPO)], cwd=REPO)
    wheels = list(dist.glob("vgpuhost-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert not any(n.startswith(("tests/", "bench/", "ansible/")) for n in names), names
    for shipped in ("vgpuhost/hook/qemu.sh", "vgpuhost/data/units/vgpuhost-layout.service",
                    "vgpuhost/data/units/vgpuhost-reconcile.service"):
        assert shipped in names, f"{shipped} missing from the wheel"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    vpy = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install",
          "--no-deps", "--no-index", "--no-cache-dir",
          "--disable-pip-version-check", str(wheel)], cwd=tmp_path)

    site = Path(_run([str(vpy), "-I", "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).strip())
    assert site.is_relative_to(venv), site
    (site / "_vgpuhost_test_deps.pth").write_text(
        "".join(d + "\n" for d in _dependency_dirs()))

    info = json.loads(_run([str(vpy), "-I", "-c", CHECK], cwd=tmp_path))
    pkg = Path(info["file"]).resolve()
    assert pkg.is_relative_to(site.resolve()), (pkg, info["path"])
    assert info["catalog"], "vgpuhost/data/catalog.yaml missing from the wheel"
    assert len(info["hosts"]) >= 7, info["hosts"]
    assert info["templates"], "no vgpuhost/data/templates/*.j2 in the wheel"
    assert 'uuid="2b9a4c1e-5d3f-4e7a-8c6b-0f1e2d3c4b5a"' in info["rendered"]

    out = _run([str(venv / "bin" / "vgpuhost"), "--help"], cwd=tmp_path)
    assert "Usage" in out
    # the installed package builds a simulated host from its shipped catalog and specs
    host = tmp_path / "host"
    _run([str(venv / "bin" / "vgpuhost"), "sim", "create", "a40-mdev", str(host)], cwd=tmp_path)
    doc = json.loads(_run([str(venv / "bin" / "vgpuhost"), "--root", str(host), "--json", "types"],
                          cwd=tmp_path))
    assert {t["name"] for t in doc["types"]} >= {"A40-8Q", "A40-1B", "A40-8C", "A40-8A"}


# --- the source distribution --------------------------------------------------

# Tracked paths that are not in the sdist, on purpose: the root symlinks into
# the package (its files ship under vgpuhost/) and git's own files.
SDIST_LEFT_OUT = {"hooks", "templates"}


def _tracked_files():
    """Every file git tracks, with symlinked directories expanded to their files."""
    if not (REPO / ".git").exists():
        from nsutil import skip_or_fail       # under CI (a clean clone) this must run, never skip
        skip_or_fail("not a git checkout: the sdist is compared with `git ls-files`", "the sdist check")
    out = _run(["git", "ls-files", "-z"], cwd=REPO)
    files = set()
    for rel in filter(None, out.split("\0")):
        if rel in SDIST_LEFT_OUT or Path(rel).name == ".gitignore":
            continue
        path = REPO / rel
        if path.is_symlink() and path.is_dir():
            files.update(str(p.relative_to(REPO)) for p in path.rglob("*") if p.is_file())
        elif path.exists():            # a file deleted in the work tree is not shipped
            files.add(rel)
    return files


def test_sdist_holds_every_tracked_file(tmp_path):
    """The sdist carries the licence, the tests with their data and conftest.py,
    examples/, the Ansible collection, bench/, docs/, debian/ and .ci/: every file
    git tracks (less the root symlinks into the package), and nothing built."""
    import tarfile

    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation",
          "--outdir", str(dist), str(REPO)], cwd=REPO)
    sdists = list(dist.glob("vgpuhost-*.tar.gz"))
    assert len(sdists) == 1, sdists
    with tarfile.open(sdists[0]) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        top = members[0].name.split("/", 1)[0]
        names = {m.name.split("/", 1)[1] for m in members}
        pkg_info = tf.extractfile(f"{top}/PKG-INFO").read().decode()
    for must in ("LICENSE", "MANIFEST.in", "tests/conftest.py", "tests/data/ansible/site.yml",
                 "examples/config/vgpu-a40.yaml", "examples/hosts/a40-mdev.yaml",
                 "ansible/galaxy.yml", "bench/hook.py", "vgpuhost/hook/qemu.sh",
                 "vgpuhost/data/catalog.yaml", "mkdocs.yml", "docs/index.md"):
        assert must in names, f"{must} missing from the sdist"
    missing = sorted(_tracked_files() - names)
    assert not missing, f"tracked files missing from the sdist (MANIFEST.in): {missing}"
    junk = sorted(n for n in names if "__pycache__" in n or n.endswith(".pyc")
                  or n.startswith(("docs/site/", "ansible/.ansible/")))
    assert not junk, junk
    assert "License: Apache-2.0" in pkg_info or "License-Expression: Apache-2.0" in pkg_info, pkg_info[:600]
    assert "License-File: LICENSE" in pkg_info, pkg_info[:600]
