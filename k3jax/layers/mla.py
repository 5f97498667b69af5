"""MLA attention, NoPE with a sigmoid output gate (docs/model.md §5).

Two equal forms: `mla_full` is the naive expanded form over a whole sequence (the scoring reference), and
`mla_cached` is the weight-absorbed form over the latent cache (prefill chunks, decode, speculative verify):
queries absorb W_UK, outputs absorb W_UV, and the cache holds one 576-wide row per token. Both start from
`mla_in_projections`: the normed x against q_a, kv_a and the gate g (pallas_kernels.gemv: one decode launch, or
its reference).
"""

import jax
import jax.numpy as jnp

from k3jax.config import MLA_LOWRANK_EPS, K3Config
from k3jax.layers.common import dot, linear, o_proj, rms_norm
from pallas_kernels import mla_decode
from pallas_kernels.gemv import api as gemv_api
from pallas_kernels.gemv import reference as gemv_ref
from pallas_kernels.mla_decode import reference as mla_reference
from pallas_kernels.policy import XLA, DecodePolicy


def mla_in_projections(p, x_BTD, policy: DecodePolicy = XLA):
    """The normed x against the out-major q_a [Q, D], kv_a [R+P, D] and this rank's gate g [H_l, Vd, D] ->
    (q_a's output [B,T,Q], the latent kv [B,T,R+P], the gate's pre-activation [B,T,H_l,Vd]), in x's dtype.

    A decode batch (B*T <= the GEMV's largest) asks for ONE decode-GEMV launch reading x once (tuning table
    mla_in_launch); its reference, also the path of wider ones (prefill), is the same maths: the GEMM rule, each
    output under its own named scope (a profile's labels)."""
    B, T, D = x_BTD.shape
    H, Vd = p["g"].shape[:2]
    names = ("q_a", "kv_a", "g")
    ws = (p["q_a"], p["kv_a"], p["g"].reshape(H * Vd, D))  # a rank's heads are whole rows of g
    x_ND = x_BTD.reshape(B * T, D)
    if B * T <= gemv_api.MAX_BATCH:
        outs = gemv_api.gemv(x_ND, ws, names=names, policy=policy, table="mla_in_launch")
    else:
        outs = gemv_ref.gemv(x_ND, ws, None, names)
    q_a, kv, g = (o.reshape(B, T, -1) for o in outs)
    return q_a, kv, g.reshape(B, T, H, Vd)


def queries(p, q_a_BTQ):
    """q_a's output -> q [B,T,H,nope+rope] (q_b out-major [H, nope+rope, Q]: XLA reads its rows contiguously)."""
    return linear(rms_norm(q_a_BTQ, p["q_a_norm"], MLA_LOWRANK_EPS), p["q_b"], "btq,heq->bthe")


def latent_rows(p, kv_BTC):
    """kv_a's output -> cache rows [B,T,R+rope]: [RMSNorm(c) | k_pe] (k_pe neither normalised nor rotated; R is
    the norm weight's width)."""
    return mla_reference.latent_rows(kv_BTC, p["kv_a_norm"], MLA_LOWRANK_EPS)


def write_latent_rows(p, kv_BTC, entry, pos_BT, valid_BT, policy: DecodePolicy = XLA):
    """latent_rows stored into the layer's cache entry at pos_BT where valid_BT -> the new entry: one launch
    writing the cache in place where the decode policy asks for kernels (pallas_kernels.mla_decode)."""
    return mla_decode.mla_write_rows(
        kv_BTC, p["kv_a_norm"], entry, pos_BT, valid_BT, eps=MLA_LOWRANK_EPS, policy=policy
    )


def _gate_out(p, o_BTHV, g_BTHV, policy: DecodePolicy = XLA):
    """Sigmoid output gate (g: its pre-activation) on the bf16 attention output (not an fp32 island, §5.2), then
    this rank's partial of o_proj (row-parallel: the trunk all-reduces it; the decode GEMV where the policy asks
    for kernels, as KDA's)."""
    return o_proj(o_BTHV * jax.nn.sigmoid(g_BTHV), p["o"], policy)


def _softmax_probs(s, mask, dtype):
    s = jnp.where(mask, s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def mla_full(p, x_BTD, cfg: K3Config):
    """Naive causal MLA over a full sequence (§5.2)."""
    N, R = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    q_a, kv, g = mla_in_projections(p, x_BTD)
    q = queries(p, q_a)
    rows = latent_rows(p, kv)
    c, k_pe = rows[..., :R], rows[..., R:]
    k_nope = linear(c, p["w_uk"], "bsr,hnr->bshn")
    v = linear(c, p["w_uv"], "bsr,hvr->bshv")
    s = (dot("bthn,bshn->bhts", q[..., :N], k_nope) + dot("bthe,bse->bhts", q[..., N:], k_pe)) * cfg.qk_head_dim**-0.5
    T = x_BTD.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = _softmax_probs(s, causal, x_BTD.dtype)
    o = dot("bhts,bshv->bthv", probs, v).astype(x_BTD.dtype)
    return _gate_out(p, o, g)


def mla_cached(p, q_a_BTQ, g_BTHV, cfg: K3Config, entry, key_len_BT, policy: DecodePolicy = XLA):
    """Absorbed MLA for T new tokens whose rows are already written into the cache: q_a's output and the
    gate's pre-activation are theirs from mla_in_projections (the same call's kv is what the caller wrote).

    entry: the layer's cache entry as k3jax.cache keeps it ({"rows", "scales"} fp8, or {"rows"}), or a bare
    [B, S, C] array of rows in the compute dtype; the attention core (pallas_kernels.mla_decode, run as the
    decode policy says) reads it as stored. key_len_BT[b, t]: how many cache positions token t may attend to
    (its own position + 1 for causal decoding; any visibility prefix works, which the speculative verifier uses).
    """
    N = cfg.qk_nope_head_dim
    q = queries(p, q_a_BTQ)
    q_lat = linear(q[..., :N], p["w_uk"], "bthn,hnr->bthr")  # W_UK^T q_nope
    entry = entry if isinstance(entry, dict) else {"rows": entry}
    o_lat = mla_decode.mla_decode_attention(
        q_lat, q[..., N:], entry, key_len_BT, scale=cfg.qk_head_dim**-0.5, policy=policy
    )
    o = linear(o_lat, p["w_uv"], "bthr,hvr->bthv")  # W_UV o_lat
    return _gate_out(p, o, g_BTHV, policy)
