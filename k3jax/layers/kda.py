"""KDA, Kimi Delta Attention (docs/model.md §4): projections, short conv, bounded decay gate, delta rule, gated norm.

Sequence (prefill/scoring) path here: chunked delta rule (§4.5), equal to the recurrent definition (§4.4).
The single-token decode maths lives once, in pallas_kernels.kda_decode (its XLA reference is the fallback).
"""

import jax
import jax.numpy as jnp

from k3jax.config import L2NORM_EPS, K3Config
from k3jax.layers.common import F32, o_proj
from pallas_kernels.kda_decode import api as kda_api
from pallas_kernels.kda_decode import reference as kda_ref
from pallas_kernels.policy import XLA, DecodePolicy

CHUNK = 16  # 16 steps of log-decay >= -5 span <= 80 nats: factors exp(+-40) around the chunk's middle (§4.5)


def project(p, x_BTD):
    """x -> (qkv_BT3HK pre-conv, f_BTHK pre dt_bias, beta_BTH logits, gate_BTHK logits): the decode step's
    own projections (pallas_kernels.kda_decode.reference), over T tokens."""
    qkvg, fa = kda_ref.project(x_BTD, p["qkvg"], p["f_a"])
    f, beta = kda_ref.gates(fa, p["f_b"], x_BTD, p["b"])
    return qkvg[:, :, :3], f, beta, qkvg[:, :, 3]


def decay_gate(f_BTHK, A_log_H, dt_bias_HK, lower_bound):
    """g = lb * sigmoid(exp(A_log) * (f + dt_bias)): log-decay in (lb, 0), fp32 (§4.3)."""
    z = f_BTHK.astype(F32) + dt_bias_HK
    return lower_bound * jax.nn.sigmoid(jnp.exp(A_log_H)[:, None] * z)


def l2norm(x, eps=L2NORM_EPS):
    xf = x.astype(F32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def short_conv(u_BT3HK, window_B3WHK, conv_w_3HKW, lengths_B):
    """Depthwise causal conv + SiLU over a (right-padded) sequence, continuing from a cached window.

    Returns (activated q/k/v [B,T,3,H,K] in u's dtype, new window = last W-1 pre-conv inputs per sequence).
    """
    Wm1 = window_B3WHK.shape[2]
    full = jnp.concatenate([jnp.moveaxis(window_B3WHK, 2, 1).astype(u_BT3HK.dtype), u_BT3HK], axis=1)
    T = u_BT3HK.shape[1]
    taps = jnp.stack([full[:, j : j + T] for j in range(Wm1 + 1)], axis=-1).astype(F32)  # [B,T,3,H,K,W]
    y = jnp.einsum("btshkw,shkw->btshk", taps, conv_w_3HKW, precision=jax.lax.Precision.HIGHEST)
    act = jax.nn.silu(y).astype(u_BT3HK.dtype)
    # the last W-1 real inputs: full[len : len + W-1] (full is offset by W-1)
    idx = lengths_B[:, None] + jnp.arange(Wm1)[None]
    new_window = jnp.take_along_axis(full, idx[:, :, None, None, None], axis=1)
    return act, jnp.moveaxis(new_window, 1, 2).astype(window_B3WHK.dtype)


def delta_rule_chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV, chunk=CHUNK):
    """Chunked delta rule (§4.5). q,k already L2-normalised (q scaled). Positions past a sequence's end must
    carry g = 0 and beta = 0 so they leave the state unchanged. Returns (o [B,T,H,V] fp32, final state)."""
    if not 1 <= chunk <= 32:  # factors reach exp(5 * chunk / 2): past 32 they leave fp32's range
        raise ValueError(f"KDA chunk must be in 1..32 for the fp32 factorisation, got {chunk}")
    B, T, H, K = k_BTHK.shape
    Vd = v_BTHV.shape[-1]
    n = -(-T // chunk)
    pad = n * chunk - T

    def prep(x):  # [B,T,H,...] -> [n, B, H, C, ...]
        x = jnp.pad(x.astype(F32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v, g, beta = map(prep, (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    hp = jax.lax.Precision.HIGHEST
    G = jnp.cumsum(g, axis=-2)  # [n,B,H,C,K] chunk-local cumulative log-decay
    # Intra-chunk pairs exp(G_r - G_c) are factorised around the chunk's middle, so every factor stays within
    # exp(+-5*chunk/2). Factorised around the chunk start, exp(G_r) reaches exp(-80) and its product with a
    # small q/k entry drops below fp32's normal range, which XLA flushes to zero (§4.5 pitfall).
    Gm = G[..., (chunk - 1) // 2 : (chunk - 1) // 2 + 1, :]
    k_in = k * jnp.exp(Gm - G)
    q_mid = q * jnp.exp(G - Gm)
    k_mid = k * jnp.exp(G - Gm)
    q_out = q * jnp.exp(G)  # decay since the chunk start (<= 1): what reads the incoming state
    k_out = k * jnp.exp(G)
    idx = jnp.arange(chunk)
    strict = idx[:, None] > idx[None, :]
    causal = idx[:, None] >= idx[None, :]
    L = jnp.where(strict, beta[..., :, None] * jnp.einsum("...rk,...ck->...rc", k_mid, k_in, precision=hp), 0.0)
    eye = jnp.eye(chunk, dtype=F32)
    Tm = jax.scipy.linalg.solve_triangular(eye + L, eye * beta[..., None, :], lower=True, unit_diagonal=True)
    W = jnp.einsum("...rc,...ck->...rk", Tm, k_out, precision=hp)
    U = jnp.einsum("...rc,...cv->...rv", Tm, v, precision=hp)
    Aqk = jnp.where(causal, jnp.einsum("...rk,...ck->...rc", q_mid, k_in, precision=hp), 0.0)
    k_end = k * jnp.exp(G[..., -1:, :] - G)  # exp(Gamma_C - Gamma_c) <= 1

    def step(S, xs):
        q_o, W_, U_, A_, k_e, G_end = xs
        Vt = U_ - jnp.einsum("...rk,...kv->...rv", W_, S, precision=hp)
        o = jnp.einsum("...rk,...kv->...rv", q_o, S, precision=hp) + jnp.einsum(
            "...rc,...cv->...rv", A_, Vt, precision=hp
        )
        S = jnp.exp(G_end)[..., :, None] * S + jnp.einsum("...ck,...cv->...kv", k_e, Vt, precision=hp)
        return S, o

    S, o = jax.lax.scan(step, state_BHKV.astype(F32), (q_out, W, U, Aqk, k_end, G[..., -1, :]))
    o = jnp.moveaxis(o, 0, 1)  # [B, n, H, C, V]
    o = jnp.moveaxis(o, 3, 2).reshape(B, n * chunk, H, Vd)[:, :T]
    return o, S


def gated_norm(o_BTHV, gate_BTHK, w_K, eps):
    """FusedRMSNormGated: fp32 norm, fp32 weight, sigmoid gate after the weight, one rounding (§4.6)."""
    of = o_BTHV.astype(F32)
    n = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * w_K
    return (n * jax.nn.sigmoid(gate_BTHK.astype(F32))).astype(gate_BTHK.dtype)


def kda_prefill(p, x_BTD, cfg: K3Config, lengths_B, state_BHKV, window_B3WHK, chunk=CHUNK):
    """KDA over a right-padded block of new tokens, continuing from (state, conv window).
    Returns (this rank's o_proj partial [B,T,D], new state, new window)."""
    T = x_BTD.shape[1]
    qkv, f, beta_logit, gate = project(p, x_BTD)
    act, new_window = short_conv(qkv, window_B3WHK, p["conv"], lengths_B)
    valid = jnp.arange(T)[None] < lengths_B[:, None]  # [B, T]
    K = cfg.kda_head_dim
    q = l2norm(act[:, :, 0]) * K**-0.5
    k = l2norm(act[:, :, 1]) * valid[..., None, None]
    v = act[:, :, 2].astype(F32)
    g = decay_gate(f, p["A_log"], p["dt_bias"], cfg.kda_gate_lower_bound) * valid[..., None, None]
    beta = jax.nn.sigmoid(beta_logit.astype(F32)) * valid[..., None]
    o, state = delta_rule_chunked(q, k, v, g, beta, state_BHKV, chunk)
    y = gated_norm(o.astype(x_BTD.dtype), gate, p["o_norm"], cfg.rms_norm_eps)
    return o_proj(y, p["o"]), state, new_window


def kda_decode(p, x_BD, cfg: K3Config, state_BHKV, window_B3WHK, policy: DecodePolicy = XLA, active_B=None):
    """One token per sequence: projections here, the fused step in pallas_kernels.kda_decode.
    Returns (this rank's o_proj partial [B,D], new state, new window). Sequences with active_B == 0 (idle
    slots; None = none idle) keep state and window: the op does it, in the kernel's own pass over
    the state rather than a second one after it.

    The op gets x and the projection weights, so a kernel body may run the projections its own way and fuse
    the f_b and b GEMVs in (its tuning says what it does). Both backends go through the same op, so a kernel
    that refuses a step falls back to exactly the xla backend's numbers."""
    y, state, window = kda_api.kda_decode_x(
        x_BD,
        p["qkvg"],
        p["f_a"],
        p["f_b"],
        p["b"],
        state_BHKV,
        window_B3WHK,
        p["conv"],
        p["A_log"],
        p["dt_bias"],
        p["o_norm"],
        active_B,
        eps=cfg.rms_norm_eps,
        policy=policy,
    )
    return o_proj(y, p["o"], policy), state, window
