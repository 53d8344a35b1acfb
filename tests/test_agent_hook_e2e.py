"""Hook parity under a real libvirtd: the same domain starts give the same results with the agent up and down.

Follows tests/test_hook_e2e.py (its fixtures: the isolated libvirtd, the
simulated GPU host, the installed hook and the spy after it).  With the
agent up (``vgpuhost agent`` listening on ``<root>/run/vgpuhost``, where the
installed hook looks), the hook hands ``prepare begin`` and ``release end``
to it: through the sh dispatcher's thin client (the compiled
vgpuhost-hook-client, or curl; no Python start), or, on a host without
either, through the Python handler; down, the hook does the
work itself.  Each case's outcome (virsh's
exit and error lines, what the spy saw right after ``prepare begin``, the
tree, the records and the audit rows, ids normalised) is compared with one
expected value for both; with the agent up, the agent must have served the
hook's calls.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentutil import AgentRun                                              # noqa: E402
from test_hook_e2e import (PT_AUDIO, PT_GPU, define, drivers, error_lines, gpu_host, hooked,  # noqa: E402,F401
                           mdev_hostdev, pci_error, pci_hostdev)
from vgpuhost.io.state import StateStore                                   # noqa: E402
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest                   # noqa: E402

pytest_plugins = ["libvirtd_fixture"]
pytestmark = pytest.mark.root

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PID_RE = re.compile(r"pid=\d+")


def _norm(text: str) -> str:
    return PID_RE.sub("pid=N", UUID_RE.sub("UUID", text))


def outcome(daemon, host, tmp_path, name: str) -> dict:
    """Start ``name`` and read back everything the hook did."""
    proc = daemon.virsh("start", name)
    spy = tmp_path / f"{name}.mdevs"
    store = StateStore(host.state_dir)
    rows = [r for r in store.audit_rows() if r.actor.startswith("hook ")]
    return {
        "rc": proc.returncode,
        "errors": [_norm(line) for line in error_lines(proc.stderr)],
        "mdevs after prepare": spy.read_text().split() if spy.exists() else None,
        "drivers after prepare": (tmp_path / f"{name}.drivers").read_text().split() if spy.exists() else None,
        "mdevs after": os.listdir(host.mdev_devices),
        "drivers after": drivers(host),
        "records": [store.vgpu_records(), store.passthrough_records(), store.active_domains()],
        "audit": [(_norm(r.actor), _norm(r.operation), r.path.rsplit("/", 1)[-1], r.result) for r in rows],
        "state": daemon.virsh("domstate", name, check=True).stdout.strip(),
    }


@pytest.fixture(params=["agent-down", "agent-up", "agent-up-curl", "agent-up-no-curl"])
def agent_mode(request, gpu_host, hooked):
    """None (agent down), or the running agent.  ``agent-up``: the installed dispatcher's thin client
    (the compiled vgpuhost-hook-client when ``make dev`` built it, else curl) hands the calls over and
    no Python starts; ``agent-up-curl``: the same through curl (no compiled client);
    ``agent-up-no-curl``: a host with neither, where the Python handler hands them over."""
    if request.param == "agent-down":
        yield None
        return
    hook = hooked.hooks_dir / "vgpuhost"
    text = hook.read_text()
    if request.param in ("agent-up-curl", "agent-up-no-curl"):
        assert re.search(r"^\t+for c in .+; do$", text, re.M)
        text = re.sub(r"^(\t+)for c in .+; do$", r"\1for c in ; do", text, flags=re.M)
    if request.param == "agent-up-no-curl":
        assert "\tfor d in /usr/bin /bin /usr/local/bin; do\n" in text
        text = text.replace("\tfor d in /usr/bin /bin /usr/local/bin; do\n", "\tfor d in ; do\n")
    hook.write_text(text)
    with AgentRun(gpu_host.root, str(gpu_host.path("run", "vgpuhost"))) as run:
        run.thin = request.param in ("agent-up", "agent-up-curl")
        yield run


def served_by(agent) -> tuple:
    """(calls the agent served, of those through the thin client)."""
    info = agent.call("GET", "/v1/agent")[1]
    return info["served"], info["served_thin_client"]


def test_hook_parity_vgpu_and_passthrough(agent_mode, hooked, gpu_host, tmp_path):
    mdev = "aaaaaaaa-2222-4333-8444-00000000e2f1"
    meta = Metadata(strategy="best-fit", vgpus=[VgpuRequest("A40-8Q", uuid=mdev)], passthrough=[PT_GPU])
    define(hooked, "hk-par", meta, pci_hostdev(PT_GPU) + pci_hostdev(PT_AUDIO) + mdev_hostdev(mdev))
    try:
        got = outcome(hooked, gpu_host, tmp_path, "hk-par")
    finally:
        hooked.virsh("undefine", "hk-par")
    audit_ops = [(op.split(" ")[0], op.split(" ")[1], path, res) for _, op, path, res in got.pop("audit")]
    assert got == {
        "rc": 1, "errors": ["error: Failed to start domain 'hk-par'", _norm(pci_error(PT_GPU))],
        "mdevs after prepare": [mdev], "drivers after prepare": ["vfio-pci", "vfio-pci"],
        "mdevs after": [], "drivers after": ["nvidia", "snd_hda_intel"], "records": [[], [], {}],
        "state": "shut off",
    }
    assert ("vgpu", "create", "create", "ok") in audit_ops and ("vgpu", "remove", "remove", "ok") in audit_ops
    assert ("passthrough", "prepare", "drivers_probe", "ok") in audit_ops
    assert ("passthrough", "release", "drivers_probe", "ok") in audit_ops
    if agent_mode is not None:
        served, thin = served_by(agent_mode)
        assert served.get("POST /v1/hook/prepare") == 1 and served.get("POST /v1/hook/release") == 1
        assert thin == ({"POST /v1/hook/prepare": 1, "POST /v1/hook/release": 1} if agent_mode.thin else {})


def test_hook_parity_refusal(agent_mode, hooked, gpu_host, tmp_path):
    mdev = "aaaaaaaa-2222-4333-8444-00000000e2f2"
    define(hooked, "hk-par-bad", Metadata(vgpus=[VgpuRequest("A40-7Q", uuid=mdev)]), mdev_hostdev(mdev))
    try:
        got = outcome(hooked, gpu_host, tmp_path, "hk-par-bad")
    finally:
        hooked.virsh("undefine", "hk-par-bad")
    want = ("vgpuhost: error: domain 'hk-par-bad': unknown vGPU profile 'A40-7Q' on this host; near matches: "
            "A40-8Q, A40-6Q, A40-4Q, A40-3Q, A40-2Q")
    errors = got.pop("errors")
    assert errors[0] == "error: Failed to start domain 'hk-par-bad'" and errors[1].endswith(
        "hk-par-bad prepare begin -) unexpected exit status 2: " + want) and len(errors) == 2
    # libvirt runs the spy too: nothing had been made by then
    assert got == {"rc": 1, "mdevs after prepare": [], "drivers after prepare": ["nvidia", "snd_hda_intel"],
                   "mdevs after": [],
                   "drivers after": ["nvidia", "snd_hda_intel"], "records": [[], [], {}], "audit": [],
                   "state": "shut off"}
    if agent_mode is not None:
        served, thin = served_by(agent_mode)
        assert served.get("POST /v1/hook/prepare") == 1
        assert thin.get("POST /v1/hook/prepare") == (1 if agent_mode.thin else None)
