"""The agent's ``GET /v1/types`` is ``vgpuhost --json types`` (trial 8 T3), and AVAIL is what the host takes.

Both are built by one function (:func:`vgpuhost.present.inventory.types_listing`): the agent from its
warm snapshot, the CLI from its lean read.  Each test compares the two documents on the same simulated
host, after changes made outside the agent (``--local``, as the layout unit runs), and reads the truth
back: vGPUs created (or domains started) until the host refuses make exactly AVAIL.  ``GET /v1/capacity``
with a profile no GPU offers is refused as the CLI refuses it (trial 8 T8).
"""

from __future__ import annotations

import json

import pytest

from test_mig_ondemand import H200, gis, hook_run, vfs, vm_xml
from vgpuhost.agent import api, server
from vgpuhost.cli.main import main
from vgpuhost.io.state import StateStore
from vgpuhost.model.errors import InputError, RefusedError
from vgpuhost.model.values import PciAddress
from vgpuhost.ops import migdemand
from vgpuhost.ops.vgpu import create
from vgpuhost.present import inventory as present

L40S = PciAddress.parse("0000:a1:00.0")      # the shipped l40s-vendor-vfio spec's second GPU


def agent_types(agent: api.Agent, gpu=None) -> dict:
    """``GET /v1/types[?gpu=BDF]`` as the agent answers it on the read-only socket (its kept answer when current)."""
    query = {"gpu": str(gpu)} if gpu else {}
    return json.loads(api.get_types(agent, api.Request({}, query, None, "test", 1, api.READ)).body)


def cli_types(host, capsys, gpu=None) -> dict:
    """``vgpuhost --json types [--gpu BDF]``: the lean one-shot read."""
    capsys.readouterr()
    assert main(["--root", str(host.root), "--json", "types", *(["--gpu", str(gpu)] if gpu else [])]) == 0
    return json.loads(capsys.readouterr().out)


def same(agent, host, capsys, gpu=None) -> dict:
    """``{name: AVAIL}`` of ``gpu``'s types once the agent's document (whole and for ``gpu``) equals the CLI's."""
    doc = agent_types(agent, gpu)
    assert doc == cli_types(host, capsys, gpu)
    assert agent_types(agent) == cli_types(host, capsys)
    return {e["name"]: e["available_instances"] for e in doc["types"]}


def cli(host, *argv) -> int:
    return main(["--root", str(host.root), *argv])


def test_a_mixed_size_vendor_vfio_l40s_offers_through_the_agent_what_the_cli_counts_and_the_driver_takes(
        make_host, capsys):
    """Trial 8 T3: an empty L40S in mixed-size mode offered 12 L40S-4Q through the agent (the CLI and the
    driver: 8), 9 with an 8Q and a 4Q on it (5).  The mode is turned on outside the agent, after its answer
    was kept: the kept answer is not served again."""
    host = make_host("l40s-vendor-vfio")
    store = StateStore(host.state_dir)
    agent = api.Agent(host)
    equal = same(agent, host, capsys, L40S)
    assert (equal["L40S-4Q"], equal["L40S-16A"]) == (12, 3)                      # equal-size maxima
    hits = agent.cache_hits
    assert agent_types(agent, L40S)["types"] and agent.cache_hits == hits + 1     # the kept answer, served
    assert cli(host, "--local", "vgpu", "mode", "--gpu", str(L40S), "--mixed-size", "on") == 0
    mixed = same(agent, host, capsys, L40S)
    assert (mixed["L40S-4Q"], mixed["L40S-16A"]) == (8, 2)                       # mixed-size maxima
    # an 8Q and a 4Q: the free placement ids leave room for five more 4Q (not the 12 - 3 framebuffer allows)
    create(host, store, profile="L40S-8Q", gpu=L40S)
    create(host, store, profile="L40S-4Q", gpu=L40S)
    held = same(agent, host, capsys, L40S)
    assert (held["L40S-4Q"], held["L40S-8Q"]) == (5, 2)
    # the truth: 4Q vGPUs until the driver's placement refuses one
    made = 0
    while True:
        try:
            create(host, store, profile="L40S-4Q", gpu=L40S)
        except RefusedError:
            break
        made += 1
    assert made == held["L40S-4Q"] == 5
    full = same(agent, host, capsys, L40S)
    assert not full.get("L40S-4Q") and not full.get("L40S-8Q"), full    # the free VFs list them no more
    assert len(store.vgpu_records(gpu=str(L40S))) == 7


def test_a_mig_on_demand_gpu_offers_through_the_agent_the_instances_a_start_would_make(make_host, capsys):
    """Trial 8 T3: an H200 opted in to MIG on demand with no GPU instance listed no MIG-backed type
    through the agent (the CLI: H200X-1-18C 7).  The opt-in is made outside the agent after its answer
    was kept; then domain starts through the hook make GPU instances until the GPU is full."""
    host = make_host("h200-mig-on")
    agent = api.Agent(host)
    before = same(agent, host, capsys, H200)
    hits = agent.cache_hits
    agent_types(agent, H200)
    assert agent.cache_hits == hits + 1                                           # the kept answer, served
    assert not before.get("H200X-1-18C") and not before.get("H200X-7-141C")     # no GPU instance, not opted in
    assert cli(host, "--local", "mig", "on-demand", "--gpu", str(H200), "on") == 0
    opted = same(agent, host, capsys, H200)
    assert (opted["H200X-1-18C"], opted["H200X-7-141C"], opted["H200X-3-71C"]) == (7, 1, 2)
    # the CLI's note says why; the agent's document is the same one the note goes with
    capsys.readouterr()
    assert cli(host, "types", "--gpu", str(H200)) == 0
    assert f"{H200}: MIG on demand: AVAIL of " in capsys.readouterr().out
    # the truth: starts of H200X-1-18C domains, each on its own VF, until one is refused
    started = 0
    for i, vf in enumerate(vfs(host)):
        uuid = f"11111111-2222-4333-8444-{i:012x}"
        code = hook_run(host, f"od{i}", "prepare", "begin", vm_xml(f"od{i}", uuid, "H200X-1-18C", vf))
        if code != 0:
            assert code == 2
            break
        started += 1
        if started == 3:
            assert same(agent, host, capsys, H200)["H200X-1-18C"] == 4
    assert started == opted["H200X-1-18C"] == 7 and len(gis(host)) == 7
    full = same(agent, host, capsys, H200)
    assert full["H200X-1-18C"] == 0 and full["H200X-7-141C"] == 0                 # listed with 0
    assert cli(host, "--local", "mig", "on-demand", "--gpu", str(H200), "off") == 0
    assert "H200X-7-141C" not in same(agent, host, capsys, H200)


def test_the_shared_builder_spells_mig_on_demands_names_as_ops_does():
    """present/inventory.py names the opt-in's hint file and settings prefix itself (a lean `types` start
    imports no ops.migdemand where no GPU may be opted in): the same spellings."""
    assert (present.ON_DEMAND_HINT, present.ON_DEMAND_PREFIX) == (migdemand.HINT_FILE, migdemand.ON)


def test_capacity_for_a_profile_no_gpu_offers_is_refused_as_the_cli_refuses_it(make_host, capsys):
    """Trial 8 T8: `GET /v1/capacity?profile=NOPE` answered 200 with no rows; the CLI exits 2 with one line.
    Both now refuse it (the agent: 400, its line), for the tenant socket's answer too; a known profile
    is answered as before."""
    host = make_host("a40-mdev")
    agent = api.Agent(host)
    capsys.readouterr()
    assert cli(host, "capacity", "--profile", "NOPE") == 2
    assert "no GPU here offers 'NOPE'" in capsys.readouterr().err
    assert cli(host, "tenant", "add", "t1") == 0
    for call, role, tenant in ((api.get_capacity, api.READ, None), (api.tenant_capacity, api.TENANT, "t1")):
        with pytest.raises(InputError) as e:
            call(agent, api.Request({}, {"profile": "NOPE"}, None, "test", 1, role, tenant))
        doc = server.error_doc(server.status_of(e.value), e.value.message, hint=e.value.hint)
        assert doc["status"] == 400 and doc["error"]["exit_code"] == 2
        assert doc["error"]["line"].startswith("no GPU here offers 'NOPE'; ") and "\n" not in doc["error"]["line"]
    ok = json.loads(api.get_capacity(agent, api.Request({}, {"profile": "a40-8q"}, None, "test", 1, api.READ)).body)
    assert [p["profile"] for p in ok["profiles"]] == ["A40-8Q"] and ok["profiles"][0]["fits"] > 0
