"""The documentation in docs/: it builds without a warning, and what is generated is current.

- ``mkdocs build --strict`` (mkdocs.yml turns broken links and anchors
  into warnings, and strict mode makes any warning fail the build).
- ``docs/reference/cli.md`` equals what ``tools/clidoc.py`` generates from the
  click commands now (regenerate with ``make docs-cli``).
- The man page and the shell completions generate, and the man page renders
  with groff without a warning.
- Every ``docs/reference/<page>.md#anchor`` pointer in the code, the
  example configs, the hook and the Ansible collection names a page and an
  anchor that exist.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nsutil import skip_or_fail

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _clidoc():
    spec = importlib.util.spec_from_file_location("clidoc", REPO / "tools" / "clidoc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        skip_or_fail("mkdocs is not installed (the test extra has it: make dev)", "the docs build")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "reference" / "hardware" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_cli_reference_is_current():
    text = _clidoc().markdown()
    current = (DOCS / "reference" / "cli.md").read_text()
    assert text == current, "docs/reference/cli.md is stale: run `make docs-cli` and commit it"
    # every command is in it
    for command in ("host check", "vgpu create", "hook install", "config check", "audit"):
        assert f"## vgpuhost {command} " in text, command


def test_man_page_and_completions_generate(tmp_path):
    clidoc = _clidoc()
    assert clidoc.main(["man", str(tmp_path / "man")]) == 0
    page = (tmp_path / "man" / "vgpuhost.8").read_text()
    assert page.startswith(".TH VGPUHOST 8 ")         # section 8, as mdevctl, driverctl and libvirtd
    for section in (".SH NAME", ".SH SYNOPSIS", ".SH OPTIONS", ".SH COMMANDS", ".SH EXIT STATUS", ".SH ENVIRONMENT",
                    ".SS vgpuhost host check"):
        assert section in page, section
    # every exit code of the code's table, and nothing else
    from vgpuhost.model import errors
    status = page.split(".SH EXIT STATUS\n", 1)[1].split(".SH ", 1)[0]
    listed = [int(x) for x in re.findall(r"^\.TP\n(\d+)\n", status, re.M)]
    assert listed == sorted(v for k, v in vars(errors).items() if k.startswith("EXIT_")), listed
    # the environment the code reads, the global options (--local among them)
    env = page.split(".SH ENVIRONMENT\n", 1)[1].split(".SH ", 1)[0]
    for name in ("VGPUHOST_ROOT", "VGPUHOST_STATE_DIR", "VGPUHOST_AGENT", "VGPUHOST_AGENT_SOCKET", "VGPUHOST_ACTOR",
                 "VGPUHOST_RETRY_EXITS", "LIBVIRT_DEFAULT_URI"):
        assert f"\\fB{name}\\fR" in env, name
    assert "\\fB\\-\\-local\\fR" in page.split(".SH OPTIONS\n", 1)[1].split(".SH ", 1)[0]
    groff = shutil.which("groff")
    if groff:
        proc = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z", str(tmp_path / "man" / "vgpuhost.8")],
                              capture_output=True, text=True)
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    assert clidoc.main(["completions", str(tmp_path / "comp")]) == 0
    for name, marker in (("vgpuhost.bash", "_VGPUHOST_COMPLETE=bash_complete"),
                         ("_vgpuhost", "#compdef vgpuhost"),
                         ("vgpuhost.fish", "_VGPUHOST_COMPLETE=fish_complete")):
        assert marker in (tmp_path / "comp" / name).read_text(), name


def test_man_page_environment_and_exit_codes_follow_the_code(monkeypatch):
    """A VGPUHOST_* variable the code reads, or an EXIT_* code, without a line in clidoc's tables
    stops the man page from generating."""
    clidoc = _clidoc()
    assert {"VGPUHOST_AGENT", "VGPUHOST_AGENT_SOCKET", "VGPUHOST_ACTOR"} <= clidoc.code_environment()
    monkeypatch.delitem(clidoc.ENVIRONMENT, "VGPUHOST_ACTOR")
    with pytest.raises(SystemExit, match="no line for VGPUHOST_ACTOR"):
        clidoc.environment()
    monkeypatch.delitem(clidoc.EXIT_MEANINGS, "EXIT_TRANSIENT")
    with pytest.raises(SystemExit, match="no line for EXIT_TRANSIENT"):
        clidoc.exit_codes()


def _anchors(page: Path):
    """Heading ids of a markdown page: explicit {#id} or the slug of the heading text."""
    ids = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if fence or not line.startswith("#"):
            continue
        m = re.search(r"\{#([\w-]+)\}\s*$", line)
        if m:
            ids.add(m.group(1))
        else:
            text = re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            ids.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-"))
    return ids


POINTER = re.compile(r"docs/((?:[\w-]+/)*[\w-]+\.md)((?:#[\w-]+(?:, #[\w-]+)*)?)")


def test_docs_pointers_in_code_resolve():
    seen = 0
    for top in ("vgpuhost", "examples", "ansible", "bench", "tools"):
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file() or path.suffix in (".pyc",) or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for m in POINTER.finditer(text):
                page = DOCS / m.group(1)
                assert page.is_file(), f"{path.relative_to(REPO)}: {m.group(0)}: no such page"
                for anchor in re.findall(r"#([\w-]+)", m.group(2)):
                    assert anchor in _anchors(page), f"{path.relative_to(REPO)}: {m.group(0)}: no #{anchor}"
                seen += 1
    assert seen, "no docs/ pointers found at all"


def test_no_citation_of_a_document_outside_the_repository():
    """The hardware and libvirt facts live in docs/reference/; nothing cites the old
    out-of-tree reference document any more."""
    word = "REFERENCE" + ".md"
    hits = []
    for top in ("vgpuhost", "examples", "ansible", "bench", "tools", "tests", "docs", "debian"):
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".deb"):
                try:
                    text = path.read_text()
                except UnicodeDecodeError:
                    continue
                hits += [f"{path.relative_to(REPO)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                         if word in line]
    hits += [f"README.md:{n}" for n, line in enumerate((REPO / "README.md").read_text().splitlines(), 1)
             if word in line]
    assert not hits, hits


def test_cli_guide_synopsis_lists_each_command_once_and_every_global_option():
    """Issue 15 #4: exporter, usage and advise were listed twice; --local was missing."""
    from vgpuhost.cli.main import GLOBAL_OPTIONS
    text = (REPO / "docs" / "guide" / "cli.md").read_text()
    block = text.split("```", 2)[1].strip("\n").splitlines()
    entries = [line for line in block[1:] if line.startswith("  ") and not line.startswith("   ")]
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)
    for opt in GLOBAL_OPTIONS:
        assert opt in block[0] or opt == "--verbose", opt        # shown as -v|-vv


def test_the_exit_codes_the_cli_guide_documents_are_the_codes_table():
    """docs/guide/cli.md#exit-codes lists every code of vgpuhost.model.errors' table, and no other."""
    from vgpuhost.model import errors
    guide = (DOCS / "guide" / "cli.md").read_text()
    table = guide.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = [int(x) for x in re.findall(r"^\| `(\d+)` \|", table, re.M)]
    assert listed == sorted(v for k, v in vars(errors).items() if k.startswith("EXIT_")), listed


def test_one_version_for_the_program_the_debian_packages_and_the_ansible_collection():
    """vgpuhost.__version__ is the version of the Debian source package (debian/changelog's newest entry), of the
    Ansible collection (galaxy.yml) and of the collection's newest changelog release."""
    import yaml

    import vgpuhost
    version = vgpuhost.__version__
    debian = re.match(r"vgpuhost \(([^)]+)\)", (REPO / "debian" / "changelog").read_text())
    assert debian and debian.group(1) == version, (debian and debian.group(0), version)
    galaxy = yaml.safe_load((REPO / "ansible" / "galaxy.yml").read_text())
    assert galaxy["version"] == version, galaxy["version"]
    releases = yaml.safe_load((REPO / "ansible" / "changelogs" / "changelog.yaml").read_text())["releases"]
    newest = max(releases, key=lambda v: tuple(int(x) for x in v.split(".")))
    assert newest == version, sorted(releases)
