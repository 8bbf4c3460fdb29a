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

# TensorFlow's ProfilerService and XSpace (vendored), for the capture of the backend's side.
# They go into a private descriptor pool: TensorFlow registers the same message names in the
# default pool, and a process (a test) may load both.
out=sidecar/live/_proto
pkg=tensorflow/tsl/profiler/protobuf
mkdir -p "$out"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" protos/$pkg/*.proto
for name in profiler_options xplane profiler_service_monitor_result; do
    rm "$out/$pkg/${name}_pb2_grpc.py"  # no service in these files
done
for dir in tensorflow tensorflow/tsl tensorflow/tsl/profiler $pkg; do
    touch "$out/$dir/__init__.py"
done
sed -i -e 's/^from tensorflow\.tsl\.profiler\.protobuf import/from sidecar.live._proto.tensorflow.tsl.profiler.protobuf import/' \
    -e 's/_descriptor_pool\.Default()\.AddSerializedFile/_POOL.AddSerializedFile/' \
    -e 's/^# @@protoc_insertion_point(imports)$/from sidecar.live._proto import POOL as _POOL\n&/' \
    "$out/$pkg"/*.py "$out/$pkg"/*.pyi
