"""`analysis.load.layer_type.layer_type`: a fused layer is typed by what it fused, also in stores
written before the runner recorded `Conv+Relu` as the op type."""

from __future__ import annotations

import pandas as pd

from analysis.load.layer_type import layer_type


def test_old_store_rows_get_their_fused_type() -> None:
    rows = pd.DataFrame(
        {
            "op_type": ["Conv", "Conv+Relu", "Gemm", None, "MaxPool"],
            "kind": ["Conv", "Conv+Relu", "Gemm", "Softmax", "MaxPool"],
            "original_op_types": [
                ["Conv", "Relu"],  # older runner: ORT's op only
                ["Conv", "Relu"],  # current runner
                ["Gemm"],  # one node: its own type
                None,  # no mapping recorded: the span's kind
                float("nan"),
            ],
        }
    )
    assert list(layer_type(rows)) == ["Conv+Relu", "Conv+Relu", "Gemm", "Softmax", "MaxPool"]


def test_stores_without_the_column_keep_the_op_type() -> None:
    rows = pd.DataFrame({"op_type": ["Conv", None], "kind": ["Conv", "Relu"]})
    assert list(layer_type(rows)) == ["Conv", "Relu"]
