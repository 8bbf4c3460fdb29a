from __future__ import annotations

from sidecar.profiling import flops


def test_conv_flops_and_bytes_by_hand() -> None:
    # 1x3x32x32 input, 8 filters 3x3, same padding -> 1x8x32x32 output, with bias
    est = flops.estimate("Conv", [[1, 3, 32, 32], [8, 3, 3, 3], [8]], [[1, 8, 32, 32]])
    assert est is not None
    out = 8 * 32 * 32
    assert est.flops == 2 * out * (3 * 3 * 3) + out == 450_560
    assert est.read_bytes == (3 * 32 * 32 + 8 * 27 + 8) * 4
    assert est.write_bytes == out * 4


def test_grouped_and_torch_conv_names() -> None:
    # depthwise: weight [32, 1, 3, 3] -> 9 MACs per output element
    est = flops.estimate("aten::conv2d", [[1, 32, 8, 8], [32, 1, 3, 3]], [[1, 32, 8, 8]])
    assert est is not None and est.flops == 2 * 32 * 64 * 9


def test_matmul_gemm_and_attention_sized_matmul() -> None:
    mm = flops.estimate("MatMul", [[64, 128], [128, 32]], [[64, 32]])
    assert mm is not None and mm.flops == 2 * 64 * 32 * 128 == 524_288
    gemm = flops.estimate("Gemm", [[4, 16], [10, 16], [10]], [[4, 10]])
    assert gemm is not None and gemm.flops == 2 * 4 * 10 * 16 + 4 * 10
    # attention scores: [N=2, H=4, S=128, dh=64] x [2, 4, 64, 128] -> [2, 4, 128, 128]
    att = flops.estimate("MatMul", [[2, 4, 128, 64], [2, 4, 64, 128]], [[2, 4, 128, 128]])
    assert att is not None and att.flops == 2 * (2 * 4) * 128 * 128 * 64
    lin = flops.estimate("Linear", [[8, 256], [512, 256], [512]], [[8, 512]])
    assert lin is not None and lin.flops == 2 * 8 * 512 * 256 + 8 * 512


def test_elementwise_pool_norm_and_unknown() -> None:
    relu = flops.estimate("Relu", [[1, 10]], [[1, 10]])
    assert relu is not None and relu.flops == 10 and relu.read_bytes == 40
    pool = flops.estimate("MaxPool", [[1, 8, 32, 32]], [[1, 8, 16, 16]])
    assert pool is not None and pool.flops == 8 * 32 * 32
    ln = flops.estimate("LayerNormalization", [[1, 128, 256], [256], [256]], [[1, 128, 256]])
    assert ln is not None and ln.flops == 8 * 128 * 256
    view = flops.estimate("Reshape", [[1, 10]], [[10]])
    assert view == flops.Estimate(0, 0, 0)
    assert flops.estimate("SomeCustomOp", [[1]], [[1]]) is None


def test_annotate_marks_estimates_and_keeps_measured() -> None:
    attrs: dict = {"input_shapes": [[4, 8], [8, 2]], "output_shapes": [[4, 2]]}
    assert flops.annotate(attrs, "MatMul")
    assert attrs["flops"] == 128 and attrs["flops_estimated"] is True
    assert attrs["bytes_estimated"] is True and attrs["dram_write_bytes"] == 32
    measured = {"output_shapes": [[4, 2]], "flops": 7, "flops_estimated": False}
    assert not flops.annotate(measured, "MatMul")
    assert measured["flops"] == 7
