"""What deciding the relay's C pump costs: `_ClientProtocol.arm_request` timed on a relaying
connection (a real protocol, its real `ConnectionTracker` and C `Pump`, routed to a fake
backend transport that is never written to). It runs at every state change of a connection,
not per chunk; this times the decision itself. Run it from each tree to compare (`PYTHONPATH`):

    python bench/arm_request.py --number 1000000 --repeat 7
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree to time: PYTHONPATH or the working directory

from prometheus_client import CollectorRegistry

from sidecar.proxy import relay
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import ConnectionTracker


class _Relay:
    """What `_ClientProtocol.__init__` reads of its relay."""

    def __init__(self) -> None:
        self._ids = iter(range(1, 1 << 30))


class _Transport:
    """The backend side the pump is routed to (never written to here)."""

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: object) -> None:
        pass


def relaying_connection() -> relay._ClientProtocol:
    """A client protocol as `_connect_backend` leaves it: connected, routed, relaying."""
    protocol = relay._ClientProtocol(_Relay())  # type: ignore[arg-type]
    protocol.tracker = ConnectionTracker(ProxyMetrics(CollectorRegistry()))
    backend = _Transport()
    protocol.backend = backend  # type: ignore[assignment]
    if not relay._route(protocol.request_pump, backend, protocol.tracker.request_scanner):  # type: ignore[arg-type]
        raise SystemExit("no C pump here (not built, or XSP_NATIVE=off): nothing to arm")
    if hasattr(relay, "ConnState"):
        protocol.state = relay.ConnState.RELAYING
    protocol.arm_request()
    assert protocol.request_pump is not None and protocol.request_pump.armed
    return protocol


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=1_000_000, help="calls per repeat")
    parser.add_argument("--repeat", type=int, default=7, help="repeats (the best is kept)")
    args = parser.parse_args(argv)
    protocol = relaying_connection()
    times = timeit.repeat(protocol.arm_request, number=args.number, repeat=args.repeat)
    per_call = sorted(t / args.number * 1e9 for t in times)
    print(f"{relay.__file__}")
    print(f"arm_request: best {per_call[0]:.1f} ns, median {per_call[len(per_call) // 2]:.1f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
