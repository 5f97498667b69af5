"""KDA decode in plain XLA (docs/model.md §4.2-4.6): the fallback, the test oracle, the bar the kernel must beat.

Glossary: B batch, T new tokens (verify), H local heads, K key dim, V value dim (K = V = 128 in K3),
W = 3 cached pre-conv inputs, "3" stacks q, k, v. Activations come in the compute dtype (bf16 serving,
f32 verification); the recurrent state and the gate maths are fp32. Every contraction of the step is
written as multiply + sum so that no backend may quietly run it in TF32; the gate projections (gates) are the
model's own GEMMs (common.dot), so a fallback reproduces the model's XLA path exactly.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import common

F32 = jnp.float32


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def prepare(qkv_B3HK, f_BHK, beta_BH, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK):
    """Short conv + SiLU, gate, beta and the normalised q, k of one token (§4.2, §4.3)."""
    dtype = qkv_B3HK.dtype
    window_B3WHK = jnp.concatenate([conv_B3WHK, qkv_B3HK[:, :, None]], axis=2)  # oldest first, 4 taps
    taps_3WHK = jnp.moveaxis(conv_w_3HKW, -1, 1)
    y_B3HK = jnp.sum(window_B3WHK.astype(F32) * taps_3WHK[None], axis=2)
    x_B3HK = (y_B3HK * _sigmoid(y_B3HK)).astype(dtype).astype(F32)  # SiLU in fp32, rounded like FLA's conv
    q_BHK, k_BHK, v_BHK = x_B3HK[:, 0], x_B3HK[:, 1], x_B3HK[:, 2]
    K = q_BHK.shape[-1]
    z_BHK = f_BHK.astype(F32) + dt_bias_HK
    g_BHK = -5.0 * _sigmoid(jnp.exp(A_log_H)[:, None] * z_BHK)
    beta_BH = _sigmoid(beta_BH.astype(F32))
    qn_BHK = q_BHK * jax.lax.rsqrt(jnp.sum(q_BHK * q_BHK, -1, keepdims=True) + 1e-6) * K**-0.5
    kn_BHK = k_BHK * jax.lax.rsqrt(jnp.sum(k_BHK * k_BHK, -1, keepdims=True) + 1e-6)
    return qn_BHK, kn_BHK, v_BHK, jnp.exp(g_BHK), beta_BH, window_B3WHK[:, :, 1:]


def gated_norm(o_BHV, gate_BHV, o_norm_w_V, eps, dtype):
    """§4.6: o rounded to the compute dtype, then RMSNorm, weight and sigmoid gate in fp32, one rounding."""
    o = o_BHV.astype(dtype).astype(F32)
    n = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * o_norm_w_V
    return (n * _sigmoid(gate_BHV.astype(F32))).astype(dtype)


def advance(state_BHKV, kn_BHK, decay_BHK, beta_BH, delta_BHV):
    """S <- diag(decay) S + beta k̂ deltaᵀ: the only state write, shared by decode and commit."""
    return decay_BHK[..., None] * state_BHKV + (beta_BH[..., None] * kn_BHK)[..., None] * delta_BHV[..., None, :]


def _step(
    qkv_B3HK,
    f_BHK,
    beta_BH,
    gate_BHK,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    eps,
    active_B=None,
):
    """One token: returns y, the new state and window, and what a commit needs to replay this step.
    active_B: see kda_decode."""
    qn, kn, v, decay, beta, new_conv = prepare(qkv_B3HK, f_BHK, beta_BH, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK)
    weight_BH = beta
    if active_B is not None:  # an idle sequence advances by decay 1 and weight 0 (S * 1 + 0 = S): no select
        # after the update. The mask goes on decay before both of its uses (delta and the update), so the state
        # loop fuses as without a mask: masking only the update's decay cost XLA a pass over the state
        # (bench/results/kda_reference_mask.json); an active slot's decay is unchanged (d * 1 + 0).
        step_B = (active_B != 0).astype(F32)
        decay = decay * step_B[:, None, None] + (1.0 - step_B[:, None, None])
        weight_BH = beta * step_B[:, None]
        new_conv = jnp.where((active_B != 0)[:, None, None, None, None], new_conv, conv_B3WHK)
    delta_BHV = v - jnp.sum(decay[..., None] * state_BHKV * kn[..., None], axis=-2)
    new_state = advance(state_BHKV, kn, decay, weight_BH, delta_BHV)
    o_BHV = jnp.sum(new_state * qn[..., None], axis=-2)
    y = gated_norm(o_BHV, gate_BHK, o_norm_w_K, eps, qkv_B3HK.dtype)
    return y, new_state, new_conv, (kn, decay, weight_BH, delta_BHV)


def kda_decode(
    qkv_B3HK,
    f_BHK,
    beta_BH,
    gate_BHK,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    active_B=None,
    *,
    eps=1e-5,
):
    """One decode step of one KDA layer -> (y_BHK, new_state_BHKV, new_conv_B3WHK). active_B (int [B], None =
    all): a sequence whose entry is 0 (an idle slot) keeps its conv window bit for bit and its state value for
    value (the update runs with decay 1 and rank-1 weight 0, so an exact -0.0 may come back +0.0, and the slot's
    inputs must be finite: 0 * inf is nan); its y is not specified (a slot nobody reads). As a select after the
    update, XLA ran it as one more pass over the state (bench/results/kda_layer.json, xla column)."""
    y, new_state, new_conv, _ = _step(
        qkv_B3HK,
        f_BHK,
        beta_BH,
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        eps,
        active_B,
    )
    return y, new_state, new_conv


def gates(fa_BR, f_b_RHK, x_BD, b_HD):
    """The gate projections a decode kernel may fuse (issue 6 stretch): f = fa @ f_b [B,H,K] (fa = x @ f_a, the
    rank-R stage shared by all heads) and the beta logits x @ b [B,H], as the model's projections compute them
    (common.dot: fp32 sums of activation-dtype operands, rounded to that dtype), so this fallback gives the XLA
    path's very numbers. Any leading axes (prefill's [B, T] too)."""
    dtype = x_BD.dtype
    f = common.dot("...r,rhk->...hk", fa_BR, f_b_RHK.astype(dtype))
    beta = common.dot("...d,hd->...h", x_BD, b_HD.astype(dtype))
    return f.astype(dtype), beta.astype(dtype)


def kda_decode_gates(
    qkv_B3HK,
    fa_BR,
    f_b_RHK,
    x_BD,
    b_HD,
    gate_BHK,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    active_B=None,
    *,
    eps=1e-5,
):
    """kda_decode with f and beta from their projections' inputs (see gates)."""
    f_BHK, beta_BH = gates(fa_BR, f_b_RHK, x_BD, b_HD)
    return kda_decode(
        qkv_B3HK,
        f_BHK,
        beta_BH,
        gate_BHK,
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B,
        eps=eps,
    )


def project(x_BD, qkvg_4HKD, f_a_RD):
    """The layer's q/k/v/g and fa projections from its normed input (out-major weights), the model's GEMMs:
    -> (qkvg_B4HK, fa_BR) in x's dtype. Any leading axes (prefill's [B, T] too)."""
    dtype = x_BD.dtype
    qkvg = common.dot("...d,shkd->...shk", x_BD, qkvg_4HKD.astype(dtype)).astype(dtype)
    return qkvg, common.dot("...d,rd->...r", x_BD, f_a_RD.astype(dtype)).astype(dtype)


def kda_decode_x(
    x_BD,
    qkvg_4HKD,
    f_a_RD,
    f_b_RHK,
    b_HD,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    active_B=None,
    *,
    eps=1e-5,
):
    """kda_decode_gates from the layer's normed input x and its projection weights (see project)."""
    qkvg_B4HK, fa_BR = project(x_BD, qkvg_4HKD, f_a_RD)
    return kda_decode_gates(
        qkvg_B4HK[:, :3],
        fa_BR,
        f_b_RHK,
        x_BD,
        b_HD,
        qkvg_B4HK[:, 3],
        state_BHKV,
        conv_B3WHK,
        conv_w_3HKW,
        A_log_H,
        dt_bias_HK,
        o_norm_w_K,
        active_B,
        eps=eps,
    )


def kda_verify(
    qkv_BT3HK,
    f_BTHK,
    beta_BTH,
    gate_BTHK,
    state_BHKV,
    conv_B3WHK,
    conv_w_3HKW,
    A_log_H,
    dt_bias_HK,
    o_norm_w_K,
    *,
    eps=1e-5,
):
    """Speculative verify: outputs for all T new tokens, state untouched.

    commit_data keeps per token only k̂, decay, beta and the correction delta = v - (decayed S)ᵀ k̂ (plus the
    new pre-conv inputs), i.e. O(T (K + V)) per head instead of T copies of the K x V state. Replaying
    S <- diag(decay) S + beta k̂ deltaᵀ with the stored delta is exactly what a decode step computes.
    """
    T = qkv_BT3HK.shape[1]
    state, conv = state_BHKV, conv_B3WHK
    ys, parts = [], []
    for t in range(T):  # T <= 8: unrolled, XLA fuses the state chain
        y, state, conv, part = _step(
            qkv_BT3HK[:, t],
            f_BTHK[:, t],
            beta_BTH[:, t],
            gate_BTHK[:, t],
            state,
            conv,
            conv_w_3HKW,
            A_log_H,
            dt_bias_HK,
            o_norm_w_K,
            eps,
        )
        ys.append(y)
        parts.append(part)
    kn, decay, beta, delta = (jnp.stack(p, axis=1) for p in zip(*parts, strict=True))
    commit_data = dict(kn_BTHK=kn, decay_BTHK=decay, beta_BTH=beta, delta_BTHV=delta, new_inputs_BT3HK=qkv_BT3HK)
    return jnp.stack(ys, axis=1), commit_data


def kda_commit(state_BHKV, conv_B3WHK, commit_data, accepted_B):
    """Advance state and conv window by accepted_B[b] in [0, T] tokens (0 leaves the sequence unchanged)."""
    T = commit_data["kn_BTHK"].shape[1]
    state = state_BHKV
    for t in range(T):
        stepped = advance(
            state,
            commit_data["kn_BTHK"][:, t],
            commit_data["decay_BTHK"][:, t],
            commit_data["beta_BTH"][:, t],
            commit_data["delta_BTHV"][:, t],
        )
        state = jnp.where((t < accepted_B)[:, None, None, None], stepped, state)
    W = conv_B3WHK.shape[2]
    window_B3LHK = jnp.concatenate([conv_B3WHK, jnp.moveaxis(commit_data["new_inputs_BT3HK"], 1, 2)], axis=2)
    idx_B = accepted_B.astype(jnp.int32)[:, None] + jnp.arange(W)  # last W of the first W + accepted inputs
    new_conv = jnp.take_along_axis(window_B3LHK, idx_B[:, None, :, None, None], axis=2)
    return state, new_conv
