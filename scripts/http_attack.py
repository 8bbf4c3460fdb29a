"""Send each kind of bad HTTP/1.1 input to the sidecar's HTTP relay, then a normal call.

Each case opens its own connection, sends its bytes and reads until the relay closes it; it
passes when the answer has the status the relay must give (and the connection is closed).
Cases (issue 42, part 4):

  malformed        not HTTP                                     -> 400, closed
  smuggling_cl_te  Content-Length and Transfer-Encoding both    -> 400, closed, never forwarded
  smuggling_cl_cl  two differing Content-Lengths                -> 400, closed, never forwarded
  bad_chunk        a chunked body with a bad chunk size         -> 400, closed
  header_too_large a header block over the limit (80 KiB)       -> 431, closed
  body_too_large   Content-Length over the limit (300 MiB)      -> 413, closed
  upgrade          Connection: Upgrade / Upgrade: h2c, no body  -> 200, as Triton answers it
  upgrade_body     an upgrade request with a body               -> 400, closed
  slowloris        a header trickle of one line a second        -> 408 within the header timeout
  normal           GET /v2/health/ready, after all the others   -> 200

`--rounds N` repeats every case N times; with `--pid` the resident memory (VmRSS) of that
process (the sidecar) is read after a first warm-up round and after the last, to show that it
stays flat. The report is a table, or JSON with `--json`; the exit status is 1 where a case
failed.

python scripts/http_attack.py --target 127.0.0.1:8010 --pid "$(pgrep -f 'xsp-sidecar serve')"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

NORMAL = b"GET /v2/health/ready HTTP/1.1\r\nHost: attack\r\n\r\n"


@dataclass
class Outcome:
    case: str
    expected: int
    status: int  # 0: no answer
    closed: bool  # the relay closed the connection after its answer
    seconds: float
    ok: bool


def _status(data: bytes) -> int:
    if not data.startswith(b"HTTP/1."):
        return 0
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _read(sock: socket.socket, deadline: float, until_close: bool) -> tuple[bytes, bool]:
    """Bytes until the peer closes (or one full head where `until_close` is false)."""
    out = bytearray()
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return bytes(out), False
        except (ConnectionResetError, BrokenPipeError):
            return bytes(out), True
        if not data:
            return bytes(out), True
        out += data
        if not until_close and b"\r\n\r\n" in out:
            return bytes(out), False
    return bytes(out), False


def _send(sock: socket.socket, data: bytes) -> None:
    # the relay may answer and close before taking it all
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(data)


def simple(payload: bytes) -> Callable[[socket.socket], None]:
    return lambda sock: _send(sock, payload)


def slowloris(sock: socket.socket, interval: float, deadline: float) -> None:
    _send(sock, b"GET /v2/health/ready HTTP/1.1\r\n")
    n = 0
    while time.monotonic() < deadline:
        time.sleep(interval)
        if select.select([sock], [], [], 0)[0]:
            return  # the relay answered (and is closing): its answer is read next
        n += 1
        try:
            sock.sendall(b"X-Trickle-%d: %s\r\n" % (n, b"a" * 8))
        except OSError:
            return  # closed by the relay: its answer is waiting to be read


# case -> (the status it must get, its bytes); every case but `upgrade` also closes
CASES: dict[str, tuple[int, bytes]] = {
    "malformed": (400, b"GARBAGE / NOT-HTTP\r\n\r\n"),
    "smuggling_cl_te": (400, (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attack\r\nContent-Length: 6\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nG"
    )),
    "smuggling_cl_cl": (400, (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attack\r\nContent-Length: 3\r\n"
        b"Content-Length: 40\r\n\r\nabc"
    )),
    "bad_chunk": (400, (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attack\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
    )),
    "header_too_large": (431, (
        b"GET /v2/health/ready HTTP/1.1\r\nHost: attack\r\nX-Big: " + b"a" * (80 << 10)
        + b"\r\n\r\n"
    )),
    "body_too_large": (413, (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attack\r\n"
        b"Content-Length: 314572800\r\n\r\n" + b"\0" * 4096
    )),
    "upgrade": (200, (
        b"GET /v2/health/ready HTTP/1.1\r\nHost: attack\r\nConnection: Upgrade, HTTP2-Settings"
        b"\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
    )),
    "upgrade_body": (400, (
        b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attack\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nContent-Length: 2\r\n\r\n{}"
    )),
}  # fmt: skip


def run_case(target: tuple[str, int], case: str, timeout: float, slowloris_s: float) -> Outcome:
    started = time.monotonic()
    if case == "slowloris":
        expected, deadline = 408, started + slowloris_s
    elif case == "normal":
        expected, deadline = 200, started + timeout
    else:
        expected, deadline = CASES[case][0], started + timeout
    with socket.create_connection(target, timeout=timeout) as sock:
        if case == "slowloris":
            slowloris(sock, min(1.0, slowloris_s / 20), deadline)
        elif case == "normal":
            _send(sock, NORMAL)
        else:
            _send(sock, CASES[case][1])
        stays_open = case in ("normal", "upgrade")
        read_by = max(deadline, time.monotonic() + timeout) if case == "slowloris" else deadline
        data, closed = _read(sock, read_by, until_close=not stays_open)
    status = _status(data)
    ok = status == expected and (closed or stays_open)
    return Outcome(case, expected, status, closed, round(time.monotonic() - started, 3), ok)


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target", required=True, metavar="HOST:PORT", help="the sidecar's HTTP listen address"
    )
    parser.add_argument("--pid", type=int, help="report the resident memory of this process")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat every case this many times (default 1)"
    )
    all_cases = [*CASES, "slowloris"]
    parser.add_argument(
        "--case", action="append", choices=all_cases,
        help="run only these cases (repeatable; default: all); the normal call always runs",
    )  # fmt: skip
    parser.add_argument(
        "--slowloris-seconds", type=float, default=15.0,
        help="how long the trickle goes on at most (longer than the relay's header timeout, "
        "10 s by default); 0 skips the case",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each other answer"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    target = (host or "127.0.0.1", int(port))
    cases = args.case or all_cases
    if args.slowloris_seconds <= 0:
        cases = [c for c in cases if c != "slowloris"]
    outcomes: list[Outcome] = []
    rss_before = rss_after = None
    for round_no in range(max(1, args.rounds)):
        for case in cases:
            outcomes.append(run_case(target, case, args.timeout, args.slowloris_seconds))
        if round_no == 0 and args.pid:
            rss_before = rss_kib(args.pid)  # after a warm-up round
    outcomes.append(run_case(target, "normal", args.timeout, args.slowloris_seconds))
    if args.pid:
        rss_after = rss_kib(args.pid)
    failed = [o for o in outcomes if not o.ok]
    if args.json:
        report = {
            "outcomes": [asdict(o) for o in outcomes],
            "rss_kib_before": rss_before,
            "rss_kib_after": rss_after,
            "failed": len(failed),
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"{'case':<18}{'expected':>9}{'got':>6}{'closed':>8}{'seconds':>9}  ok")
        for o in outcomes[: len(cases)] + outcomes[-1:]:
            print(f"{o.case:<18}{o.expected:>9}{o.status:>6}{o.closed!s:>8}{o.seconds:>9}  "
                  f"{'yes' if o.ok else 'NO'}")  # fmt: skip
        if args.rounds > 1:
            print(f"{len(outcomes)} cases run in {args.rounds} rounds, {len(failed)} failed")
        if rss_before is not None and rss_after is not None:
            print(f"RSS of pid {args.pid}: {rss_before} KiB after the first round, "
                  f"{rss_after} KiB at the end ({rss_after - rss_before:+d} KiB)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
