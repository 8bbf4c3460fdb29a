"""The HTTP/1.1 relay (issue 42): REST calls to the backend's HTTP port, counted, observed and
sampled like the gRPC relay's calls.

`relay.py` pairs the connections and forwards bytes; `request_reader.py` and
`response_reader.py` cut each direction into messages with llhttp (httptools) and
`chunked.py`; `calls.py` keeps the open calls in order and ends them (metrics, observer);
`refusals.py` answers bad input; `status.py` maps an HTTP status and Triton's JSON error body
to the gRPC code names; `limits.py` bounds a request.
"""

from sidecar.proxy.http.limits import HttpLimits
from sidecar.proxy.http.relay import HttpRelay

__all__ = ["HttpLimits", "HttpRelay"]
