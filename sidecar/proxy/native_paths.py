"""Which of the relay's C paths run now, for the log and /metrics: read from the modules
that hold each path's switch (`frames`, `relay`, `stream_messages`, `http.relay`), so it sits
above them and `native` (which they import) stays below."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sidecar.proxy import frames, native, relay, stream_messages
from sidecar.proxy.http import relay as http_relay


def paths() -> dict[str, bool]:
    """Which of the relay's C paths run now: `walk`, `pump`, `message_walk` and `http_pump`
    (a test may have set a module's switch to None since import; the pump runs only with the
    walk)."""
    walk = frames.native_walk is not None
    return {
        "walk": walk,
        "pump": walk and relay.native_pump is not None,
        "message_walk": stream_messages.native_readers is not None,
        "http_pump": http_relay.native_http_pump is not None,
    }


def describe() -> str:
    """One line for the log: each path on or off, and why where off."""
    now = paths()
    why = {
        "walk": "_framewalk", "pump": "_pump", "message_walk": "_messagewalk",
        "http_pump": "_httppump",
    }  # fmt: skip
    parts = []
    for path, on in now.items():
        reason = native.errors.get(why[path], "switched off by the caller")
        if path == "pump" and not now["walk"] and "_pump" not in native.errors:
            reason = "needs the walk"
        parts.append(f"{path} on" if on else f"{path} off ({reason})")
    return "relay C paths: " + ", ".join(parts)


class NativeInfo(Collector):
    """`xsp_relay_native_info`: which of the relay's C paths run (`paths`), read at
    scrape time, and whether `XSP_NATIVE` switched them off. `serve` registers it on
    /metrics' registry (one per process: the paths are the process's)."""

    def collect(self) -> list[Metric]:
        labels = {path: "on" if on else "off" for path, on in paths().items()}
        labels["switch"] = "on" if native.ENABLED else "off"
        info = GaugeMetricFamily(
            "xsp_relay_native_info",
            "The relay's C paths: the frame walk, the pump (a direction's data_received), the "
            "message walk and the HTTP pump (the HTTP client's data_received), each on or off "
            "(off: not built, or XSP_NATIVE=off); always 1.",
            labels=list(labels),
        )
        info.add_metric(list(labels.values()), 1)
        return [info]
