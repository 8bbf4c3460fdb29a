"""Replaying a sampled request with leveled profiling (runs in the profiling worker)."""
