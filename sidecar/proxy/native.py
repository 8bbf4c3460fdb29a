"""The relay's C extensions: the one switch that turns them off, which paths run, and every
Python name their C code reads or calls.

Four extensions sit on the relays' hot paths, each with a pure-Python reference that is also
the fallback (setup.py builds them where a C compiler exists):

- `_framewalk`: the frame walk (`frames.FrameScanner`'s fast branch, `streams`' DATA and
  cached-header bookkeeping);
- `_pump`: a relayed direction's `data_received` (`relay.py`'s is the reference);
- `_messagewalk`: an inference stream's message reading (`stream_messages.py`);
- `_httppump`: the HTTP relay's client `data_received` (`http/relay.py` and
  `http/request_reader.py` are the reference), with llhttp built in.

`XSP_NATIVE=off` (read once, at import) switches all four off: the relay then runs the
pure-Python paths only, as where the extensions are not built. The tests run whole both ways.

`INTERFACE` declares, for each extension, every Python attribute its C code reads or calls
(the extension's `NAMES`, interned once at its import) and the class it belongs to, as
"module:Class". tests/proxy/test_native_build.py compares the two and checks each name on its
class: renaming one on the Python side fails that test, not the hot path. No name starts
with an underscore.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENV = "XSP_NATIVE"
EXTENSIONS = ("_framewalk", "_pump", "_messagewalk", "_httppump")

_SCANNER = "sidecar.proxy.frames:FrameScanner"
_SINK = "sidecar.proxy.frames:FrameSink"
_TRACKER = "sidecar.proxy.streams:ConnectionTracker"
_METRICS = "sidecar.proxy.metrics:ProxyMetrics"
_CALL_STATS = "sidecar.proxy.metrics:CallStats"
_QUIET_END = "sidecar.proxy.streams:QuietEnd"
_QUICK = "sidecar.proxy.streams:QuickDecisions"
_METHOD = "sidecar.backends.base:MethodInfo"
_SAMPLER = "sidecar.sampling.sampler:Sampler"
_HOT = "sidecar.sampling.sampler:HotSettings"

_READER = "sidecar.proxy.http.request_reader:RequestReader"
_BOOK = "sidecar.proxy.http.calls:CallBook"
_CALL = "sidecar.proxy.http.calls:Call"
_CALL_SLOTS = (
    "body", "capture_limit", "error", "head", "method", "model", "path", "quiet",
    "request_bytes", "request_end", "response_bytes", "response_start", "sampled", "sid",
    "start", "start_ns", "status",
)  # fmt: skip

# what the pump reads and calls of its direction's FrameScanner
_PUMP_SCANNER = (
    "observe_rest", "observe_step", "walk_failed", "process_rest", "process_step",
    "process_done", "hold_failed", "out", "sink", "streams", "header_cache", "tracker",
    "client_side", "hold",
)  # fmt: skip

INTERFACE: dict[str, dict[str, str]] = {
    "_framewalk": {
        # the sink's methods (frames.FrameSink; streams' request and response sides)
        **dict.fromkeys(
            ("on_data", "on_data_payload", "on_end_stream", "on_header_block", "on_control"),
            _SINK,
        ),
        "emit_injected": _SCANNER,  # hold mode: re-emit a HEADERS frame with fields appended
        **dict.fromkeys(
            ("observer", "refuse_above", "last_stream_id", "metrics", "quick", "quiet_ends"),
            _TRACKER,
        ),
        **dict.fromkeys(("open_streams", "methods", "models", "codes", "stats"), _METRICS),
        **dict.fromkeys(
            ("buckets", "count", "sum", "request_bytes", "response_bytes"), _CALL_STATS
        ),
        **dict.fromkeys(("ended", "index", "per_model"), _QUIET_END),
        "get": "builtins:dict",  # QuietEnd.per_model.get where it is not a dict exactly
        **dict.fromkeys(("name", "model_field", "per_message"), _METHOD),
        **dict.fromkeys(
            ("per_call", "replayable", "coin", "unpicked", "not_replayable", "started"), _QUICK
        ),
        "coin_picked": _QUICK,
        **dict.fromkeys(("hot", "rand"), _SAMPLER),  # QuickDecisions.coin
        **dict.fromkeys(("force_header", "pick_rate"), _HOT),  # Sampler.hot
    },
    "_pump": {
        **dict.fromkeys(_PUMP_SCANNER, _SCANNER),
        **dict.fromkeys(("write", "writelines"), "asyncio:WriteTransport"),  # the other side
    },
    # no attribute read: `pick` is a member its owner sets (stream_sampling.py)
    "_messagewalk": {},
    "_httppump": {
        "write": "asyncio:WriteTransport",  # the backend's
        **dict.fromkeys(
            ("call", "refused", "closing", "body_left", "book", "routes", "limits", "adopt"),
            _READER,
        ),
        **dict.fromkeys(("header_bytes", "body_bytes"), "sidecar.proxy.http.limits:HttpLimits"),
        **dict.fromkeys(("count", "open", "observer", "metrics", "drawn"), _BOOK),
        **dict.fromkeys(("http_open", "method_label"), _METRICS),
        "http_route": "sidecar.backends.base:Backend",
        "append": "collections:deque",  # CallBook.open
        "quick": "sidecar.sampling.observer:HttpSamplingObserver",
        **dict.fromkeys(
            ("per_call", "replayable", "coin", "unpicked", "not_replayable", "started"), _QUICK
        ),
        **dict.fromkeys(("hot", "rand"), _SAMPLER),
        **dict.fromkeys(("force_header", "pick_rate"), _HOT),
        # every slot of a Call (made here as Call.__init__ makes one); `method` and `model`
        # are read from the route's HttpCall too, `head` from the reader
        **dict.fromkeys(_CALL_SLOTS, _CALL),
    },
}


def _switch(value: str | None) -> bool:
    """Whether `XSP_NATIVE`'s value leaves the C paths on (unset, or anything but off)."""
    return (value or "on").strip().lower() not in ("off", "0", "false", "no")


ENABLED = _switch(os.environ.get(ENV))
# why an extension did not load: its ImportError's text, or that the switch is off
errors: dict[str, str] = {}


def load(name: str) -> ModuleType | None:
    """Import the extension `name` (one of `EXTENSIONS`) where built and switched on."""
    if not ENABLED:
        errors[name] = f"{ENV}=off"
        return None
    try:
        return importlib.import_module(f"sidecar.proxy.{name}")
    except ImportError as exc:  # not built: no C compiler at install time
        errors[name] = str(exc)
        return None
