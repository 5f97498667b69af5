"""The routed experts in XLA (docs/model.md §6): each token's selected experts run on its latent z, the weighted
sum over them in fp32 rounded once. The fallback of the api and what the kernel is tested against.

Rounding points (the spec's, as NeMo's inference path): bf16 after each expert GEMM and after SiTU-GLU (the
compute dtype; fp32 runs stay fp32), each y_e upcast and weighted in fp32, the sum rounded once.

Two ways to read MXFP4 experts (DecodePolicy.moe_impl), the same maths up to the order of the fp32 sums:
"packed" (the default) contracts straight from the gathered packed bytes (mxfp4.matvec), so no bf16 copy is
asked for; "gather" dequantises each token's experts to a copy in the compute dtype and runs dots. H200,
24-layer TP16 rank slice (CUPTI, bench/results/rank_slice_packed.md vs rank_slice.md): step 4.03 vs 6.18 ms
at batch 1, 76.9 vs 184.3 ms at batch 64. bf16 experts (a dequantised checkpoint) always gather.
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels.common import dot, situ_glu
from pallas_kernels.moe import mxfp4

F32 = jnp.float32
IMPLS = ("packed", "gather")

# Bound on the expert copies one token chunk gathers: a release expert is ~46 M weights (~92 MB in bf16 at
# TP1), so a fixed 64-token chunk gathered 94 GB at real width and a 128-token prefill ran the H200 out of memory.
GATHER_BUDGET_BYTES = 8 << 30


def gather_token_chunk(experts, k: int, dtype, max_chunk: int = 64) -> int:
    """Tokens per chunk so that chunk x k gathered experts (w1, w3, w2 in `dtype`) fit GATHER_BUDGET_BYTES."""
    elems = 0
    for name in ("w1", "w3", "w2"):
        if name in experts:
            elems += math.prod(experts[name].shape[1:])
        else:  # packed: two e2m1 codes per byte
            elems += 2 * math.prod(experts[name + "_codes"].shape[1:])
    per_token = k * elems * jnp.dtype(dtype).itemsize
    return max(1, min(max_chunk, GATHER_BUDGET_BYTES // per_token))


def _expert_weight(experts, name, sel, dtype):
    if name in experts:  # bf16 experts
        return experts[name][sel].astype(dtype)
    return mxfp4.dequantize(experts[name + "_codes"][sel], experts[name + "_scales"][sel], dtype)


def routed_experts(
    experts, z_TL, sel_Tk, w_Tk, *, situ_beta: float, situ_linear_beta: float | None, impl="packed", token_chunk=None
):
    """sum_k w[t, k] * W2_e(SiTU-GLU(W1_e z_t, W3_e z_t)), e = sel[t, k], in z's dtype (this rank's partial
    under tensor parallelism: the experts' intermediate is split). experts: w1/w3/w2 as `_codes` uint8
    [E, out, in/2] + `_scales` uint8 [E, out, in/32] (MXFP4), or dense [E, out, in]. Tokens run in chunks
    (lax.map) so the gathered weights stay within GATHER_BUDGET_BYTES."""
    if impl not in IMPLS:
        raise ValueError(f"moe_impl must be one of {IMPLS}, got {impl!r}")
    packed = "w1_codes" in experts and impl == "packed"

    def run(args):
        z, sel, w = args
        dt = z.dtype
        if packed:

            def mv(name, x):  # x [t, 1 or k, in] -> [t, k, out] in fp32
                return mxfp4.matvec(x, experts[name + "_codes"][sel], experts[name + "_scales"][sel])

            h = situ_glu(mv("w1", z[:, None]).astype(dt), mv("w3", z[:, None]).astype(dt), situ_beta, situ_linear_beta)
            y = mv("w2", h).astype(dt)
        else:
            w1 = _expert_weight(experts, "w1", sel, dt)  # [t,k,I,L]
            w3 = _expert_weight(experts, "w3", sel, dt)
            w2 = _expert_weight(experts, "w2", sel, dt)  # [t,k,L,I]
            h = situ_glu(
                dot("tl,tkil->tki", z, w1).astype(dt),
                dot("tl,tkil->tki", z, w3).astype(dt),
                situ_beta,
                situ_linear_beta,
            )
            y = dot("tki,tkli->tkl", h, w2).astype(dt)
        return combine(y, w)

    if token_chunk is None:
        token_chunk = gather_token_chunk(experts, sel_Tk.shape[-1], z_TL.dtype)
    T = z_TL.shape[0]
    if T <= token_chunk:
        return run((z_TL, sel_Tk, w_Tk))
    n = -(-T // token_chunk)
    pad = n * token_chunk - T

    def chunks(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(n, token_chunk, *a.shape[1:])

    out = jax.lax.map(run, (chunks(z_TL), chunks(sel_Tk), chunks(w_Tk)))
    return out.reshape(n * token_chunk, -1)[:T]


def combine(y_TkL, w_Tk):
    """The fp32 weighted sum over each token's experts, rounded once to y's dtype (the kernel's finalize too)."""
    return jnp.einsum("tkl,tk->tl", y_TkL.astype(F32), w_Tk, precision=jax.lax.Precision.HIGHEST).astype(y_TkL.dtype)
