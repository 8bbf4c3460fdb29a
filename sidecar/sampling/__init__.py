"""Turning a few live requests into profiles: sampling decisions and the profiling worker."""
