"""The MIG planner and placement, pure: tested on hand-built profile and instance values.

The first two tests moved here from tests/test_mig.py with vgpuhost.plan.mig.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from vgpuhost.plan import mig
from vgpuhost.model.errors import RefusedError
from vgpuhost.sim.nvml import SimNvml
from test_mig import GPU, H200_ON, h200  # noqa: F401 (the fixture)


def test_planner_places_larger_profiles_first_and_returns_valid_placements(h200):
    profiles = SimNvml(h200).gi_profiles(GPU)
    by_name = {p.name: p for p in profiles}
    plain = [p for p in profiles if not p.name.endswith("+me")]
    # every count vector within the max counts: place() succeeds exactly when why_not is None,
    # and what it returns is a valid placement
    for counts in itertools.product(*(range(p.max_count + 1) for p in plain)):
        wanted = {p.profile_id: n for p, n in zip(plain, counts) if n}
        found = mig.place(profiles, wanted)
        assert (found is not None) == (mig.why_not(profiles, wanted) is None)
        if found is None:
            continue
        occ, comp = 0, 0
        for p, start in found:
            size = dict(p.placements)[start]
            mask = ((1 << size) - 1) << start
            assert not occ & mask
            occ |= mask
            comp += p.slices
        assert comp <= 7 and Counter(p.profile_id for p, _ in found) == Counter(
            {k: v for k, v in wanted.items()})
    found = mig.place(profiles, {by_name["3g.71gb"].profile_id: 1, by_name["2g.35gb"].profile_id: 1,
                                 by_name["1g.18gb"].profile_id: 2})
    assert found[0][0].name == "3g.71gb"


def test_planner_names_a_layout_with_no_placement():
    from vgpuhost.model.nvml import GiProfile
    odd = [GiProfile(1, "1g.2gb", 1, 2048, 2, ((1, 2),)), GiProfile(2, "2g.2gb", 2, 2048, 2, ((0, 2), (2, 2))),
           GiProfile(3, "7g.16gb", 7, 16384, 1, ((0, 8),))]
    assert mig.place(odd, {1: 1, 2: 1}) is None
    assert "has no placement: 1g.2gb starts at 1, 2g.2gb starts at 0/2" in mig.why_not(odd, {1: 1, 2: 1})
    with pytest.raises(RefusedError, match="has no placement"):
        mig.plan_layout(odd, [], {1: 1, 2: 1})


# ---------------------------------------------------------------------------
# hand-built values (no simulated tree)

from vgpuhost.model.nvml import GiProfile, GpuInstance                  # noqa: E402
from vgpuhost.model.values import PciAddress                             # noqa: E402
from vgpuhost.plan.steps import CreateGi, DestroyGi, SetMigMode          # noqa: E402

G = PciAddress.parse("0000:41:00.0")
#: an H200-like device: 7 compute slices over 8 memory slices
P1 = GiProfile(19, "1g.18gb", 1, 16384, 7, tuple((s, 1) for s in range(7)))
P2 = GiProfile(14, "2g.35gb", 2, 33792, 3, ((0, 2), (2, 2), (4, 2)))
P3 = GiProfile(9, "3g.71gb", 3, 69632, 2, ((0, 4), (4, 4)))
P7 = GiProfile(0, "7g.141gb", 7, 143360, 1, ((0, 8),))
H200 = [P1, P2, P3, P7]


def test_the_same_layout_plans_nothing():
    current = [GpuInstance(1, 9, 4, 4), GpuInstance(2, 19, 0, 1)]
    lp = mig.plan_layout(H200, current, {9: 1, 19: 1}, G)
    assert lp.steps == [] and lp.keep == current


def test_wanted_instances_are_kept_and_only_the_rest_changes():
    current = [GpuInstance(1, 9, 4, 4), GpuInstance(2, 14, 0, 2)]
    lp = mig.plan_layout(H200, current, {9: 1, 19: 2}, G)
    assert lp.keep == [GpuInstance(1, 9, 4, 4)]
    assert lp.destroy == [DestroyGi(G, 2, "2g.35gb", 0, 2, 14)]
    assert [type(s) for s in lp.steps] == [DestroyGi, CreateGi, CreateGi]       # destroy first
    assert all(s.gpu == G and s.profile_id == 19 and s.size == 1 for s in lp.create)
    assert {s.start for s in lp.create} <= {0, 1, 2, 3}                           # beside the kept 3g at 4-7
    assert lp.steps[1].describe() == ("nvmlDeviceCreateGpuInstanceWithPlacement 1g.18gb (profile id 19) at "
                                      f"memory slice {lp.create[0].start} (size 1)")


def test_a_layout_that_does_not_fit_beside_the_kept_ones_is_rebuilt():
    # a 3g at slices 0-3 and a 2g at 6... wanting a 7g: nothing can be kept
    current = [GpuInstance(1, 9, 0, 4), GpuInstance(2, 19, 6, 1)]
    lp = mig.plan_layout(H200, current, {0: 1}, G)
    assert lp.keep == [] and [d.gi_id for d in lp.destroy] == [1, 2]
    assert lp.create == [CreateGi(G, 0, "7g.141gb", 0, 8)]


def test_a_layout_over_the_slices_is_refused_before_any_step():
    with pytest.raises(RefusedError, match=r"needs 9 of 7 compute slices|exceeds|memory slices"):
        mig.plan_layout(H200, [], {9: 2, 19: 3}, G)


def test_mode_change_destroys_instances_first_and_undoes_by_value():
    current = [GpuInstance(3, 9, 0, 4), GpuInstance(4, 19, 4, 1)]
    steps = mig.plan_mode_change(G, H200, current, False)
    assert steps == [DestroyGi(G, 3, "3g.71gb", 0, 4, 9), DestroyGi(G, 4, "1g.18gb", 4, 1, 19),
                     SetMigMode(G, False)]
    assert [s.describe() for s in steps][-1] == "nvmlDeviceSetMigMode disable"
    # each step says how it is undone, from values alone
    assert steps[0].inverse(None) == CreateGi(G, 9, "3g.71gb", 0, 4)
    assert steps[2].inverse((False, False)) == SetMigMode(G, True)
    assert mig.plan_mode_change(G, H200, [], True) == [SetMigMode(G, True)]
