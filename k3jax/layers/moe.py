"""Latent MoE (docs/model.md §6): fp32 sigmoid router with selection-only bias, routed experts in the latent width,
routed_expert_norm on the weighted latent sum, up projection, plus shared experts on the full hidden.

The routed experts run through pallas_kernels.moe (grouped MXFP4 kernel or its XLA reference); the router,
latent_down and the shared experts' gate and up through pallas_kernels.gemv (one decode launch, or its reference),
and so do latent_up and the shared experts' down (the finish: one launch of the pairs' GEMV, or its reference).
"""

import jax
import jax.numpy as jnp

from k3jax.comm import LOCAL, Comm
from k3jax.config import K3Config
from k3jax.layers.boundary import join
from k3jax.layers.common import F32, situ_glu
from pallas_kernels import moe_route
from pallas_kernels.gemv import api as gemv_api
from pallas_kernels.gemv import reference as gemv_ref
from pallas_kernels.moe import api as moe_api
from pallas_kernels.policy import SCALE_MAX_UNKNOWN


def in_projections(p, x_TD, comm: Comm = LOCAL):
    """The normed x against this rank's out-major router, latent_down and shared experts' gate and up ->
    (router logits fp32 [T, E_l], z [T, Dl_l], gate [T, S_l], up [T, S_l] in x's dtype). A decode batch asks for
    ONE decode-GEMV launch reading x once (tuning table moe_in_launch); its reference, also the path of wider
    batches, is the same maths: the logits an fp32 HIGHEST sum of the bf16 values (exact products), the rest
    the GEMM rule."""
    names = ("router", "latent_down", "shared_gate", "shared_up")  # also the XLA ops' scopes (a profile's labels)
    ws = tuple(p[n] for n in names)
    out_dtypes = (F32,) + (x_TD.dtype,) * 3
    if x_TD.shape[0] <= gemv_api.MAX_BATCH:
        return gemv_api.gemv(x_TD, ws, out_dtypes=out_dtypes, names=names, policy=comm.policy, table="moe_in_launch")
    return gemv_ref.gemv(x_TD, ws, out_dtypes, names)


def finish(p, y_lat_TL, hidden_TS, comm: Comm = LOCAL):
    """latent_up(y_lat) + shared_down(hidden) -> [T, D] in the activation dtype (this rank's partial under tp):
    each a bf16 GEMM rounded, then a bf16 add (docs/model.md §6 step 5). y_lat is the whole normed latent: under
    tp latent_up is split by its input, and the rank's columns are read where they lie (x_starts: no slice
    kernel). A decode batch asks for ONE launch of the pairs' GEMV over the two out-major weights (tuning table
    moe_out_launch), which keeps both roundings; its reference, also the path of wider batches, is the two
    GEMMs and the add, each under its weight's name."""
    names = ("latent_up", "shared_down")  # the XLA ops' scopes (a profile's labels)
    xs, ws = (y_lat_TL, hidden_TS), tuple(p[n] for n in names)
    x_starts = (comm.local_start(p["latent_up"].shape[1]), None)
    if y_lat_TL.shape[0] <= gemv_api.MAX_BATCH:
        return gemv_api.gemv_sum(xs, ws, x_starts=x_starts, names=names, policy=comm.policy, table="moe_out_launch")
    return gemv_ref.gemv_sum(xs, ws, names, x_starts)


def router_logits(p, x_TD):
    """This rank's experts' router logits, fp32 [T, E_local] (the products of bf16 values are exact in fp32)."""
    return gemv_ref.gemv(x_TD, (p["router"],), (F32,))[0]


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
    each rank's [scores | biased | z] row (z widened to fp32, exactly) goes out as one piece -> (the gathered
    block [T, ranks x (2 E_l + L_l)], which select_gathered reads as moe_route.route_gathered's layout, and the
    whole z [T, L] in z's dtype)."""
    E_l, L_l = scores_TE.shape[-1], z_TL.shape[-1]
    block = comm.all_gather(jnp.concatenate([scores_TE, biased_TE, z_TL.astype(F32)], -1), axis=-1, what="routing")
    pieces = block.reshape(block.shape[0], -1, 2 * E_l + L_l)  # [T, ranks, 2 E_l + L_l]
    return block, pieces[..., 2 * E_l :].reshape(block.shape[0], -1).astype(z_TL.dtype)


def select_gathered(block_TX, e_local: int, l_local: int, cfg: K3Config, comm: Comm):
    """select() on gather_routing's block (E_l scores, E_l biased scores and L_l of z a rank), whose scores the
    routing kernel reads itself."""
    return moe_route.route_gathered(
        block_TX,
        ranks=block_TX.shape[-1] // (2 * e_local + l_local),
        e_local=e_local,
        k=cfg.num_experts_per_token,
        renormalize=cfg.moe_renormalize,
        scaling=cfg.routed_scaling_factor,
        policy=comm.policy,
    )


def route(p, x_TD, cfg: K3Config, comm: Comm = LOCAL):
    """-> (expert ids [T,k], fp32 weights [T,k]) for the normed x, unsharded (moe() gathers under tp)."""
    return select(jax.nn.sigmoid(router_logits(p, x_TD)), cfg, comm, bias_E=p["router_bias"].astype(F32))


def routed_experts(experts, z_TL, sel_Tk, w_Tk, cfg: K3Config, comm: Comm = LOCAL):
    """Weighted sum over each token's experts in the latent width, fp32 combine rounded once: pallas_kernels.moe's
    op (the grouped MXFP4 kernel where comm's decode policy asks for kernels, else the XLA reference read the
    policy's moe_impl way)."""
    return moe_api.routed_experts(
        experts,
        z_TL,
        sel_Tk,
        w_Tk,
        situ_beta=cfg.activation_situ_beta,
        situ_linear_beta=cfg.activation_situ_linear_beta,
        policy=comm.policy,
    )


def expert_scale_max(params) -> int:
    """The largest E8M0 scale byte of the routed experts' MXFP4 weights in `params` (0 where there are none;
    SCALE_MAX_UNKNOWN where they are abstract shapes): the decode policy's expert_scale_max, which lets their
    kernels fold 2^126 into the scale (every real checkpoint's bytes are far below 128: a byte above it scales a
    block whose largest weight is 16 or more). One reduction on the device, wherever the weights lie."""

    def is_scales(path):
        keys = [getattr(k, "key", None) for k in path]
        return "experts" in keys and str(keys[-1]).endswith("_scales")

    scales = [v for path, v in jax.tree_util.tree_leaves_with_path(params) if is_scales(path)]
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in scales):
        return SCALE_MAX_UNKNOWN
    return int(max((jnp.max(v) for v in scales), default=0))


def moe(p, x_TD, cfg: K3Config, return_routing: bool = False, comm: Comm = LOCAL):
    """x is the normed MLP input [T, D] (flatten batch and time first). Returns this rank's partial of the
    output (the trunk all-reduces it; unsharded it is the output).

    Under tp: the router is split by expert and latent_down by its output (one all-gather brings both),
    experts are split along their intermediate (partial latent sums -> all-reduce fused with the
    routed_expert_norm), latent_up by its input (its partial output joins the shared experts', split by their
    intermediate, in the layer's final all-reduce). Each rank's four projections of x are local (in_projections).
    """
    logits, z, gate, up = in_projections(p, x_TD, comm)
    scores = jax.nn.sigmoid(logits)
    if comm.sharded:
        E_l, L_l = logits.shape[-1], z.shape[-1]
        block, z = gather_routing(comm, scores, scores + p["router_bias"], z)
        sel, w = select_gathered(block, E_l, L_l, cfg, comm)
    else:  # the bias as [E]: the routing kernel adds it itself
        sel, w = select(scores, cfg, comm, bias_E=p["router_bias"].astype(F32))
    y_lat = routed_experts(p["experts"], z, sel, w, cfg, comm)
    if cfg.latent_moe_use_norm:
        _, y_lat = join(comm, y_lat, p["latent_norm"], cfg.rms_norm_eps, "latent_sum")
    else:
        y_lat = comm.all_reduce(y_lat, "latent_sum")
    hidden = situ_glu(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)  # the shared experts'
    y = finish(p, y_lat, hidden, comm)
    return (y, sel) if return_routing else y
