from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.profiling.gpu.recording import Recording, load_recording

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "gpu-fixtures"
RESNET_B8 = FIXTURES / "cupti_resnet50_b8_h100.json.gz"
RESNET_B1 = FIXTURES / "cupti_resnet50_b1_h100_3iter_with_hooks.json.gz"
BERT_B8 = FIXTURES / "cupti_bert_base_b8_s128_h100.json.gz"
GRAPH_B8 = FIXTURES / "cupti_resnet50_b8_cudagraph_h100.json.gz"
WRONG_CLOCK = FIXTURES / "cupti_bert_b8_AFTER_torch_profiler_wrong_clock.json.gz"
NCU_B8 = FIXTURES / "ncu_resnet50_b8_h100.csv.gz"
GOOD = (RESNET_B8, RESNET_B1, BERT_B8, GRAPH_B8)


@pytest.fixture(scope="session")
def resnet_b8() -> Recording:
    return load_recording(RESNET_B8)
