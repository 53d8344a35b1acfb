"""Mixed-size pools (issue 30 item 2): the pool option, its refusals, and the planner that switches only
empty GPUs (pure planner on hand-built HostViews, as tests/test_layout_planner.py builds them)."""

from __future__ import annotations

import pytest

from tests.test_layout_planner import A40, A40B, DOMAIN, Host, cfg, vgpu_entry
from vgpuhost.model.errors import InputError
from vgpuhost.model.nvml import SchedulerState
from vgpuhost.plan.layout import LayoutSetMixedSize, plan

EQUAL = SchedulerState("equal-share", arr=True)      # what the pool's scheduler block asks: no scheduler step
POOL = ("        scheduler: {policy: equal-share}\n"
        "        pool: {name: desk, mixed_size: true}\n")


def test_a_mixed_size_pool_turns_the_mode_on_on_an_empty_gpu():
    c = cfg(vgpu_entry("{A40-8Q: 0}", extra=POOL))
    [e] = c.layouts["main"].entries
    assert e.pool.mixed_size and e.vgpu.mixed_size is True
    p = plan(c, None, Host().a40(mixed_size=False, scheduler=EQUAL).view())
    [step] = [s for s in p.steps if isinstance(s, LayoutSetMixedSize)]
    assert step.on is True and step.target == str(A40)
    assert p.blocked == []


def test_a_busy_gpu_keeps_its_mode_and_the_plan_says_why():
    h = Host().a40(mixed_size=False, scheduler=EQUAL, active_vgpus=1)
    h.a40(A40B, group=32, mixed_size=False, scheduler=EQUAL)
    h.vgpu(A40, "A40-8Q", owner=DOMAIN)
    h.running = {DOMAIN: "vm1"}
    p = plan(cfg(vgpu_entry("{A40-8Q: 0}", extra=POOL)), None, h.view())
    assert [s.target for s in p.steps if isinstance(s, LayoutSetMixedSize)] == [str(A40B)]   # the empty one only
    assert p.blocked == []
    assert any(n.startswith(f"{A40} keeps mixed-size mode off for pool 'desk': it holds 1 vGPU(s)")
               for n in p.notes), p.notes
    assert "keeps mixed-size mode off" in p.text()


@pytest.mark.parametrize("body, message", [
    ("        scheduler: {policy: fixed-share}\n        pool: {name: gold, mixed_size: true}\n",
     "pool 'gold' is fixed-share, and NVIDIA has no fixed share in mixed-size mode"),
    ("          mixed_size: false\n" + POOL, "vgpu.mixed_size: false in mixed-size pool 'desk'"),
    ("        scheduler: {policy: equal-share}\n        pool: {name: desk, mixed_size: yes please}\n",
     "mixed_size"),
])
def test_config_refusals(body, message):
    with pytest.raises(InputError) as e:
        cfg(vgpu_entry("{A40-8Q: 0}", extra=body))
    assert message in str(e.value)
    assert str(e.value).startswith("layout.yaml:")


def test_two_entries_of_one_pool_agree_on_the_mode():
    body = (vgpu_entry("{A40-8Q: 0}", select="{address: '0000:81:00.0'}", extra=POOL)
            + vgpu_entry("{A40-8Q: 0}", select="{address: '0000:82:00.0'}",
                         extra="        scheduler: {policy: equal-share}\n        pool: {name: desk}\n"))
    with pytest.raises(InputError) as e:
        cfg(body)
    assert "a pool has one vGPU mode" in str(e.value)
