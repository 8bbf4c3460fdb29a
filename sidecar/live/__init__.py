"""Live-traffic building blocks: OTLP receiver, Triton span conversion, KServe request decoding,
and model-repository lookup (used by the proxy and the profiling worker)."""
