"""Shared pieces of the layers: linear (bf16 GEMM semantics), RMSNorm, SiTU-GLU (docs/model.md §1, §3).

Dtype rule: activations carry the compute dtype (bf16 serving, fp32 verification); every GEMM accumulates in
fp32 and rounds its output to the compute dtype; nonlinearities upcast to fp32 and round once.
"""

import jax.numpy as jnp

# the GEMM rule, RMSNorm and SiTU-GLU live once, beside the kernels' references (and kernels) that use them
from pallas_kernels.common import dot, rms_norm, situ_glu  # noqa: F401

F32 = jnp.float32


def linear(x, w, spec: str):
    """GEMM with fp32 accumulation, output rounded to x's dtype (weights cast to it; fp32 weights stay exact)."""
    return dot(spec, x, w.astype(x.dtype)).astype(x.dtype)


def row_parallel(x, w):
    """This rank's partial of a row-parallel projection: x [..., *c] @ w [*c, D], w's leading axes contracted
    (o_proj: heads x head dim). The caller all-reduces it (layers/boundary.py)."""
    c = w.ndim - 1
    return linear(x.reshape(*x.shape[: x.ndim - c], -1), w.reshape(-1, w.shape[-1]), "...k,kd->...d")


def ffn(x, gate_w, up_w, down_w, cfg):
    """Dense SiTU-GLU MLP on [..., D] with in-major weights (layer 0's [D, F], [F, D]; the MoE's shared experts
    are out-major, layers/moe.py). Under tensor parallelism the weights are split along the intermediate, so
    this returns this rank's partial sum: the caller all-reduces."""
    return linear(ffn_hidden(x, gate_w, up_w, cfg), down_w, "...f,fd->...d")


def ffn_hidden(x, gate_w, up_w, cfg):
    """SiTU-GLU hidden [..., F] of the dense MLP: what its row-parallel down projection consumes."""
    return situ_glu(
        linear(x, gate_w, "...d,df->...f"),
        linear(x, up_w, "...d,df->...f"),
        cfg.activation_situ_beta,
        cfg.activation_situ_linear_beta,
    )
