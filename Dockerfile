# syntax=docker/dockerfile:1
#
# xsp-sidecar image.
#
#   docker build -t xsp-sidecar:0.1.0 .                       # CPU: python:3.11-slim
#   docker build -t xsp-sidecar:0.1.0-gpu --build-arg VARIANT=gpu .   # CUDA base, onnxruntime-gpu
#   docker build -t xsp-sidecar:0.1.0-gpu --build-arg VARIANT=gpu --build-arg EXTRAS=[pytorch] .
#     # GPU replay of TorchScript models too (PyPI's Linux torch wheel is a CUDA build); the
#     # Helm chart's sidecar.gpu.enabled defaults the image tag to <appVersion>-gpu
#   docker build --build-arg EXTRAS=[pytorch] \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t xsp-sidecar:0.1.0-torch .
#   docker build --build-arg EXTRAS=[tensorflow] -t xsp-sidecar:0.1.0-tensorflow .
#     # beside TF-Serving: TensorFlow replays the sampled Predicts on the SavedModels
#     # (helm/xsp-sidecar/values-tfserving.yaml uses this tag)
#   docker build --build-arg EXTRAS=[analysis] -t xsp-sidecar:0.1.0-analysis .
#     # also the analysis stack (pandas, matplotlib, duckdb, pyarrow, ADBC), to run `python -m analysis.report`
#     # inside the pod; extras combine: --build-arg EXTRAS=[tensorflow,analysis]
#
# The extras each backend needs (EXTRAS; they combine, and every combination named here is
# resolved by tests/deploy/test_installs.py, as this file's build stage installs it):
#   Triton, ONNX models           none (the runtime image)
#   Triton, TorchScript models    [pytorch]      (on CPU with PyTorch's CPU index, as above)
#   TF-Serving, SavedModels       [tensorflow]   (TensorFlow 2.19 pins protobuf 5, numpy 2.1
#                                                 and so tritonclient 2.66 in that image)
#   analysis/report.py in the pod [analysis]; with a backend's extra: EXTRAS=[tensorflow,analysis],
#                                 EXTRAS=[pytorch,analysis]
#
# Which image has what: every variant serves (relay, metrics, sampling, replay with ONNX
# Runtime, trace store, OTLP); PyTorch, TensorFlow and the analysis stack are in an image only
# when EXTRAS names them. The runtime images above have no pandas, matplotlib or duckdb:
# reports are built offline from a copy of the pod's trace database (docs/deploy.md, section 4).
#
# Multi-stage: a build stage installs the package into /opt/venv the way the README does
# (`pip install .` from the source tree); the runtime stage copies only that venv and runs as
# an unprivileged user. No Docker engine runs on the machines this was written on, so the
# image has not been built there: the stages are checked by tests/deploy/test_dockerfile.py.

# cpu | gpu
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim
# The GPU variant: a CUDA 12 runtime with cuDNN 9 (what onnxruntime-gpu on PyPI is built for).
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# Optional extras of the package, e.g. "[pytorch]", "[tensorflow]", "[analysis]" or
# "[tensorflow,analysis]"; none by default (the runtime image).
ARG EXTRAS=""

# ---------------------------------------------------------------- CPU: python:3.11-slim
FROM ${PYTHON_IMAGE} AS build-cpu
ARG EXTRAS
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# a C compiler for the relay's frame and message walkers and its C data_received
# (sidecar/proxy/_framewalk.c, _messagewalk.c, _pump.c, _httppump.c); build stage only
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY sidecar ./sidecar
COPY analysis ./analysis
# pip first: the pip a venv is born with (23.2 or 24.0 on Python 3.11) can give up on the
# tensorflow extra's resolution ("ResolutionImpossible"); a current one resolves it
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --upgrade pip \
    && /opt/venv/bin/pip install ".${EXTRAS}" \
    && /opt/venv/bin/python -c "import sidecar.proxy._framewalk" \
    && /opt/venv/bin/python -c "import sidecar.proxy._messagewalk" \
    && /opt/venv/bin/python -c "import sidecar.proxy._pump" \
    && /opt/venv/bin/python -c "import sidecar.proxy._httppump"

FROM ${PYTHON_IMAGE} AS runtime-cpu
COPY --from=build-cpu /opt/venv /opt/venv

# ---------------------------------------------------------------- GPU: CUDA base
FROM ${CUDA_BASE} AS base-gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

FROM base-gpu AS build-gpu
ARG EXTRAS
ARG PIP_EXTRA_INDEX_URL=""
# onnxruntime-gpu replaces onnxruntime (same `onnxruntime` module). cupti-python 13 is the first
# that records runtime API calls (ActivityKind.RUNTIME), which the kernel level needs for the
# launches of most kernels; it brings its own CUDA 13 CUPTI, so the node's driver must be
# >= 580 (as PyPI's CUDA 13 torch wheels need too); CUDA 12 libraries run on that driver.
ARG ORT_GPU_SPEC="onnxruntime-gpu>=1.20,<1.27"
ARG CUPTI_SPEC="cupti-python>=13.0.1,<14"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# a C compiler and Python's headers for the relay's C extensions; build stage only
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY sidecar ./sidecar
COPY analysis ./analysis
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --upgrade pip \
    && /opt/venv/bin/pip install ".${EXTRAS}" "${CUPTI_SPEC}" \
    && /opt/venv/bin/python -c "import sidecar.proxy._framewalk" \
    && /opt/venv/bin/python -c "import sidecar.proxy._messagewalk" \
    && /opt/venv/bin/python -c "import sidecar.proxy._pump" \
    && /opt/venv/bin/python -c "import sidecar.proxy._httppump" \
    && /opt/venv/bin/python -c "from cupti import cupti; cupti.ActivityKind.RUNTIME" \
    && /opt/venv/bin/pip uninstall -y onnxruntime \
    && /opt/venv/bin/pip install "${ORT_GPU_SPEC}"

FROM base-gpu AS runtime-gpu
COPY --from=build-gpu /opt/venv /opt/venv

# ---------------------------------------------------------------- final image
FROM runtime-${VARIANT} AS final
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XSP_CACHE_DIR=/tmp/xsp-cache \
    XSP_DB=/data/traces.db
RUN groupadd --system --gid 10001 xsp \
    && useradd --system --uid 10001 --gid xsp --create-home --home-dir /home/xsp \
       --shell /usr/sbin/nologin xsp \
    && mkdir -p /data \
    && chown xsp:xsp /data
COPY --chmod=0755 docker/healthcheck.py /usr/local/bin/xsp-healthcheck
USER 10001:10001
WORKDIR /home/xsp
VOLUME ["/data"]
# relay, Prometheus /metrics, own gRPC (health, reflection), OTLP/HTTP receiver, and the
# HTTP/REST relay where it is on (--http-listen 0.0.0.0:8010, as the chart sets). The admin
# API (--admin, 127.0.0.1:8014 by default) is loopback-only and deliberately not exposed.
EXPOSE 8011 8012 8013 4318 8010
# The gRPC health service: SERVING only while the backend behind the relay is ready.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["xsp-healthcheck"]
ENTRYPOINT ["xsp-sidecar"]
CMD ["serve"]
