"""The intent journal of NVML writes (issue 12): MIG mode, MIG layouts, the vGPU scheduler and
mixed-size mode open a journal entry before their first NVML call; an interrupted one is listed
by ``reconcile --check`` (exit 1) and ended by ``reconcile`` or by the next command on the GPU.

The kill -9 sweeps over every NVML write are in tests/test_crash.py; these tests pin the
records: the entry's content, its audit rows written as intent and outcome, and who ends it.
"""

from __future__ import annotations

import json

from vgpuhost.cli.main import main
from vgpuhost.io.backends import backend_for
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.io.state import StateStore
from vgpuhost.ops import nvmljournal, recover
from vgpuhost.policy.mig import counts

from test_crash import A100, A100_MIG, A40_GPU, ALL_1G, TWO_3G, run, cli_op


def _host(make_host, mig_on=True):
    return make_host(yaml_text=A100_MIG.replace("MODE", "true" if mig_on else "false"))


def _layout(host):
    b = backend_for(host)
    return counts(b.gi_profiles(A100), b.gpu_instances(A100))


def _entries(host, open_only=False):
    st = StateStore(host.state_dir, create=False)
    try:
        return st.journal_entries(open_only=open_only), st.audit_rows()
    finally:
        st.close()


def test_the_nvml_kinds_are_the_ones_recover_dispatches():
    assert tuple(recover.NVML_KINDS) == tuple(nvmljournal.KINDS)


def test_a_mig_apply_records_the_state_before_and_closes(make_host):
    host = _host(make_host)
    assert main(["--root", str(host.root), "mig", "apply", "--gpu", A100, ALL_1G]) == 0
    entries, rows = _entries(host)
    (e,) = entries
    assert (e.kind, e.owner, e.gpu, e.state, e.done, len(e.steps)) == ("mig-apply", "manual", A100, "closed", 7, 7)
    dev = e.devices[0]
    assert dev["mig_mode"] == {"current": True, "pending": True} and dev["gpu_instances"] == []
    assert dev["want"] == {"layout": {"19": 7}}
    assert "mixed_size" in dev and "scheduler" in dev          # null here: NVML has none in MIG mode
    assert [r.result for r in rows] == ["ok"] * 7


def test_kill_during_mig_apply_is_listed_then_rolled_back_by_the_next_apply(make_host, tmp_path):
    host = _host(make_host)
    assert main(["--root", str(host.root), "mig", "apply", "--gpu", A100, ALL_1G]) == 0
    log = tmp_path / "w.log"
    # killed after its 3rd NVML call landed: 3 of 7 GPU instances destroyed, none created
    assert run(host, cli_op(host, "mig", "apply", "--gpu", A100, TWO_3G), log, kill_at=3, when="after") == -9
    assert _layout(host) == {"1g.5gb": 4}
    open_, rows = _entries(host, open_only=True)
    assert [e.kind for e in open_] == ["mig-apply"] and open_[0].done == 2
    assert [r.result for r in rows if r.operation.startswith("mig apply") and "2x3g" in r.operation] == \
        ["ok", "ok", "interrupted"]                             # the killed call's row, written as intent
    assert run(host, cli_op(host, "--json", "reconcile", "--check"), log) == 1
    # the next command on the GPU ends it first (rolled back), then does its own work
    assert main(["--root", str(host.root), "mig", "apply", "--gpu", A100, TWO_3G]) == 0
    assert _layout(host) == {"3g.20gb": 2}
    entries, rows = _entries(host)
    assert [(e.kind, e.state) for e in entries] == [("mig-apply", "closed"), ("mig-apply", "rolled-back"),
                                                    ("mig-apply", "closed")]
    restored = [r for r in rows if r.operation.startswith("reconcile journal #2")]
    assert [r.path for r in restored] == ["nvml:nvmlDeviceCreateGpuInstanceWithPlacement"] * 3
    assert all(r.result == "ok" for r in restored)


def test_reconcile_check_lists_an_open_nvml_entry(make_host, tmp_path, capsys):
    host = make_host("a40-mdev")
    log = tmp_path / "w.log"
    argv = ("scheduler", "set", "--gpu", A40_GPU, "--policy", "equal-share", "--timeslice-ms", "3")
    assert run(host, cli_op(host, *argv), log, kill_at=1, when="before") == -9
    capsys.readouterr()
    assert main(["--root", str(host.root), "--json", "reconcile", "--check"]) == 1
    doc = json.loads(capsys.readouterr().out)
    (j,) = doc["journal"]
    assert j["result"] == "open" and j["operation"] == f"scheduler set {A40_GPU}"
    assert j["devices"][0]["scheduler"]["policy"] == "best-effort"
    assert j["devices"][0]["want"]["scheduler"]["policy"] == "equal-share"
    assert main(["--root", str(host.root), "reconcile", "--check"]) == 1      # the text names the fix
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("open: ") and out[-2:] == [
        "NOT in sync", "fix: run 'vgpuhost reconcile' to finish or roll back the interrupted operations"]
    assert main(["--root", str(host.root), "reconcile"]) == 0
    assert "the scheduler was never changed" in capsys.readouterr().out
    entries, _ = _entries(host)
    assert [(e.kind, e.state) for e in entries] == [("scheduler-set", "rolled-back")]
    assert backend_for(host).scheduler_state(A40_GPU).policy == "best-effort"


def test_an_interrupted_scheduler_set_that_landed_is_finished(make_host, tmp_path):
    host = make_host("a40-mdev")
    log = tmp_path / "w.log"
    argv = ("scheduler", "set", "--gpu", A40_GPU, "--policy", "equal-share", "--timeslice-ms", "3")
    assert run(host, cli_op(host, *argv), log, kill_at=1, when="after") == -9
    # the next command on the GPU (mixed-size mode) ends it first
    assert main(["--root", str(host.root), "vgpu", "mode", "--gpu", A40_GPU, "--mixed-size", "on"]) == 0
    entries, _ = _entries(host)
    assert [(e.kind, e.state) for e in entries] == [("scheduler-set", "finished"), ("mixed-size", "closed")]
    assert backend_for(host).scheduler_state(A40_GPU) == SchedulerState("equal-share", arr=False, timeslice_ms=3)


def test_an_interrupted_mig_disable_gets_its_instances_back(make_host, tmp_path):
    host = _host(make_host)
    assert main(["--root", str(host.root), "mig", "apply", "--gpu", A100, "3g.20gb=1,1g.5gb=2"]) == 0
    log = tmp_path / "w.log"
    assert run(host, cli_op(host, "mig", "disable", "--gpu", A100), log, kill_at=2, when="after") == -9
    assert _layout(host) == {"1g.5gb": 1}
    assert main(["--root", str(host.root), "reconcile"]) == 0
    assert _layout(host) == {"3g.20gb": 1, "1g.5gb": 2}
    assert backend_for(host).mig_mode(A100) == (True, True)
    entries, _ = _entries(host)
    assert entries[-1].kind == "mig-mode" and entries[-1].state == "rolled-back"


def test_a_refused_start_says_what_it_ended_first(make_host, monkeypatch):
    """A domain start first ends interrupted operations on its devices (as every command does); when
    the start is then refused, its refusal says what was ended (a breaker's finding: a start that
    rolled back an interrupted 'mig apply' and then refused said nothing of it).  The recovery itself
    is tested above; here an open entry, a recovery and a refusal are stood in for."""
    from vgpuhost.libvirt.domxml import parse_domain
    from vgpuhost.model.errors import RefusedError
    from vgpuhost.ops import devices
    from test_hook import DOM1, MDEV1, vgpu_domain
    host = make_host("a40-mdev")
    StateStore(host.state_dir).close()
    monkeypatch.setattr(StateStore, "journal_entries", lambda self, open_only=False: ["open"])
    monkeypatch.setattr(recover, "recover_devices", lambda *a, **k: [recover.Recovered(
        7, "mig apply --gpu 0000:81:00.0", "manual", "rolled-back", "3 GPU instances restored")])

    def refuse(*a, **k):
        raise RefusedError("no 1g.18gb GPU instance free", hint="create one")
    monkeypatch.setattr(devices, "_prepare", refuse)
    view = parse_domain(vgpu_domain("late", DOM1, MDEV1).encode())
    try:
        devices.prepare(host, view, actor="test")
    except RefusedError as e:
        hint = e.hint
    assert hint == ("create one; before this start, vgpuhost ended journal #7 "
                    "mig apply --gpu 0000:81:00.0 (owner manual): rolled-back: 3 GPU instances restored")
