"""The vGPU create request value (:class:`vgpuhost.ops.vgpu.VgpuCreateRequest`): parsed once, shared
by the click command, the agent's ``POST /v1/vgpus`` and ops."""

from __future__ import annotations

import dataclasses

import pytest

from vgpuhost.agent.api import _VGPU_KEYS
from vgpuhost.model.errors import InputError
from vgpuhost.model.values import PciAddress, VgpuProfile
from vgpuhost.ops.vgpu import VgpuCreateRequest

UUID = "8f01c7a2-5b1e-4c3d-9a7f-0123456789ab"


def test_parse_normalises_and_the_value_is_frozen():
    gpu = PciAddress.parse("0000:81:00.0")
    req = VgpuCreateRequest.parse("A40-8Q", gpu="0000:81:00.0", uuid=UUID.upper(), allowed_gpus=[gpu])
    assert req.gpu == gpu and req.uuid == UUID and req.allowed_gpus == frozenset({gpu})
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.profile = "A40-4Q"


@pytest.mark.parametrize("fields,message", [
    ({"strategy": "random"}, "unknown placement strategy"),
    ({"uuid": UUID, "vf": "0000:81:00.4"}, "not both"),
    ({"params": "not pairs"}, "key=value"),
    ({"anti_affinity": "-bad key"}, "not a valid key"),
])
def test_parse_refuses_what_no_host_could_take(fields, message):
    with pytest.raises(InputError, match=message):
        VgpuCreateRequest.parse("A40-8Q", **fields)


def test_the_profile_is_parsed_once_into_a_value():
    req = VgpuCreateRequest.parse(" a100-1-5cme")
    assert req.profile == VgpuProfile("A100", 5, "C", 1, True) and req.body()["profile"] == "A100-1-5CME"
    assert VgpuCreateRequest.parse(req.profile) == req
    with pytest.raises(InputError, match="invalid vGPU profile name"):
        VgpuCreateRequest.parse("no such thing!")


def test_persist_of_a_mig_backed_profile_is_refused_before_anything_is_read():
    with pytest.raises(InputError, match="MIG-backed"):
        VgpuCreateRequest.parse("H200X-1-18C", persist=True)


def test_the_cli_body_is_what_the_agent_route_reads():
    """The CLI forwards ``body()``; its keys are the route's (``dry_run`` is the call's, not the request's)."""
    body = VgpuCreateRequest.parse("A40-8Q", gpu="0000:81:00.0", numa_node=1, persist=True).body()
    assert set(body) == set(_VGPU_KEYS) - {"dry_run"}
    assert body["gpu"] == "0000:81:00.0" and body["numa_node"] == 1 and body["persist"] is True


def test_the_agent_reads_back_the_body_the_cli_forwards():
    """``from_json(body())`` is the same request: one parse for click's options and the agent's JSON."""
    req = VgpuCreateRequest.parse("a100-1-5cme", gpu="0000:81:00.0", uuid=UUID, strategy="best-fit", numa_node=1,
                                  anti_affinity="db", params="frame_rate_limiter=0", create_gi=True)
    assert VgpuCreateRequest.from_json(req.body()) == req
    assert tuple(req.body()) == VgpuCreateRequest.JSON_KEYS


@pytest.mark.parametrize("body, line", [
    ({}, "the request needs 'profile'"),
    ({"profile": 8}, "'profile' must be a string"),
    ({"profile": "A40-8Q", "numa_node": True}, "'numa_node' must be a whole number"),
    ({"profile": "A40-8Q", "persist": "true"}, "'persist' must be true or false"),
    ({"profile": "A40-8Q", "gpu": "x" * 33}, "'gpu' must be a string of at most 32"),
    ({"profile": "A40-8Q", "owner": "nobody"}, "invalid owner"),
])
def test_a_bad_json_body_is_one_line_naming_the_key(body, line):
    with pytest.raises(InputError) as e:
        VgpuCreateRequest.from_json(body)
    assert e.value.one_line().startswith(line), e.value.one_line()
