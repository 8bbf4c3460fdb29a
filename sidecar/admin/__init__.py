"""The sidecar's admin API (`xsp.v1.Profiler`, see protos/xsp/v1/profiler.proto)."""
