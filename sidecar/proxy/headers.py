"""HPACK for the relay: one decoder per direction, and header fields we may append.

Every header block of a direction must be decoded, in order, to keep the dynamic table in
step with the two peers. The table size a decoder may grow to is bounded by the
SETTINGS_HEADER_TABLE_SIZE the *receiving* peer announced, effective once the sending peer
acknowledged it (see `streams.py`).

Fields the relay adds (a W3C `traceparent` on sampled requests) are encoded as *literal header
fields without indexing* (RFC 7541 6.2.2): neither peer's dynamic table changes, so appending
them to a block never desynchronises anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from hpack import Decoder, HPACKError

from sidecar.proxy.frames import ScanError

DEFAULT_TABLE_SIZE = 4096
MAX_HEADER_LIST_SIZE = 1 << 24  # the relay is not the one to enforce header limits

RawHeaders = list[tuple[bytes, bytes]]


CACHE_ENTRIES = 64
S = TypeVar("S")


class HeaderDecoder(Generic[S]):
    """Decodes the header blocks of one direction, keeping the HPACK table in step.

    `decode` returns the raw header list and `summarize(headers)` (what the caller extracts
    from it). gRPC peers send the same few blocks over and over, fully indexed once the
    dynamic table has warmed up. A block whose decoding left the dynamic table unchanged
    decodes to the same result for as long as the table stays unchanged, so such results are
    cached until a block changes the table; a cache hit skips HPACK entirely. Callers must not
    mutate what is returned.
    """

    def __init__(self, summarize: Callable[[RawHeaders], S]) -> None:
        self._decoder = Decoder(max_header_list_size=MAX_HEADER_LIST_SIZE)
        self._table = self._decoder.header_table
        self._summarize = summarize
        self._cache: dict[bytes, tuple[RawHeaders, S]] = {}

    def decode(self, block: bytes) -> tuple[RawHeaders, S]:
        """Decode one complete header block: (raw (name, value) pairs, summary)."""
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        table = self._table
        entries = table.dynamic_entries
        first = entries[0] if entries else None  # held: its identity cannot be reused
        before = (len(entries), table._current_size, table.maxsize)
        try:
            headers: RawHeaders = self._decoder.decode(block, raw=True)  # type: ignore[assignment]
        except HPACKError as exc:
            self._cache.clear()
            raise ScanError("hpack", str(exc)) from None
        result = (headers, self._summarize(headers))
        after_first = entries[0] if entries else None
        if after_first is first and before == (len(entries), table._current_size, table.maxsize):
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[block] = result
        elif self._cache:
            self._cache.clear()  # the table changed: cached results may be stale
        return result

    def set_max_table_size(self, size: int) -> None:
        """Apply an acknowledged SETTINGS_HEADER_TABLE_SIZE of the receiving peer."""
        self._decoder.max_allowed_table_size = size
        self._cache.clear()

    @property
    def table_size(self) -> int:
        return int(self._decoder.header_table_size)


def _encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 5.1 integer with an N-bit prefix; `first` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_string(raw: bytes) -> bytes:
    return _encode_int(len(raw), 7) + raw  # not Huffman-coded


def encode_literal_without_indexing(fields: Iterable[tuple[str | bytes, str | bytes]]) -> bytes:
    """HPACK bytes for header fields that leave both dynamic tables untouched."""
    out = bytearray()
    for name, value in fields:
        name_b = name.encode("ascii") if isinstance(name, str) else name
        value_b = value.encode("latin-1") if isinstance(value, str) else value
        if name_b != name_b.lower() or not name_b:
            raise ValueError(f"HTTP/2 header names must be non-empty lowercase: {name_b!r}")
        out.append(0x00)  # literal without indexing, new name
        out += _encode_string(name_b)
        out += _encode_string(value_b)
    return bytes(out)
