"""The demo: a local Triton (`triton`) or the TF-Serving stand-in (`tfserving`) with sample
models, the sidecar in front, traffic, sampled profiles and a report. `__main__` is its
command line (`python -m tests.harness.demo --help`); `triton` also holds the console both
backends print."""
