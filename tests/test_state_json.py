"""The state store's JSON writer (``json_text``): json.dumps's text, byte for byte, without importing json."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from vgpuhost.io.state import json_text

SCALARS = st.none() | st.booleans() | st.integers() | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(VALUES, st.booleans())
def test_json_text_is_json_dumps(value, sort_keys):
    assert json_text(value, sort_keys=sort_keys) == json.dumps(value, sort_keys=sort_keys)


def test_escapes_and_what_it_hands_to_json():
    s = "a\"b\\c\n\t\x00\x1f\x7f é \u2028 \U0001F600 ~"
    assert json_text([s, {"k": s}]) == json.dumps([s, {"k": s}])
    assert json_text({"b": 1, "a": [True, None]}, sort_keys=True) == '{"a": [true, null], "b": 1}'
    for other in (1.5, {1: "x"}, {"x": float("nan")}, [b"x"][:0]):
        assert json_text(other) == json.dumps(other)
