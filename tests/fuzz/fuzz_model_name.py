"""Fuzz target: a unary request's model name, C (`_framewalk.extract_model_name`) against
Python (`model_name.extract_model_name`): the same name, None or NEED_MORE on every head.

Input: [path index: 1 byte] [the request's first bytes: a gRPC message prefix and protobuf].
"""

from __future__ import annotations

from tests.fuzz.common import Reader, instrumented, main

with instrumented(__name__ == "__main__"):
    from tests.proxy.test_model_name_c import same

# the field paths test_model_name_c draws from: ModelInferRequest.model_name (1,), TF-Serving's
# PredictRequest.model_spec.name (1, 1), and others, out of range ones included
PATHS = [(1,), (1, 1), (2,), (1, 2), (1, 1, 1), (0,), (2**60,), (3, 1)]


def check(data: bytes) -> None:
    reader = Reader(data)
    path = PATHS[reader.uint(1) % len(PATHS)]
    same(reader.rest(), path)


if __name__ == "__main__":
    main(check)
