"""Dispatch for the KDA decode step, speculative verify and commit: the Pallas Mosaic GPU body for the compute
capability where the decode policy asks for kernels, the XLA reference otherwise.

A body raises NotImplementedError for what it does not handle (no GPU, shape, dtype); pallas_kernels.policy.dispatch
then runs the reference, logs the reason once on logger "k3jax.backends" and records what ran.
"""

from pallas_kernels import common
from pallas_kernels import policy as policy_lib
from pallas_kernels.kda_decode import reference
from pallas_kernels.policy import XLA, DecodePolicy


def body_ops(policy: DecodePolicy):
    """The sm90 or sm100 body's ops for the GPU we compile for, launched by the policy's kda_decode tuning."""
    arch = common.gpu_arch()
    if arch is None:
        raise NotImplementedError("no GPU device (Mosaic GPU needs sm90 or sm100)")
    if arch[0] == 9:
        from pallas_kernels.kda_decode import sm90 as body
    elif arch[0] == 10:
        from pallas_kernels.kda_decode import sm100 as body
    else:
        raise NotImplementedError(f"no KDA decode body for compute capability {arch}")
    return body.ops(policy)


def _dispatch(op, policy, args, kwargs):
    """The body's `op` where the policy asks for kernels and the body takes the call, else the reference."""
    return policy_lib.dispatch(
        op,
        policy,
        lambda: getattr(body_ops(policy), op)(*args, **kwargs),
        lambda: getattr(reference, op)(*args, **kwargs),
    )


def _check_qkv(qkv_B3HK):
    """The public ops take q, k, v stacked as [B, 3, H, K]. (A body's kda_decode_x hands its own kernel the
    layer's whole qkvg [B, 4, H, K]; through the api a fourth stream would be ignored by the kernel and refused
    by the reference, so it is refused here.)"""
    if qkv_B3HK.ndim != 4 or qkv_B3HK.shape[1] != 3:
        raise ValueError(f"qkv must be [B, 3, H, K] (q, k, v stacked on axis 1), got {list(qkv_B3HK.shape)}")


def _check_active(active_B, state_BHKV):
    """active_B must be one integer or bool per sequence: a wrong length would mask the wrong slots."""
    if active_B is not None and (active_B.shape != state_BHKV.shape[:1] or active_B.dtype.kind not in "iub"):
        raise ValueError(
            f"active_B must be an int or bool array of shape ({state_BHKV.shape[0]},), one entry "
            f"per sequence (0 = idle), got {active_B.dtype}{list(active_B.shape)}"
        )


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
    policy: DecodePolicy = XLA,
):
    """One KDA decode step -> (y_BHK, new_state_BHKV, new_conv_B3WHK). See reference.py for the maths.
    active_B (int [B], None = all): sequences whose entry is 0 (idle slots) keep state and conv window (value
    for value). Pass it rather than selecting afterwards: after a kernel that select is a second pass over the
    state (bench/results/kda_layer.json)."""
    _check_qkv(qkv_B3HK)
    _check_active(active_B, state_BHKV)
    return _dispatch(
        "kda_decode",
        policy,
        (
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
        ),
        dict(eps=eps),
    )


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
    policy: DecodePolicy = XLA,
):
    """kda_decode from the gate projections' inputs: f = fa @ f_b, beta logits = x @ b (fa = x @ f_a). A body
    computes them in the decode kernel up to its tuning's "fuse_gates_max_batch" (two fewer launches per KDA
    layer); above it runs the two projections, then its decode kernel."""
    _check_qkv(qkv_B3HK)
    _check_active(active_B, state_BHKV)
    return _dispatch(
        "kda_decode_gates",
        policy,
        (
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
            active_B,
        ),
        dict(eps=eps),
    )


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
    policy: DecodePolicy = XLA,
):
    """The step from the layer's normed input x and its out-major projection weights (qkvg [4, H, K, D],
    f_a [R, D]): the projections, then kda_decode_gates. A body may run the projections as its own GEMV whose
    partials the decode kernel reads (tuning "gemv_projections"); the reference runs the model's GEMMs."""
    _check_active(active_B, state_BHKV)
    return _dispatch(
        "kda_decode_x",
        policy,
        (
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
            active_B,
        ),
        dict(eps=eps),
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
    policy: DecodePolicy = XLA,
):
    """Speculative verify of T new tokens -> (y_BTHK, commit_data); the state is left untouched.

    The kernel reads the state once and keeps the running state on chip; the XLA form unrolls T <= 8 steps.
    """
    return _dispatch(
        "kda_verify",
        policy,
        (qkv_BT3HK, f_BTHK, beta_BTH, gate_BTHK, state_BHKV, conv_B3WHK, conv_w_3HKW, A_log_H, dt_bias_HK, o_norm_w_K),
        dict(eps=eps),
    )


def kda_commit(state_BHKV, conv_B3WHK, commit_data, accepted_B, *, policy: DecodePolicy = XLA):
    """Advance state and conv window by accepted_B[b] in [0, T] tokens -> (new_state, new_conv).

    A body refuses the commit where its tuning.json says "commit": "xla" (on the H200 XLA's one fused commit
    kernel is faster than the Pallas commit, whose per-token vector loads are a serial chain: kda_verify.md).
    """
    return _dispatch("kda_commit", policy, (state_BHKV, conv_B3WHK, commit_data, accepted_B), {})
