"""A real `tritonserver` 2.51 (from the `nvidia-pytriton` wheel, in its own venv under `.triton/`),
its sample model repository and the flags of its OpenTelemetry tracing."""
