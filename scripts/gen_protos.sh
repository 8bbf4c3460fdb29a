#!/usr/bin/env bash
# Regenerate the Python modules for protos/ (committed; run after editing a .proto).
set -euo pipefail
cd "$(dirname "$0")/.."
out=sidecar/admin/_proto
mkdir -p "$out"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" protos/xsp/v1/profiler.proto
touch "$out/__init__.py" "$out/xsp/__init__.py" "$out/xsp/v1/__init__.py"
# protoc writes absolute imports (`from xsp.v1 import ...`); make them package-relative.
sed -i 's/^from xsp\.v1 import profiler_pb2/from sidecar.admin._proto.xsp.v1 import profiler_pb2/' \
    "$out/xsp/v1/profiler_pb2_grpc.py"
