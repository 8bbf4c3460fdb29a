"""HPACK for the relay: one decoder per direction, and header fields we may append.

Every header block of a direction must be decoded, in order, to keep the dynamic table in
step with the two peers. The table size a decoder may grow to is bounded by the
SETTINGS_HEADER_TABLE_SIZE the *receiving* peer announced, effective once the sending peer
acknowledged it (see `streams.py`).

A block too large to hold (see `frames.py`) is walked by a `BlockSkimmer` instead: it applies
the block's effect on the dynamic table while holding at most one small string, so the table
stays in step although the block's fields are not read.

Fields the relay adds (a W3C `traceparent` on sampled requests) are encoded as *literal header
fields without indexing* (RFC 7541 6.2.2): neither peer's dynamic table changes, so appending
them to a block never desynchronises anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from hpack import Decoder, HPACKDecodingError, HPACKError
from hpack.huffman_table import decode_huffman

from sidecar.proxy.frames import ScanError

DEFAULT_TABLE_SIZE = 4096
MAX_HEADER_LIST_SIZE = 1 << 24  # the relay is not the one to enforce header limits

RawHeaders = list[tuple[bytes, bytes]]


CACHE_ENTRIES = 64
SKIM_STRING_LIMIT = 64 << 10  # longest string a skimmer holds
_STATIC_ENTRY_OVERHEAD = 32  # RFC 7541 4.1
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

    @property
    def cache(self) -> dict[bytes, tuple[RawHeaders, S]]:
        """The cached results, by block (the same dict for the decoder's life; callers only
        read it): the C frame walk looks the response direction's blocks up here."""
        return self._cache

    def reset(self) -> None:
        """Forget the dynamic table after a block could not be decoded (see `streams.py`).

        The table restarts empty at the largest size the peer may use: entries the peer adds
        from now on are its newest, and are evicted after any entry we never saw, so a block
        that refers only to them decodes exactly; one that refers to an older entry raises.
        """
        allowed = self._decoder.max_allowed_table_size
        self._decoder = Decoder(max_header_list_size=MAX_HEADER_LIST_SIZE)
        self._decoder.max_allowed_table_size = allowed
        self._decoder.header_table_size = allowed
        self._table = self._decoder.header_table
        self._cache.clear()

    def skimmer(self) -> BlockSkimmer:
        """A skimmer for one oversize block; its changes to the table invalidate the cache."""
        self._cache.clear()
        return BlockSkimmer(self._decoder)

    def set_max_table_size(self, size: int) -> None:
        """Apply an acknowledged SETTINGS_HEADER_TABLE_SIZE of the receiving peer."""
        self._decoder.max_allowed_table_size = size
        self._cache.clear()

    @property
    def table_size(self) -> int:
        return int(self._decoder.header_table_size)


def _decode_int(buf: bytes, pos: int, prefix_bits: int) -> tuple[int, int] | None:
    """RFC 7541 5.1 integer at `pos`: (value, end), or None when `buf` ends inside it."""
    limit = (1 << prefix_bits) - 1
    value = buf[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while pos < len(buf):
        byte = buf[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HPACKDecodingError("HPACK integer too long")
    return None


class BlockSkimmer:
    """Keeps a decoder's dynamic table in step through a header block too large to hold.

    Fed the block's bytes in order, it walks its HPACK representations holding at most one
    string of up to `limit` bytes: a field added with incremental indexing is added to the
    table, one too large for the table empties it (RFC 7541 4.4), size updates apply. `failed`
    is set (and the table is then unknown) when the block refers to an entry we do not have,
    or holds a string too long to hold yet possibly small enough for the table.
    """

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._table = decoder.header_table
        # A string longer than this, even Huffman-coded (>= 5 bits per octet... at most 30),
        # decodes to more than the table can hold.
        self.limit = min(4 * decoder.max_allowed_table_size + 16, SKIM_STRING_LIMIT)
        self._buf = b""
        self._skip = 0  # bytes still to pass of a string too long to hold
        self._stage = 0  # 0: at a representation, 1: its name string, 2: its value string
        self._adding = False  # the current representation adds an entry to the table
        self._name: bytes | None = None  # None: too large to hold
        self.failed = False

    @property
    def complete(self) -> bool:
        """The block ended on a representation boundary and nothing went wrong."""
        return not (self.failed or self._buf or self._skip or self._stage)

    def feed(self, data: bytes) -> None:
        if self.failed:
            return
        try:
            self._feed(data)
        except (HPACKError, IndexError, ValueError):
            self.failed = True
            self._buf = b""

    def _feed(self, data: bytes) -> None:
        if self._skip:
            take = min(self._skip, len(data))
            self._skip -= take
            data = data[take:]
            if self._skip:
                return
            self._string(None)
        buf = self._buf + data if self._buf else data
        i, n = 0, len(buf)
        while i < n:
            if self._stage == 0:
                first = buf[i]
                if first & 0x80:  # indexed field: no change to the table, but it must exist
                    got = _decode_int(buf, i, 7)
                    if got is None:
                        break
                    self._table.get_by_index(got[0])
                    i = got[1]
                    continue
                if first & 0xE0 == 0x20:  # dynamic table size update
                    got = _decode_int(buf, i, 5)
                    if got is None:
                        break
                    size, i = got
                    if size > self._decoder.max_allowed_table_size:
                        raise HPACKDecodingError("table size update over the allowed size")
                    self._table.maxsize = size
                    continue
                self._adding = bool(first & 0x40)
                got = _decode_int(buf, i, 6 if self._adding else 4)
                if got is None:
                    break
                index, i = got
                if index:
                    self._name = self._table.get_by_index(index)[0]
                    self._stage = 2
                else:
                    self._stage = 1
                continue
            got = _decode_int(buf, i, 7)
            if got is None:
                break
            length, j = got
            huffman = bool(buf[i] & 0x80)
            if length > self.limit:
                least = (8 * length - 7) // 30 if huffman else length  # octets it decodes to
                if self._adding and least + _STATIC_ENTRY_OVERHEAD <= self._table.maxsize:
                    raise HPACKDecodingError("string too long to hold, may fit the table")
                if length > n - j:
                    self._skip = length - (n - j)
                    self._buf = b""
                    return
                i = j + length
                self._string(None)
                continue
            if length > n - j:
                break
            raw = bytes(buf[j : j + length])
            i = j + length
            self._string(decode_huffman(raw) if huffman else raw)
        self._buf = bytes(buf[i:])

    def _string(self, value: bytes | None) -> None:
        if self._stage == 1:
            self._name = value
            self._stage = 2
            return
        self._stage = 0
        if not self._adding:
            return
        table = self._table
        if self._name is None or value is None:
            size = table.maxsize  # an entry larger than the table empties it
            table.maxsize = 0
            table.maxsize = size
        else:
            table.add(self._name, value)


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
