"""xsp-sidecar: a gRPC sidecar that forwards inference traffic and profiles samples of it."""

__version__ = "0.1.0"
