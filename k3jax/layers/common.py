"""Shared pieces of the layers: linear (bf16 GEMM semantics), RMSNorm, SiTU-GLU (docs/model.md §1, §3).

Dtype rule: activations carry the compute dtype (bf16 serving, fp32 verification); every GEMM accumulates in
fp32 and rounds its output to the compute dtype; nonlinearities upcast to fp32 and round once.
"""

import jax.numpy as jnp

# the GEMM rule, RMSNorm and SiTU-GLU live once, beside the kernels' references (and kernels) that use them
from pallas_kernels.common import dot, rms_norm, situ_glu  # noqa: F401
from pallas_kernels.gemv import api as gemv_api
from pallas_kernels.policy import XLA, DecodePolicy

F32 = jnp.float32


def linear(x, w, spec: str):
    """GEMM with fp32 accumulation, output rounded to x's dtype (weights cast to it; fp32 weights stay exact)."""
    return dot(spec, x, w.astype(x.dtype)).astype(x.dtype)


def o_proj(y_HK, w_DHK, policy: DecodePolicy = XLA):
    """This rank's o_proj partial (KDA's and MLA's: row-parallel, the caller all-reduces it, layers/boundary.py):
    y [..., H, K] against the out-major w [D, H, K], heads x head dim contracted as one axis. A decode or verify
    step (at most the GEMV's batch of tokens) asks for the decode GEMV (tuning table o_proj_launch: run where the
    policy asks for kernels and the table has a launch for the batch, else the same maths by XLA)."""
    lead, D = y_HK.shape[:-2], w_DHK.shape[0]
    y, w = y_HK.reshape(-1, y_HK.shape[-2] * y_HK.shape[-1]), w_DHK.reshape(D, -1)
    if y.shape[0] <= gemv_api.MAX_BATCH:
        out = gemv_api.gemv(y, (w,), policy=policy, table="o_proj_launch")[0]
    else:
        out = linear(y, w, "nc,dc->nd")
    return out.reshape(*lead, D)


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
