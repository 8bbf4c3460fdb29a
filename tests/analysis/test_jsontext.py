"""`analysis.render.jsontext.dumps` writes the text of `json.dumps(..., indent=n)`, byte for
byte."""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.render import jsontext

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.datetimes()  # not JSON: written by `default`
)
KEYS = (
    st.text()
    | st.integers()
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False, allow_infinity=False)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(KEYS, inner, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(VALUES, st.integers(min_value=0, max_value=4))
def test_same_text_as_the_standard_encoder(value: Any, indent: int) -> None:
    want = json.dumps(value, indent=indent, default=str, allow_nan=False)
    assert jsontext.dumps(value, indent=indent, default=str) == want


def test_a_report_shaped_document() -> None:
    doc = {
        "meta": {"traces": 3, "generated": datetime.datetime(2026, 11, 25)},
        "A1": {"status": "ok", "table": [{"model": "m", "ms": 1.5, "n": None}, {}], "notes": []},
        "nested": [[1, [2, {"a": [3.25e-9, "é\n"]}]], {"k": {}}],
        "keys": {3: "three", 2.5: "two and a half", False: "no", None: "none"},
    }
    assert jsontext.dumps(doc, default=str) == json.dumps(
        doc, indent=1, default=str, allow_nan=False
    )


@pytest.mark.parametrize("bad", [math.nan, [1, math.inf], {"a": {"b": -math.inf}}])
def test_refuses_what_json_cannot_hold(bad: Any) -> None:
    with pytest.raises(ValueError):
        json.dumps(bad, indent=1, allow_nan=False)
    with pytest.raises(ValueError):
        jsontext.dumps(bad)
