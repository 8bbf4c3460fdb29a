"""The sample ensemble: a Python preprocessing step (`pre`), then `simple_cnn`.

`ens_cnn` is Triton's usual "preprocess -> model" pipeline (`platform: "ensemble"`): its input
`RAW` (pixel values 0-255, [N, 3, 32, 32]) goes to `pre`, which scales it to `SCALED`
(x / 255 - 0.5); that tensor is `simple_cnn`'s `input`, whose `output` is the ensemble's
`LOGITS`. In Triton's OpenTelemetry trace mode a request to it gives one model span per step,
each with its queue and compute phases. `model_repo.build_model_repository` adds it to every
sample repository (`add_ensemble`: it needs `simple_cnn`).
"""

from __future__ import annotations

from pathlib import Path

from tests.harness.triton.model_repo import write_model

ENSEMBLE = "ens_cnn"
STEPS = ("pre", "simple_cnn")  # in execution order

PRE_CONFIG = """\
name: "pre"
backend: "python"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "SCALED" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

PRE_MODEL_PY = '''\
"""Triton Python-backend model: SCALED = RAW / 255 - 0.5 (an image preprocessing step)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
            scaled = (raw.astype(np.float32) / 255.0 - 0.5).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SCALED", scaled)]))
        return responses
'''

ENSEMBLE_CONFIG = """\
name: "ens_cnn"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "pre"
      model_version: -1
      input_map { key: "RAW" value: "RAW" }
      output_map { key: "SCALED" value: "scaled" }
    },
    {
      model_name: "simple_cnn"
      model_version: -1
      input_map { key: "input" value: "scaled" }
      output_map { key: "output" value: "LOGITS" }
    }
  ]
}
"""


def add_ensemble(repo: Path) -> Path:
    """Add `pre` and the ensemble `ens_cnn` (pre -> simple_cnn) to `repo`; returns `repo`."""
    write_model(repo, "pre", PRE_CONFIG, PRE_MODEL_PY)
    write_model(repo, ENSEMBLE, ENSEMBLE_CONFIG)  # an ensemble's version folder stays empty
    return repo
