"""Generated code for TensorFlow's ProfilerService and XSpace (scripts/gen_protos.sh).

The messages live in `POOL`, not in protobuf's default pool, where TensorFlow (when a process
imports it) registers the same names from its own files.
"""

from google.protobuf.descriptor_pool import DescriptorPool

POOL = DescriptorPool()
