"""Latent MoE (docs/model.md §6): fp32 sigmoid router with selection-only bias, routed experts in the latent width,
routed_expert_norm on the weighted latent sum, up projection, plus shared experts on the full hidden.

XLA reference path: gather each token's selected expert weights (dequantising MXFP4 exactly) and run them.
"""

import math

import jax
import jax.numpy as jnp

from k3jax import mxfp4
from k3jax.comm import LOCAL, Comm
from k3jax.config import K3Config
from k3jax.layers.boundary import join
from k3jax.layers.common import F32, dot, ffn, linear, situ_glu
from pallas_kernels import moe_route
from pallas_kernels.policy import MOE_IMPLS


def router_logits(p, x_TD):
    """This rank's experts' router logits, fp32 [T, E_local] (the products of bf16 values are exact in fp32)."""
    return jnp.einsum("td,de->te", x_TD.astype(F32), p["router"].astype(F32), precision=jax.lax.Precision.HIGHEST)


def select(scores_TE, cfg: K3Config, comm: Comm, biased_TE=None, bias_E=None):
    """-> (expert ids [T,k], fp32 weights [T,k]): top-k of the biased scores (the bias picks experts but does
    not weight them), weights from the unbiased scores, renormalised and scaled: pallas_kernels.moe_route's op
    (its Mosaic GPU kernel where comm's decode policy asks for kernels, else XLA's top_k)."""
    return moe_route.route(
        scores_TE,
        biased_TE,
        bias_E=bias_E,
        k=cfg.num_experts_per_token,
        renormalize=cfg.moe_renormalize,
        scaling=cfg.routed_scaling_factor,
        policy=comm.policy,
    )


def gather_routing(comm: Comm, scores_TE, biased_TE, z_TL):
    """The router (split by expert) and latent_down (split by output) results of every rank, in ONE all-gather:
    each rank's [scores | biased | z] row (z widened to fp32, exactly) goes out as one block."""
    E_l, L_l = scores_TE.shape[-1], z_TL.shape[-1]
    both = comm.all_gather(jnp.concatenate([scores_TE, biased_TE, z_TL.astype(F32)], -1), axis=-1, what="routing")
    blocks = both.reshape(*both.shape[:-1], -1, 2 * E_l + L_l)  # [T, ranks, 2 E_l + L_l]

    def part(lo, n):
        return blocks[..., lo : lo + n].reshape(*both.shape[:-1], -1)

    return part(0, E_l), part(E_l, E_l), part(2 * E_l, L_l).astype(z_TL.dtype)


def route(p, x_TD, cfg: K3Config, comm: Comm = LOCAL):
    """-> (expert ids [T,k], fp32 weights [T,k]) for the normed x, unsharded (moe() gathers under tp)."""
    return select(jax.nn.sigmoid(router_logits(p, x_TD)), cfg, comm, bias_E=p["router_bias"].astype(F32))


def _expert_weight(experts, name, sel, dtype):
    if name in experts:  # bf16 experts
        return experts[name][sel].astype(dtype)
    return mxfp4.dequantize(experts[name + "_codes"][sel], experts[name + "_scales"][sel], dtype)


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


def routed_experts(experts, z_TL, sel_Tk, w_Tk, cfg: K3Config, impl: str = "packed", token_chunk: int | None = None):
    """Weighted sum over each token's experts in the latent width, fp32 combine rounded once. Tokens are
    processed in chunks (lax.map) so the gathered weights stay within GATHER_BUDGET_BYTES.

    impl (the decode policy's moe_impl) is how MXFP4 experts are read: "packed" (the default) contracts straight
    from the gathered packed bytes (mxfp4.matvec), so no bf16 copy is asked for; "gather" dequantises each
    token's experts to a bf16 copy and runs dots. Same maths (only the fp32 summation order differs). H200,
    24-layer TP16 rank slice (CUPTI, bench/results/rank_slice_packed.md vs rank_slice.md): step 4.03 vs 6.18 ms
    at batch 1, 76.9 vs 184.3 ms at batch 64."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl {impl!r}: use one of {MOE_IMPLS}")
    packed = "w1_codes" in experts and impl == "packed"

    def run(args):
        z, sel, w = args
        dt = z.dtype
        if packed:

            def mv(name, x):  # x [t, 1 or k, in] -> [t, k, out] in fp32
                return mxfp4.matvec(x, experts[name + "_codes"][sel], experts[name + "_scales"][sel])

            h = situ_glu(
                mv("w1", z[:, None]).astype(dt),
                mv("w3", z[:, None]).astype(dt),
                cfg.activation_situ_beta,
                cfg.activation_situ_linear_beta,
            )
            y = mv("w2", h).astype(dt)
        else:
            w1 = _expert_weight(experts, "w1", sel, dt)  # [t,k,I,L]
            w3 = _expert_weight(experts, "w3", sel, dt)
            w2 = _expert_weight(experts, "w2", sel, dt)  # [t,k,L,I]
            h = situ_glu(
                dot("tl,tkil->tki", z, w1).astype(dt),
                dot("tl,tkil->tki", z, w3).astype(dt),
                cfg.activation_situ_beta,
                cfg.activation_situ_linear_beta,
            )
            y = dot("tki,tkli->tkl", h, w2).astype(dt)
        return jnp.einsum("tkl,tk->tl", y.astype(F32), w, precision=jax.lax.Precision.HIGHEST).astype(dt)

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


def moe(p, x_TD, cfg: K3Config, return_routing: bool = False, comm: Comm = LOCAL):
    """x is the normed MLP input [T, D] (flatten batch and time first). Returns this rank's partial of the
    output (the trunk all-reduces it; unsharded it is the output).

    Under tp: the router is split by expert and latent_down by its output (one all-gather brings both),
    experts are split along their intermediate (partial latent sums -> all-reduce fused with the
    routed_expert_norm), latent_up by its input (its partial output joins the shared experts' partial in the
    layer's final all-reduce).
    """
    scores = jax.nn.sigmoid(router_logits(p, x_TD))
    z = linear(x_TD, p["latent_down"], "td,dl->tl")
    if comm.sharded:
        scores, biased, z = gather_routing(comm, scores, scores + p["router_bias"], z)
        sel, w = select(scores, cfg, comm, biased)
    else:  # the bias as [E]: the routing kernel adds it itself
        sel, w = select(scores, cfg, comm, bias_E=p["router_bias"].astype(F32))
    y_lat = routed_experts(p["experts"], z, sel, w, cfg, comm.policy.moe_impl)
    if cfg.latent_moe_use_norm:
        _, y_lat = join(comm, y_lat, p["latent_norm"], cfg.rms_norm_eps, "latent_sum")
    else:
        y_lat = comm.all_reduce(y_lat, "latent_sum")
    y_lat = comm.local_slice(y_lat, -1, p["latent_up"].shape[0])
    y = linear(y_lat, p["latent_up"], "tl,ld->td") + ffn(x_TD, p["shared_gate"], p["shared_up"], p["shared_down"], cfg)
    return (y, sel) if return_routing else y
