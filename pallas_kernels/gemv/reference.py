"""The XLA form of the decode GEMV, and the numerics the kernel must match: one fp32 sum per output, rounded
once to the activation dtype (the model's GEMM rule, pallas_kernels.common.dot)."""

from pallas_kernels.common import dot


def gemv(x_BD, ws_ND):
    """x [B, D] times each out-major weight [N_i, D] -> tuple of [B, N_i] in x's dtype."""
    return tuple(dot("bd,nd->bn", x_BD, w.astype(x_BD.dtype)).astype(x_BD.dtype) for w in ws_ND)
