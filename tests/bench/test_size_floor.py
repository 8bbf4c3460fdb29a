"""The pieces of `bench/size_floor.py` (`proxy_overhead.py --sizes`) that its numbers rest on.

The sizes are what they say each way, the REST body is one the sidecar's own KServe v2 HTTP
decoder reads back as add_sub's two inputs, and the split-frame measure cuts the same bytes two
ways: whole frames, and reads that end inside frames. No Triton: the smoke runs in
test_bench_smoke.py run the bench against one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import size_floor

from sidecar.backends import http_message
from sidecar.backends.triton import decode_http_model_infer


@pytest.mark.parametrize(
    ("text", "size"),
    [("16", 16), ("49152", 49152), ("48K", 49152), ("2M", 2 * 1024 * 1024), ("20", 16)],
)
def test_sizes_read_as_bytes_each_way(text: str, size: int) -> None:
    assert size_floor.parse_size(text) == size


def test_a_size_below_two_fp32_inputs_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="at least 8 bytes"):
        size_floor.parse_size("4")


@pytest.mark.parametrize("size", [16, 49152])
def test_the_grpc_request_carries_size_bytes_of_tensors(size: int) -> None:
    req = size_floor.grpc_request(size)
    assert sum(len(raw) for raw in req.raw_input_contents) == size  # type: ignore[attr-defined]


@pytest.mark.parametrize("size", [16, 49152])
def test_the_rest_body_is_what_the_sidecars_decoder_reads_as_add_subs_inputs(size: int) -> None:
    body, headers = size_floor.http_request(size)
    json_length = int(headers["Inference-Header-Content-Length"])
    assert len(body) - json_length == size  # the binary tensors, after the JSON header
    message = http_message.pack(body, json_length, target="/v2/models/add_sub/infer")
    decoded = decode_http_model_infer(message)
    assert sorted(decoded.inputs) == ["INPUT0", "INPUT1"]
    for array in decoded.inputs.values():
        assert array.dtype == np.float32 and array.shape == (size // 8,)


def test_aligned_chunks_end_on_frames_and_fixed_reads_cut_them() -> None:
    out, back, preface = size_floor.large_connection(256 * 1024, calls=2)
    for data, start in ((out, preface), (back, 0)):
        aligned = size_floor.frame_aligned(data, start, 65536)
        split = size_floor.fixed_reads(data, start, 65536)
        assert b"".join(aligned) == b"".join(split) == data[start:]
        ends = set()
        pos = start
        while pos < len(data):
            pos += 9 + int.from_bytes(data[pos : pos + 3], "big")
            ends.add(pos)
        cuts = [start + sum(len(c) for c in aligned[: i + 1]) for i in range(len(aligned))]
        assert set(cuts) <= ends  # every aligned chunk ends where a frame ends
        split_cuts = [start + sum(len(c) for c in split[: i + 1]) for i in range(len(split))]
        assert set(split_cuts[:-1]) - ends  # some reads end inside a frame


@pytest.mark.parametrize("sampling", [False, True])
def test_both_cuts_are_scanned_whole(sampling: bool) -> None:
    """`scan_us_per_call` raises unless every call was observed to its end."""
    out, back, preface = size_floor.large_connection(256 * 1024, calls=3)
    for cut in (size_floor.frame_aligned, size_floor.fixed_reads):
        chunks = cut(out, preface, 65536), cut(back, 0, 65536)
        assert size_floor.scan_us_per_call(*chunks, out[:preface], 3, sampling) > 0
