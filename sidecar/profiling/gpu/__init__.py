"""The GPU path of the leveled experiment (CUDA, CUPTI, Nsight Compute).

- `cupti_tracer`: CUPTI's activity records (`CuptiTracer`) and their kernel-level spans.
- `owner`: one CUPTI client per process (torch.profiler and `CuptiTracer` never meet).
- `clock_check`: CUPTI records must lie on the host clock of the walls they were taken in.
- `attribution`: GPU record -> launch (correlation id) -> innermost module call; CUDA graphs.
- `layers`: module calls (host interval, CUDA-event interval) -> nested layer spans.
- `ncu`: Nsight Compute `--csv` per-kernel metrics, joined to CUPTI kernels.
- `gpu_peak`: data-sheet (and measured) roofs of NVIDIA GPUs.
- `demangle`: readable kernel names.
- `recording`: a runner over CUPTI recordings taken on a real GPU (tests without a GPU).
"""
