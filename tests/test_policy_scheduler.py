"""The vGPU scheduler's pure part: the RmPVMRL encoder/decoder (docs/reference/hardware.md#vgpu-scheduling) and validation.

Moved from tests/test_scheduler.py with vgpuhost.policy.scheduler."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpuhost.policy import scheduler as sch
from vgpuhost.model.errors import InputError
from vgpuhost.model.nvml import SchedulerState

S = SchedulerState


# =============================================================================
# encoder / decoder

# every value docs/reference/hardware.md#vgpu-scheduling documents, with its documented meaning
DOCUMENTED = [
    (0x00, S("best-effort")),
    (0x01, S("equal-share", arr=True)),
    (0x11, S("fixed-share", arr=True)),
    (0x3C3C0001, S("equal-share", arr=True, frequency_hz=960, avg_factor=60)),
    (0x00030003, S("equal-share", arr=False, timeslice_ms=3)),
]


@pytest.mark.parametrize("value,state", DOCUMENTED, ids=[f"0x{v:08x}" for v, _ in DOCUMENTED])
def test_documented_values_decode_and_round_trip(value, state):
    assert sch.decode(value) == state
    assert sch.encode(state) == value
    assert sch.encode(sch.decode(value)) == value


def test_documented_meanings_in_words():
    assert sch.describe(sch.decode(0x00)) == "best effort"
    assert sch.describe(sch.decode(0x01)).startswith("equal share, ARR on")
    assert sch.describe(sch.decode(0x11)).startswith("fixed share, ARR on")
    assert sch.describe(sch.decode(0x3C3C0001)) == "equal share, ARR on, frequency 960 Hz, averaging factor 60"
    assert sch.describe(sch.decode(0x00030003)) == "equal share, ARR off, time slice 3 ms"


def test_overlapping_fields_are_read_by_the_arr_bit():
    # 0x3c3c0001: bits 21:12 = 0x3c0 = 960 Hz, bits 31:24 = 0x3c = 60; bits 23:16 (0x3c) are not a time slice
    assert (0x3C3C0001 >> 12) & 0x3FF == 960 and 0x3C3C0001 >> 24 == 60
    assert sch.decode(0x3C3C0001).timeslice_ms is None
    # 0x00030003: bit 1 set (no ARR) -> bits 23:16 = 3 ms; bits 21:12 (0x30) are not a frequency
    assert sch.decode(0x00030003).frequency_hz is None


@pytest.mark.parametrize("state,message", [
    (S("equal-share", arr=False, timeslice_ms=40), "timeslice 40 ms out of range 1..30"),
    (S("equal-share", arr=False, timeslice_ms=0), "timeslice 0 ms out of range 1..30"),
    (S("fixed-share", arr=True, frequency_hz=62, avg_factor=1), "frequency 62 Hz out of range 63..960"),
    (S("fixed-share", arr=True, frequency_hz=961, avg_factor=1), "frequency 961 Hz out of range 63..960"),
    (S("equal-share", arr=True, frequency_hz=480, avg_factor=61), "averaging factor 61 out of range 1..60"),
    (S("equal-share", arr=True, frequency_hz=480, avg_factor=0), "averaging factor 0 out of range 1..60"),
])
def test_out_of_range_refused_with_the_valid_range(state, message):
    with pytest.raises(InputError) as ei:
        sch.encode(state)
    assert message in ei.value.message


@pytest.mark.parametrize("state", [
    S("best-effort", timeslice_ms=2),
    S("best-effort", arr=True),
    S("equal-share", arr=True, timeslice_ms=2),
    S("equal-share", arr=False, frequency_hz=480),
    S("round-robin"),
])
def test_inconsistent_states_refused(state):
    with pytest.raises(InputError):
        sch.encode(state)


@pytest.mark.parametrize("value,problem", [
    (0x10, "bit 0 is clear"),
    (0x21, "policy 2"),
    (0x001F0003, "timeslice 31 ms out of range 1..30"),
    (0x003F3001, "frequency 1011 Hz out of range 63..960"),
    (0x3D000001, "averaging factor 61 out of range 1..60"),
    (0x01030003, "averaging factor (bits 31:24) is set but applies only with ARR"),
    (0x00C00001, "reserved bits 23:22"),
    (0x00000005, "reserved bit 2"),
])
def test_invalid_values_refused_by_decode_and_named_by_explain(value, problem):
    with pytest.raises(InputError) as ei:
        sch.decode(value)
    assert problem in ei.value.message
    assert problem in sch.explain(value)


def test_decode_rejects_non_dwords():
    for bad in (-1, 1 << 32, True):
        with pytest.raises(InputError):
            sch.decode(bad)
    assert sch.parse_value("0x3c3c0001") == sch.parse_value("1010565121") == 0x3C3C0001
    with pytest.raises(InputError):
        sch.parse_value("0x1_0000_0000")


def _opt(rng):
    return st.one_of(st.none(), st.integers(*rng))


VALID_STATES = st.one_of(
    st.just(S("best-effort")),
    st.builds(S, st.sampled_from(["equal-share", "fixed-share"]), st.just(True), st.none(),
              _opt(sch.FREQUENCY_RANGE), _opt(sch.AVG_FACTOR_RANGE)),
    st.builds(S, st.sampled_from(["equal-share", "fixed-share"]), st.just(False), _opt(sch.TIMESLICE_RANGE),
              st.none(), st.none()),
)


@settings(max_examples=400, deadline=None)
@given(VALID_STATES)
def test_round_trip_over_the_valid_domain(state):
    value = sch.encode(state)
    assert 0 <= value <= 0xFFFFFFFF
    assert sch.decode(value) == state
    assert sch.explain(value).startswith(f"RmPVMRL=0x{value:08x}: {sch.describe(state)}")


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 0xFFFFFFFF))
def test_every_dword_decodes_or_is_refused_and_decoded_values_round_trip(value):
    try:
        state = sch.decode(value)
    except InputError:
        assert "problem:" in sch.explain(value)
        return
    # bit 3 (weighted scheduler off, R590/R595) is not part of the state: encode never sets it
    assert sch.encode(state) | (value & sch.WEIGHTED_DISABLE_BIT) == value


def test_weighted_scheduler_bit_3_decodes_and_is_not_reserved():
    """nvrm_registry.h of R590/R595 defines bit 3 as NV_REG_STR_RM_PVMRL_WEIGHTED (0 on, 1 off): 0x09 is
    equal share with ARR and the weighted scheduler off, not a reserved bit."""
    assert sch.problems(0x09) == []
    assert sch.decode(0x09) == S("equal-share", arr=True)
    assert sch.weighted_disabled(0x09) and not sch.weighted_disabled(0x01)
    assert sch.describe_value(0x09) == (sch.describe(S("equal-share", arr=True))
                                        + "; weighted scheduler off (bit 3, R590 and R595)")
    text = sch.explain(0x09)
    assert text.startswith(f"RmPVMRL=0x00000009: {sch.describe_value(0x09)}")
    assert "bit 3      = 1      weighted scheduler off" in text and "R590 and R595" in text
    assert "problem" not in text
    doc = sch.explain_doc(0x09)
    assert doc["valid"] and doc["fields"]["weighted_disable"] == 1 and doc["state"]["policy"] == "equal-share"
    assert sch.explain_doc(0x01)["fields"]["weighted_disable"] == 0
    assert sch.explain_doc(0x00)["fields"]["weighted_disable"] is None     # best effort: bit 3 means nothing
    assert sch.decode(0x3C3C0009) == S("equal-share", arr=True, frequency_hz=960, avg_factor=60)


# =============================================================================
# persistent form


@pytest.mark.parametrize("text", ["\uff10", " 5x", "1_0", "-1", "+3", "0x", "0x123456789"])
def test_decode_takes_ascii_hex_or_decimal_only(text):
    from vgpuhost.model.errors import InputError
    from vgpuhost.policy.scheduler import parse_value
    with pytest.raises(InputError):
        parse_value(text)
