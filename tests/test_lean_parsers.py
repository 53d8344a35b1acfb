"""The hand-written parsers of the qemu hook's path accept exactly what the regular expressions they replace
accepted, and give the same values.

The hook imports no ``re`` (its start-up: tests/test_hook.py::test_hook_path_imports_on_a_real_host), so
PCI addresses, UUIDs, vGPU type names, sizes, key names and ``creatable_vgpu_types`` lines are parsed by
hand (vgpuhost/model/values.py, libvirt/domxml.py, model/tenancy.py, observe/inventory.py).  Each is
checked here against the pattern it replaced, on strings drawn from the characters that matter.
"""

from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

from vgpuhost.libvirt import domxml
from vgpuhost.model import tenancy
from vgpuhost.model.errors import InputError
from vgpuhost.model.values import PciAddress, VgpuProfile, parse_size_mib, parse_uuid
from vgpuhost.observe.inventory import parse_creatable_vgpu_types

BDF_RE = re.compile(
    r"^(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<slot>[0-9a-fA-F]{2})\.(?P<func>[0-7])$")
SHORT_BDF_RE = r"^[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$"
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
PROFILE_RE = re.compile(
    r"^(?:(?:GRID|NVIDIA)\s+)?"
    r"(?P<board>[A-Za-z0-9]+(?: [A-Za-z0-9]+)*(?:-[A-Za-z]+)*)-"
    r"(?:(?P<slices>[1-9])-)?"
    r"(?P<fb>0|[1-9][0-9]*)(?P<series>[QBACqbac])(?P<attr>MEALL|NOME|GFX|ME|meall|nome|gfx|me)?$")
SIZE_RE = r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$"
KEY_RE = r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}\Z"
CREATABLE_RE = r"^\s*(\d+)\s*:\s*(.+?)\s*$"

# a few characters of every kind each pattern cares about, plus ones it must refuse
HEXISH = "0123456789abcdefABCDEFgG:.-_ \n\t" + "\u0661\u00e9"
NAMEISH = "AaZz09_-.:+ GRIDNVIDIAQBACqbacMEme\n\t\u00a0\u0663"
SIZEISH = "0123456789KMGTkmgtiIbB \n\t\u0662x"
CREATISH = "0123456789: \tABab-\u0660"


def bdf_texts():
    exact = st.builds(lambda d, b, s, f: f"{d:04x}:{b:02x}:{s:02x}.{f}",
                      st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
    return st.one_of(exact, exact.map(str.upper), exact.map(lambda t: t + "\n"), exact.map(lambda t: t[5:]),
                     st.text(HEXISH, max_size=18))


@settings(max_examples=400, deadline=None)
@given(bdf_texts())
def test_pci_address_parse_and_is_valid_match_the_pattern(text):
    m = BDF_RE.match(text)
    assert PciAddress.is_valid(text) == bool(m)
    stripped = BDF_RE.match(text.strip())
    try:
        got = PciAddress.parse(text)
    except InputError as e:
        assert not stripped
        assert ("did you mean" in (e.hint or "")) == bool(re.match(SHORT_BDF_RE, text.strip()))
    else:
        assert stripped
        assert (got.domain, got.bus, got.slot, got.function) == (
            int(stripped["domain"], 16), int(stripped["bus"], 16), int(stripped["slot"], 16), int(stripped["func"]))


def uuid_texts():
    exact = st.uuids().map(str)
    return st.one_of(exact, exact.map(str.upper), exact.map(lambda t: f" {t}\n"), exact.map(lambda t: t[:-1] + "g"),
                     exact.map(lambda t: t.replace("-", "", 1) + "0"), st.text(HEXISH, max_size=38))


@settings(max_examples=400, deadline=None)
@given(uuid_texts())
def test_parse_uuid_matches_the_pattern(text):
    want = text.strip().lower()
    try:
        got = parse_uuid(text)
    except InputError:
        assert not UUID_RE.match(want)
    else:
        assert UUID_RE.match(want) and got == want


def profile_texts():
    made = st.builds(lambda pre, board, sl, fb, series, me: f"{pre}{board}-{sl}{fb}{series}{me}",
                     st.sampled_from(["", "GRID ", "NVIDIA  ", "GRID", "NVIDIA\t"]),
                     st.sampled_from(["A40", "A100", "H200X", "L40S", "a_1", "GRID", "", "A-1", "RTX6000-Ada",
                                      "RTX Pro 6000 Blackwell DC", "DC", "A  B", "A-", "a-b-C", "A -b"]),
                     st.sampled_from(["", "1-", "7-", "-", "1-2-", "\u0661-", "0-", "12-"]),
                     st.sampled_from(["8", "48", "", "0", "\u0664", "08"]),
                     st.sampled_from(list("QBACqbacMx") + [""]),
                     st.sampled_from(["", "ME", "me", "Me", "E", "NOME", "MEALL", "GFX", "gfx", "ALL"]))
    return st.one_of(made, made.map(lambda t: t + "\n"), st.text(NAMEISH, max_size=16))


@settings(max_examples=600, deadline=None)
@given(profile_texts())
def test_vgpu_profile_try_parse_matches_the_pattern(text):
    m = PROFILE_RE.match(text.strip())
    want = None
    if m and (m["slices"] or not m["attr"]) and not (m["slices"] and "-" in m["board"]):
        slices = int(m["slices"]) if m["slices"] else None
        board = m["board"] if (" " in m["board"] or "-" in m["board"]) else m["board"].upper()
        attr = (m["attr"] or "").upper()
        want = VgpuProfile(board, int(m["fb"]), m["series"].upper(), slices, attr == "ME",
                           "" if attr == "ME" else attr)
    assert VgpuProfile.try_parse(text) == want


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(SIZEISH, max_size=10),
                 st.builds(lambda n, u: f"{n}{u}", st.integers(0, 10**6),
                           st.sampled_from(["", "M", "G", "K", "T", "MiB", "GB", "gib", " mb ", "iB", "X"]))))
def test_parse_size_mib_matches_the_pattern(text):
    m = re.match(SIZE_RE, text, re.IGNORECASE)
    want = None
    if m:
        n = int(m[1])
        want = {"K": n // 1024, "": n, "M": n, "G": n * 1024, "T": n * 1024 * 1024}[m[2].upper()]
    assert parse_size_mib(text) == want


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(NAMEISH, max_size=70), st.text("Aa0_.:+-", min_size=60, max_size=70)))
def test_key_names_match_the_pattern(text):
    assert domxml.valid_key(text) == bool(re.match(KEY_RE, text))
    try:
        tenancy.check_name(text)
        ok = True
    except InputError:
        ok = False
    assert ok == bool(re.match(KEY_RE, text))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.text(CREATISH, max_size=12),
                          st.builds(lambda i, n: f"{i} : {n}", st.integers(0, 999), st.sampled_from(
                              ["NVIDIA A40-8Q", "A40-8Q  ", " ", "", "a:b"]))), max_size=5))
def test_creatable_vgpu_types_lines_match_the_pattern(lines):
    text = "ID    : vGPU Name\n" + "\n".join(lines)
    want = []
    for line in text.splitlines():
        m = re.match(CREATABLE_RE, line)
        if m:
            want.append((m[1], m[2]))
    assert parse_creatable_vgpu_types(text) == want


# ---------------------------------------------------------------------------
# HostRoot's two spellings of every path: pathlib for the package, strings for the hook's path

def test_host_paths_spell_what_the_path_members_spell(tmp_path):
    import pathlib

    from vgpuhost.io.hostroot import HostPaths, HostRoot, plain_path
    for host in (HostRoot(tmp_path), HostRoot(str(tmp_path) + "//./"), HostRoot("/"),
                 HostRoot(tmp_path, tmp_path / "state"), HostRoot.from_env(str(tmp_path), "rel/state")):
        members = [n for n, v in vars(HostPaths).items() if not n.startswith("_") and n != "root"]
        assert len(members) > 20
        for name in members:
            as_str, as_path = getattr(host.s, name), getattr(host, name)
            if callable(as_str):
                args = ("0000:41:00.0",) if name in ("pci_device", "pci_driver", "lib_modules") else ("a", "b")
                as_str, as_path = as_str(*args), as_path(*args)
            assert isinstance(as_path, pathlib.Path) and as_str == str(as_path), (host, name)
        assert host.s.root == str(host.root) and host == HostRoot(host.root, host.state_dir_override)
        assert host.relative(host.s.pci_devices) == host.relative(host.pci_devices) == "/sys/bus/pci/devices"
    for text in ["/", "//", "///", "/a//b/./c/", "a/../b", ".", "./a", "a/.", "/a/b/..", "//a", "x"]:
        assert plain_path(text) == str(pathlib.Path(text)), text
