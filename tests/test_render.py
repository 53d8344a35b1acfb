"""Rendered hostdev XML: one golden file per case, each valid against libvirt's RelaxNG schema.

Goldens live in tests/data/render/ and are reviewed like code; regenerate
deliberately with VGPUHOST_REGEN_GOLDENS=1.  Every golden is wrapped in a
minimal domain document and validated against
/usr/share/libvirt/schemas/domain.rng with lxml (the schema includes its
relative files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from lxml import etree

from vgpuhost.libvirt import domain
from vgpuhost.ops.attach import passthrough_hostdevs
from vgpuhost.cli.main import main
from vgpuhost.model.errors import InputError, RefusedError
from vgpuhost.observe.inventory import discover
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.values import PciAddress

from conftest import DATA, golden

SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")
UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"


@pytest.fixture(scope="module")
def rng():
    if not SCHEMA.is_file():
        import nsutil
        nsutil.skip_or_fail(f"{SCHEMA} is missing (Debian: libvirt-daemon or libvirt-clients)", "RelaxNG checks")
    return etree.RelaxNG(etree.parse(str(SCHEMA)))


def assert_valid(rng, snippet: str, *, graphics: bool = True) -> None:
    doc = etree.fromstring(domain.wrap_in_domain(snippet, graphics=graphics).encode())
    ok = rng.validate(doc)
    assert ok, f"not valid against {SCHEMA}: {rng.error_log}\n{snippet}"


def inv_of(make_host, spec):
    return discover(Sysfs(make_host(spec)))


def P(text):
    return PciAddress.parse(text)


# --- one golden per case -------------------------------------------------------------

CASES = {
    # name: (spec, callable(inv) -> xml)
    "pci-single-function.xml": ("a40-mdev", lambda inv: passthrough_hostdevs(inv, P("0000:81:00.0"))),
    "pci-single-function-guest-slot.xml": (
        "a40-mdev", lambda inv: passthrough_hostdevs(inv, P("0000:81:00.0"), guest_slot=0x11)),
    "pci-group-audio-companion.xml": (
        "a100-sriov-mdev", lambda inv: passthrough_hostdevs(inv, P("0000:41:00.0"), guest_slot=0x10)),
    "pci-group-turing-four-functions.xml": (
        "turing-consumer", lambda inv: passthrough_hostdevs(inv, P("0000:01:00.0"), guest_slot=0x12)),
    "mdev-plain.xml": (None, lambda inv: domain.render_mdev(UUID)),
    "mdev-display.xml": (None, lambda inv: domain.render_mdev(UUID, display=True)),
    "mdev-display-ramfb.xml": (None, lambda inv: domain.render_mdev(UUID, display=True, ramfb=True)),
    "mdev-guest-slot.xml": (None, lambda inv: domain.render_mdev(UUID, guest_slot=0x13)),
    "vendor-vf.xml": (None, lambda inv: domain.render_vf(P("0000:21:00.5"))),
    "vendor-vf-mig-backed.xml": (None, lambda inv: domain.render_vf(P("0000:18:01.2"), guest_slot=0x14)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_golden_and_schema(case, make_host, rng):
    spec, fn = CASES[case]
    xml = fn(inv_of(make_host, spec) if spec else None)
    golden("render", case, xml)
    assert_valid(rng, xml)


def test_every_golden_file_is_a_case_and_valid(rng):
    """No stale golden: every file under tests/data/render is produced by a case above (or the CLI test)."""
    files = {p.name for p in (DATA / "render").iterdir()}
    assert set(CASES) <= files
    for p in sorted((DATA / "render").glob("*.xml")):
        assert_valid(rng, p.read_text())
    assert files - set(CASES) <= {"cli-render-turing.xml", "cli-render-a40-mdev.xml", "cli-render-l40s-vf.xml"}


# --- what the forms promise ---------------------------------------------------------------

def test_passthrough_hostdevs_are_managed_no_and_share_one_slot(make_host):
    xml = passthrough_hostdevs(inv_of(make_host, "turing-consumer"), P("0000:01:00.0"), guest_slot=0x10)
    root = etree.fromstring(f"<x>{xml}</x>".encode())
    hds = root.findall("hostdev")
    assert [h.get("managed") for h in hds] == ["no"] * 4           # never managed='yes' (the hook binds)
    srcs = [h.find("source/address").get("function") for h in hds]
    guests = [h.find("address") for h in hds]
    assert srcs == ["0x0", "0x1", "0x2", "0x3"]
    assert {(g.get("bus"), g.get("slot")) for g in guests} == {("0x00", "0x10")}
    assert [g.get("function") for g in guests] == srcs                 # functions as on the host
    assert [g.get("multifunction") for g in guests] == ["on", None, None, None]


def test_single_function_has_no_multifunction(make_host):
    xml = passthrough_hostdevs(inv_of(make_host, "a40-mdev"), P("0000:81:00.0"), guest_slot=0x10)
    assert "multifunction" not in xml and 'managed="no"' in xml


def test_no_template_ever_writes_managed_yes(make_host):
    inv = inv_of(make_host, "a100-sriov-mdev")
    for xml in (passthrough_hostdevs(inv, P("0000:41:00.0")), domain.render_vf(P("0000:41:00.4")),
                domain.render_mdev(UUID)):
        assert "managed=\"yes\"" not in xml and "managed='yes'" not in xml


def test_mdev_without_model_or_display_on_pci_is_invalid(rng):
    """The schema quirks the templates rely on: type='mdev' needs model; display is mdev-only."""
    bad_mdev = f'<hostdev mode="subsystem" type="mdev"><source><address uuid="{UUID}"/></source></hostdev>'
    bad_pci = ('<hostdev mode="subsystem" type="pci" managed="no" display="on"><source>'
               '<address domain="0x0000" bus="0x41" slot="0x00" function="0x0"/></source></hostdev>')
    for snippet in (bad_mdev, bad_pci):
        doc = etree.fromstring(domain.wrap_in_domain(snippet).encode())
        assert not rng.validate(doc)


@pytest.mark.parametrize("call, exc, text", [
    (lambda inv: passthrough_hostdevs(inv, P("0000:03:00.0")), RefusedError, "SATA controller"),
    (lambda inv: passthrough_hostdevs(inv, P("0000:03:00.1")), InputError, "not a GPU"),
    (lambda inv: passthrough_hostdevs(inv, P("0000:09:00.0")), InputError, "no PCI device"),
    (lambda inv: domain.render_mdev("not-a-uuid"), InputError, "invalid UUID"),
    (lambda inv: domain.render_mdev("../../etc/passwd"), InputError, "invalid UUID"),
    (lambda inv: domain.render_mdev(UUID, ramfb=True), InputError, "--ramfb needs --display"),
    (lambda inv: domain.render_mdev(UUID, guest_slot=0), InputError, "out of range"),
    (lambda inv: domain.render_vf(P("0000:21:00.4"), guest_slot=0x20), InputError, "guest PCI slot 0x20 is out"),
    (lambda inv: domain.render_mdev("00000000-0000-0000-0000-000000000000"), InputError, "nil UUID"),
])
def test_render_refusals(call, exc, text, make_host):
    with pytest.raises(exc) as err:
        call(inv_of(make_host, "sata-shared-group"))
    assert text in err.value.one_line()


def test_vf_is_refused_as_passthrough(make_host):
    with pytest.raises(InputError) as err:
        passthrough_hostdevs(inv_of(make_host, "l40s-vendor-vfio"), P("0000:21:00.4"))
    assert "VF" in err.value.message


def test_iommu_off_refuses_passthrough(make_host):
    inv = inv_of(make_host, "iommu-off")
    with pytest.raises(RefusedError) as err:
        passthrough_hostdevs(inv, inv.gpus[0].address)
    assert "IOMMU is off" in err.value.message


# --- the CLI ------------------------------------------------------------------------------

def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_render_passthrough_golden(make_host, capsys, rng):
    code, out, err = run(capsys, "--root", str(make_host("turing-consumer").root), "render",
                         "--passthrough", "0000:01:00.0")
    assert code == 0, err
    golden("render", "cli-render-turing.xml", out)
    assert_valid(rng, out)
    assert 'slot="0x10"' in out                    # several functions: one slot, 0x10 by default


def test_cli_render_mdev_golden(make_host, capsys, rng):
    code, out, err = run(capsys, "--root", str(make_host("a40-mdev").root), "render", "--profile", "a40-8q",
                         "--uuid", UUID, "--display", "--ramfb")
    assert code == 0, err
    golden("render", "cli-render-a40-mdev.xml", out)
    assert_valid(rng, out)


def test_cli_render_vendor_vf_golden_and_json(make_host, capsys, rng):
    root = str(make_host("l40s-vendor-vfio").root)
    code, out, err = run(capsys, "--root", root, "render", "--profile", "L40S-4Q", "--gpu", "0000:a1:00.0")
    assert code == 0, err
    golden("render", "cli-render-l40s-vf.xml", out)
    assert_valid(rng, out)
    code, out, _ = run(capsys, "--root", root, "--json", "render", "--profile", "L40S-4Q")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == "vgpuhost.render/v1"
    assert doc["kind"] == "vendor-vfio" and doc["device"] == "0000:21:00.4" and doc["gpu"] == "0000:21:00.0"
    assert set(doc) == {"schema", "kind", "profile", "device", "gpu", "functions", "reason", "xml"}
    assert_valid(rng, doc["xml"])


def test_cli_render_json_passthrough(make_host, capsys):
    code, out, _ = run(capsys, "--root", str(make_host("a100-sriov-mdev").root), "--json", "render",
                       "--passthrough", "0000:41:00.0", "--guest-slot", "0x11")
    doc = json.loads(out)
    assert code == 0 and doc["kind"] == "passthrough"
    assert doc["functions"] == ["0000:41:00.0", "0000:41:00.1"] and 'slot="0x11"' in doc["xml"]


@pytest.mark.parametrize("spec, args, text", [
    ("a40-mdev", ["--profile", "A40-9Q"], "unknown vGPU profile 'A40-9Q'"),
    ("a40-mdev", ["--profile", "A40-8Q", "--ramfb"], "--ramfb needs --display"),
    ("a40-mdev", [], "exactly one of --profile NAME or --passthrough BDF"),
    ("a40-mdev", ["--profile", "A40-8Q", "--passthrough", "0000:81:00.0"], "exactly one of"),
    ("a40-mdev", ["--passthrough", "81:00.0"], "did you mean 0000:81:00.0"),
    ("a40-mdev", ["--passthrough", "0000:81:00.0", "--display"], "apply to vGPUs"),
    ("a40-mdev", ["--passthrough", "0000:81:00.0", "--guest-slot", "zz"], "invalid --guest-slot"),
    ("a40-mdev", ["--profile", "A40-8Q", "--uuid", "../../x"], "invalid UUID"),
    # review 1 item 15: the slot as the operator typed it (hex), and no nil UUID
    ("a40-mdev", ["--passthrough", "0000:81:00.0", "--guest-slot", "0x20"], "guest PCI slot 0x20 is out of range"),
    ("a40-mdev", ["--profile", "A40-8Q", "--guest-slot", "0"], "guest PCI slot 0x00 is out of range"),
    ("a40-mdev", ["--profile", "A40-8Q", "--uuid", "00000000-0000-0000-0000-000000000000"],
     "the nil UUID 00000000-0000-0000-0000-000000000000 cannot name an mdev"),
    ("sata-shared-group", ["--passthrough", "0000:03:00.0"], "is not viable"),
    ("l40s-vendor-vfio", ["--profile", "L40S-4Q", "--display"], "apply to classic mdev vGPUs"),
])
def test_cli_render_errors_are_one_line_exit_2(spec, args, text, make_host, capsys):
    code, out, err = run(capsys, "--root", str(make_host(spec).root), "render", *args)
    assert code == 2 and out == ""
    assert err.startswith("vgpuhost: error: ") and err.count("\n") == 1 and text in err, err


def test_render_works_without_libvirt_imported(make_host):
    """render never needs libvirt-python (vgpuhost.virt imports it lazily)."""
    import subprocess
    import sys
    root = str(make_host("a40-mdev").root)
    code = ("import sys; sys.modules['libvirt'] = None\n"
            "from vgpuhost.cli.main import main\n"
            f"sys.exit(main(['--root', {root!r}, 'render', '--passthrough', '0000:81:00.0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr
    assert "<hostdev" in proc.stdout
