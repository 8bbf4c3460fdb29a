"""The last sampled request per model: known models only, a per-message cap, a byte budget."""

from __future__ import annotations

import threading

from sidecar.sampling.last_requests import (
    LAST_REQUEST_MAX_MESSAGE_BYTES,
    LAST_REQUESTS_MAX_BYTES,
    LastRequests,
)

MB = 1 << 20


def test_unknown_models_are_not_kept() -> None:
    last = LastRequests(lambda model: model == "real")
    assert not last.remember("made-up", "ModelInfer", b"x" * 100)
    assert last.remember("real", "ModelInfer", b"x" * 100)
    assert last.get("made-up") is None and last.get("real") == ("ModelInfer", b"x" * 100)
    assert last.get("never-seen") is None
    assert last.total_bytes == 100 and len(last) == 1


def test_a_message_over_the_cap_is_not_kept_and_evicts_nothing() -> None:
    last = LastRequests(max_total_bytes=10 * MB, max_message_bytes=4 * MB)
    assert last.remember("small", "ModelInfer", bytes(MB))
    assert not last.remember("huge", "ModelInfer", bytes(4 * MB + 1))
    assert last.remember("edge", "ModelInfer", bytes(4 * MB))  # exactly the cap is kept
    assert last.get("huge") is None and last.get("small") is not None
    assert last.total_bytes == 5 * MB


def test_the_least_recently_stored_are_evicted_to_stay_within_the_budget() -> None:
    last = LastRequests(max_total_bytes=10 * MB, max_message_bytes=4 * MB)
    for n in range(6):
        assert last.remember(f"m{n}", "ModelInfer", bytes(3 * MB))
        assert last.total_bytes <= 10 * MB
    assert len(last) == 3
    assert [last.get(f"m{n}") is not None for n in range(6)] == [False] * 3 + [True] * 3
    assert last.remember("m3", "ModelStreamInfer", bytes(MB))  # stored again: most recent
    assert last.remember("m6", "ModelInfer", bytes(3 * MB))  # fits without evicting
    assert last.remember("m7", "ModelInfer", bytes(3 * MB))  # evicts m4, the oldest now
    assert last.get("m4") is None and last.get("m3") == ("ModelStreamInfer", bytes(MB))
    assert last.total_bytes == 3 * MB + MB + 3 * MB + 3 * MB


def test_replacing_a_message_frees_the_old_one() -> None:
    last = LastRequests(max_total_bytes=10 * MB, max_message_bytes=8 * MB)
    assert last.remember("m", "ModelInfer", bytes(8 * MB))
    assert last.remember("m", "ModelInfer", bytes(1))
    assert last.total_bytes == 1 and len(last) == 1
    assert last.remember("other", "ModelInfer", bytes(8 * MB))  # nothing evicted: room again
    assert last.get("m") == ("ModelInfer", bytes(1))


def test_the_per_message_cap_never_exceeds_the_budget() -> None:
    last = LastRequests(max_total_bytes=MB, max_message_bytes=4 * MB)
    assert last.max_message_bytes == MB
    assert not last.remember("m", "ModelInfer", bytes(MB + 1))
    defaults = LastRequests()
    assert defaults.max_total_bytes == LAST_REQUESTS_MAX_BYTES
    assert defaults.max_message_bytes == LAST_REQUEST_MAX_MESSAGE_BYTES


def test_concurrent_writers_keep_the_byte_count_exact() -> None:
    last = LastRequests(max_total_bytes=64 * 1024, max_message_bytes=4096)

    def write(thread: int) -> None:
        for n in range(500):
            last.remember(f"m{(thread * 7 + n) % 40}", "ModelInfer", bytes(1 + (n * 37) % 4096))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = [last.get(f"m{n}") for n in range(40)]
    assert last.total_bytes == sum(len(k[1]) for k in kept if k is not None)
    assert last.total_bytes <= 64 * 1024
