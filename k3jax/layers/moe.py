"""Latent MoE (K3_SPEC §6): fp32 sigmoid router with selection-only bias, routed experts in the latent width,
routed_expert_norm on the weighted latent sum, up projection, plus shared experts on the full hidden.

The routed experts run through pallas_kernels.moe (grouped MXFP4 kernel or its XLA reference).
"""

import os

import jax
import jax.numpy as jnp

from k3jax.comm import LOCAL, Comm
from k3jax.config import K3Config
from k3jax.layers.boundary import join
from k3jax.layers.common import F32, ffn, linear
from pallas_kernels.moe import api as moe_api
from pallas_kernels.moe import reference as moe_reference
from pallas_kernels.policy import DecodePolicy


def route(p, x_TD, cfg: K3Config, comm: Comm = LOCAL):
    """-> (expert ids [T,k], fp32 weights [T,k]). The correction bias picks experts but does not weight them.
    The router is split by expert over tp: gather the (scores, biased scores) pair in one collective."""
    logits = jnp.einsum("td,de->te", x_TD.astype(F32), p["router"].astype(F32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    both = comm.all_gather(jnp.stack([scores, scores + p["router_bias"]]), axis=-1, what="router")
    scores, biased = both[0], both[1]
    _, sel = jax.lax.top_k(biased, cfg.num_experts_per_token)
    w = jnp.take_along_axis(scores, sel, axis=-1)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return sel, w * cfg.routed_scaling_factor


# How the XLA path reads MXFP4 experts when no policy is passed: "packed" (the default, straight from the
# codes) or "gather" (a bf16 copy); pallas_kernels/moe/reference.py has the maths and the measurements.
# The decode policy (DecodePolicy.moe_impl) replaces this variable once every caller passes one.
MOE_IMPL_ENV = "K3JAX_MOE_IMPL"
MOE_IMPLS = moe_reference.IMPLS


def routed_experts(experts, z_TL, sel_Tk, w_Tk, cfg: K3Config, policy: DecodePolicy | None = None):
    """Weighted sum over each token's experts in the latent width, fp32 combine rounded once
    (pallas_kernels.moe: the grouped MXFP4 kernel where `policy` asks for kernels, else the XLA reference).
    Without a policy: stock XLA with K3JAX_MOE_IMPL's way of reading the experts (read while tracing)."""
    if policy is None:
        impl = os.environ.get(MOE_IMPL_ENV, MOE_IMPLS[0])
        if impl not in MOE_IMPLS:
            raise ValueError(f"{MOE_IMPL_ENV}={impl!r}: use one of {MOE_IMPLS}")
        policy = DecodePolicy(moe_impl=impl)
    return moe_api.routed_experts(
        experts,
        z_TL,
        sel_Tk,
        w_Tk,
        situ_beta=cfg.activation_situ_beta,
        situ_linear_beta=cfg.activation_situ_linear_beta,
        policy=policy,
    )


def moe(p, x_TD, cfg: K3Config, return_routing: bool = False, comm: Comm = LOCAL, policy: DecodePolicy | None = None):
    """x is the normed MLP input [T, D] (flatten batch and time first). Returns this rank's partial of the
    output (the trunk all-reduces it; unsharded it is the output).

    Under tp: experts are split along their intermediate (partial latent sums -> all-reduce fused with the
    routed_expert_norm), latent_down by its output (all-gather z), latent_up by its input (its partial output
    joins the shared experts' partial in the layer's final all-reduce). policy: see routed_experts.
    """
    sel, w = route(p, x_TD, cfg, comm)
    z = comm.all_gather(linear(x_TD, p["latent_down"], "td,dl->tl"), axis=-1, what="latent_z")
    y_lat = routed_experts(p["experts"], z, sel, w, cfg, policy)
    if cfg.latent_moe_use_norm:
        _, y_lat = join(comm, y_lat, p["latent_norm"], cfg.rms_norm_eps, "latent_sum")
    else:
        y_lat = comm.all_reduce(y_lat, "latent_sum")
    y_lat = comm.local_slice(y_lat, -1, p["latent_up"].shape[0])
    y = linear(y_lat, p["latent_up"], "tl,ld->td") + ffn(x_TD, p["shared_gate"], p["shared_up"], p["shared_down"], cfg)
    return (y, sel) if return_routing else y
