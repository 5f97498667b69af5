"""MLA attention, NoPE with a sigmoid output gate (docs/model.md §5).

Two equal forms: `mla_full` is the naive expanded form over a whole sequence (the scoring reference), and
`mla_cached` is the weight-absorbed form over the latent cache (prefill chunks, decode, speculative verify):
queries absorb W_UK, outputs absorb W_UV, and the cache holds one 576-wide row per token.
"""

import jax
import jax.numpy as jnp

from k3jax.config import MLA_LOWRANK_EPS, K3Config
from k3jax.layers.common import dot, linear, rms_norm, row_parallel
from pallas_kernels import mla_decode
from pallas_kernels.policy import XLA, DecodePolicy


def queries(p, x_BTD):
    """-> q [B,T,H,nope+rope]."""
    return linear(
        rms_norm(linear(x_BTD, p["q_a"], "btd,dq->btq"), p["q_a_norm"], MLA_LOWRANK_EPS), p["q_b"], "btq,qhe->bthe"
    )


def latent_rows(p, x_BTD, cfg: K3Config):
    """-> cache rows [B,T,R+rope]: [RMSNorm(c) | k_pe] (k_pe neither normalised nor rotated)."""
    kv = linear(x_BTD, p["kv_a"], "btd,dr->btr")
    R = cfg.kv_lora_rank
    return jnp.concatenate([rms_norm(kv[..., :R], p["kv_a_norm"], MLA_LOWRANK_EPS), kv[..., R:]], axis=-1)


def _gate_out(p, o_BTHV, x_BTD):
    """Sigmoid output gate on the bf16 attention output (not an fp32 island, §5.2), then this rank's partial of
    o_proj (row-parallel: the trunk all-reduces it)."""
    gate = jax.nn.sigmoid(linear(x_BTD, p["g"], "btd,dhv->bthv"))
    return row_parallel(o_BTHV * gate, p["o"])


def _softmax_probs(s, mask, dtype):
    s = jnp.where(mask, s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def mla_full(p, x_BTD, cfg: K3Config):
    """Naive causal MLA over a full sequence (§5.2)."""
    N, R = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    q = queries(p, x_BTD)
    rows = latent_rows(p, x_BTD, cfg)
    c, k_pe = rows[..., :R], rows[..., R:]
    k_nope = linear(c, p["w_uk"], "bsr,hnr->bshn")
    v = linear(c, p["w_uv"], "bsr,hvr->bshv")
    s = (dot("bthn,bshn->bhts", q[..., :N], k_nope) + dot("bthe,bse->bhts", q[..., N:], k_pe)) * cfg.qk_head_dim**-0.5
    T = x_BTD.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = _softmax_probs(s, causal, x_BTD.dtype)
    o = dot("bhts,bshv->bthv", probs, v).astype(x_BTD.dtype)
    return _gate_out(p, o, x_BTD)


def mla_cached(p, x_BTD, cfg: K3Config, entry, key_len_BT, policy: DecodePolicy = XLA):
    """Absorbed MLA for T new tokens whose rows are already written into the cache.

    entry: the layer's cache entry as k3jax.cache keeps it ({"rows", "scales"} fp8, or {"rows"}), or a bare
    [B, S, C] array of rows in the compute dtype; the attention core (pallas_kernels.mla_decode, run as the
    decode policy says) reads it as stored. key_len_BT[b, t]: how many cache positions token t may attend to
    (its own position + 1 for causal decoding; any visibility prefix works, which the speculative verifier uses).
    """
    N = cfg.qk_nope_head_dim
    q = queries(p, x_BTD)
    q_lat = linear(q[..., :N], p["w_uk"], "bthn,hnr->bthr")  # W_UK^T q_nope
    entry = entry if isinstance(entry, dict) else {"rows": entry}
    o_lat = mla_decode.mla_decode_attention(
        q_lat, q[..., N:], entry, key_len_BT, scale=cfg.qk_head_dim**-0.5, policy=policy
    )
    o = linear(o_lat, p["w_uv"], "bthr,hvr->bthv")  # W_UV o_lat
    return _gate_out(p, o, x_BTD)
