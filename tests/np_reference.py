"""Independent float64 NumPy oracle of the Kimi K3 text model, written only from docs/model.md §1-§8.

Everything is float64 with no bf16 rounding emulation: this is the exact maths the JAX code approximates.
Weights come as an HF-format dict `hf` keyed by checkpoint names relative to `language_model.model.`
(plus `lm_head.weight`), PyTorch layout [out, in]. Routed experts are MXFP4 packed (§7.2).
Nothing here imports k3jax: the point is to be an independent second implementation.
"""

import contextlib
import math

import ml_dtypes
import numpy as np

MLA_LOWRANK_EPS = 1e-6  # §1.4: q_a_layernorm / kv_a_layernorm use the HF default 1e-6
L2_EPS = 1e-6  # §1.4 / §4.3: x / sqrt(sum x^2 + 1e-6), the FLA in-kernel form

# §7.2: E2M1 code -> value; bit 3 is the sign, bits 0-2 index the magnitude table.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_TABLE = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


# ----------------------------------------------------------------------------------------------------------
# Small operators
# ----------------------------------------------------------------------------------------------------------
def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _lin(x, w_OI):
    """Linear_W(x) = x W^T (notation section; no biases anywhere)."""
    return _f64(x) @ _f64(w_OI).T


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * _f64(x)))  # overflow-free logistic


def silu(x):
    return x * sigmoid(x)


def softmax(s, axis):
    e = np.exp(s - np.max(s, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rms_norm(x, w, eps):
    """RMSNorm_w,eps(x) = w * x / sqrt(mean(x^2) + eps) over the last axis (notation section)."""
    x = _f64(x)
    return _f64(w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(g, u, beta1, beta2):
    """§3: SiTU(g) * cap(u) with SiTU(g) = b1 tanh(g/b1) sigma(g) (sigma of the UNCAPPED g),
    cap(u) = b2 tanh(u/b2) (identity when beta2 is None)."""
    g, u = _f64(g), _f64(u)
    up = u if beta2 is None else beta2 * np.tanh(u / beta2)
    return beta1 * np.tanh(g / beta1) * sigmoid(g) * up


def attn_res(sources_NTD, norm_w, proj_w_1D, eps):
    """§2.1 AttnRes: softmax over sources of <RMSNorm_a(v_i), p>, mixing the RAW sources.

    sources_NTD: list/array of n sources, each [T, D]. Returns [T, D]."""
    v_NTD = _f64(np.stack([_f64(s) for s in sources_NTD]))
    q_D = _f64(norm_w) * _f64(proj_w_1D).reshape(-1)  # only a * p[0] matters
    r_NT = 1.0 / np.sqrt(np.mean(v_NTD * v_NTD, axis=-1) + eps)
    alpha_NT = softmax(r_NT * (v_NTD @ q_D), axis=0)  # no temperature, no 1/sqrt(D)
    return np.sum(alpha_NT[..., None] * v_NTD, axis=0)


def mxfp4_dequant(packed, scale):
    """§7.2: uint8 packed [out, in/2] (low nibble = even column) and E8M0 scale [out, in/32]
    -> float64 [out, in]."""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    out, half = packed.shape
    codes = np.empty((out, 2 * half), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    group_scale = np.exp2(scale.astype(np.float64) - 127.0)  # 2^(e-127); e = 0 -> 2^-127 (NeMo/OCP)
    return E2M1_TABLE[codes] * np.repeat(group_scale, 32, axis=1)


# ----------------------------------------------------------------------------------------------------------
# Layer kinds (§1.3, §6)
# ----------------------------------------------------------------------------------------------------------
def is_mla_layer(tc, L):
    return (L + 1) in tc["linear_attn_config"]["full_attn_layers"]  # 1-based list


def is_moe_layer(tc, L):
    return L >= tc["first_k_dense_replace"] and L % tc.get("moe_layer_freq", 1) == 0


# ----------------------------------------------------------------------------------------------------------
# KDA (§4)
# ----------------------------------------------------------------------------------------------------------
def kda_recurrence(q_THK, k_THK, v_THV, g_THK, beta_TH, state_HKV):
    """§4.4 recurrent form, token by token. q, k already L2-normalised (q also scaled). Returns (o_THV, S)."""
    S = _f64(state_HKV).copy()
    o_THV = np.empty(v_THV.shape)
    for t in range(q_THK.shape[0]):
        S = np.exp(g_THK[t])[:, :, None] * S  # decay the key rows
        delta_HV = v_THV[t] - np.einsum("hkv,hk->hv", S, k_THK[t])
        S = S + beta_TH[t][:, None, None] * k_THK[t][:, :, None] * delta_HV[:, None, :]
        o_THV[t] = np.einsum("hkv,hk->hv", S, q_THK[t])  # reads the UPDATED state
    return o_THV, S


def l2_normalize(x, axis=-1):
    return x / np.sqrt(np.sum(x * x, axis=axis, keepdims=True) + L2_EPS)


def _short_conv(u_TC, w_C1W, prev_WmC):
    """§4.2 depthwise causal conv: y_t = sum_j w[j] u_{t-W+1+j}; returns (y_TC, last W-1 pre-conv inputs)."""
    w_CW = _f64(w_C1W).reshape(u_TC.shape[1], -1)
    width = w_CW.shape[1]
    full = np.concatenate([_f64(prev_WmC), u_TC], axis=0)  # [W-1+T, C], oldest first
    T = u_TC.shape[0]
    y_TC = sum(w_CW[:, j] * full[j : j + T] for j in range(width))
    return y_TC, full[full.shape[0] - (width - 1) :]


def kda_layer(hf, L, tc, x_TD, state=None, conv_state=None):
    """§4: full KDA layer on the normed input x_TD [T, D].

    state: [H, K, V] recurrent state (default zeros). conv_state: dict {'q','k','v'} or tuple (q, k, v) of
    [W-1, C] arrays = the last W-1 PRE-conv projected inputs, oldest first (default zeros).
    Returns (out_TD, new_state_HKV, new_conv_state as a tuple (q, k, v))."""
    p = f"layers.{L}.self_attn."
    la = tc["linear_attn_config"]
    H, K = la["num_heads"], la["head_dim"]
    T, C, width = x_TD.shape[0], H * K, la["short_conv_kernel_size"]
    x_TD = _f64(x_TD)
    if conv_state is None:
        conv_state = [np.zeros((width - 1, C))] * 3
    elif isinstance(conv_state, dict):
        conv_state = [conv_state[n] for n in "qkv"]
    if state is None:
        state = np.zeros((H, K, K))

    qkv, new_conv = [], []
    for name, prev in zip("qkv", conv_state, strict=True):
        u_TC = _lin(x_TD, hf[p + f"{name}_proj.weight"])
        y_TC, tail = _short_conv(u_TC, hf[p + f"{name}_conv1d.weight"], prev)
        qkv.append(silu(y_TC).reshape(T, H, K))
        new_conv.append(tail)
    q_THK, k_THK, v_THV = qkv

    # §4.3 bounded decay gate: g = lb * sigma(exp(A_log[h]) * (W_fb W_fa x + dt_bias)), per-head A_log.
    z_THK = _lin(_lin(x_TD, hf[p + "f_a_proj.weight"]), hf[p + "f_b_proj.weight"]) + _f64(hf[p + "dt_bias"])
    a_H = np.exp(_f64(hf[p + "A_log"]).reshape(-1)[:H])  # §7.4: stored padded to 128; flatten, take [:H]
    g_THK = la["gate_lower_bound"] * sigmoid(a_H[None, :, None] * z_THK.reshape(T, H, K))
    beta_TH = sigmoid(_lin(x_TD, hf[p + "b_proj.weight"]))
    q_THK = l2_normalize(q_THK) * K**-0.5  # scale AFTER the L2 norm
    k_THK = l2_normalize(k_THK)

    o_THV, new_state = kda_recurrence(q_THK, k_THK, v_THV, g_THK, beta_TH, state)

    # §4.6 gated output norm: per-head RMSNorm with the shared weight, then sigmoid(g_proj x).
    n_THV = rms_norm(o_THV, hf[p + "o_norm.weight"], tc["rms_norm_eps"])
    y_THV = n_THV * sigmoid(_lin(x_TD, hf[p + "g_proj.weight"])).reshape(T, H, K)
    return _lin(y_THV.reshape(T, C), hf[p + "o_proj.weight"]), new_state, tuple(new_conv)


# ----------------------------------------------------------------------------------------------------------
# MLA (§5)
# ----------------------------------------------------------------------------------------------------------
def mla_latent_rows(hf, L, tc, x_TD):
    """§5.2/§5.3 cache rows [T, kv_lora + rope] = [RMSNorm(kv[:r]; kv_a_layernorm, 1e-6) | raw kv[r:]].
    The pe tail is neither normalised nor rotated."""
    p = f"layers.{L}.self_attn."
    r = tc["kv_lora_rank"]
    kv = _lin(x_TD, hf[p + "kv_a_proj_with_mqa.weight"])
    c = rms_norm(kv[:, :r], hf[p + "kv_a_layernorm.weight"], MLA_LOWRANK_EPS)
    return np.concatenate([c, kv[:, r:]], axis=-1)


def mla_queries(hf, L, tc, x_TD):
    """§5.2 q = W_qb RMSNorm(W_qa x; q_a_layernorm, 1e-6) -> [T, nh, nope + rope]."""
    p = f"layers.{L}.self_attn."
    cq = rms_norm(_lin(x_TD, hf[p + "q_a_proj.weight"]), hf[p + "q_a_layernorm.weight"], MLA_LOWRANK_EPS)
    nh, dqk = tc["num_attention_heads"], tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]
    return _lin(cq, hf[p + "q_b_proj.weight"]).reshape(x_TD.shape[0], nh, dqk)


def mla_output(hf, L, tc, x_TD, o_THV):
    """§5.2 tail: u = concat_h o * sigma(W_g x) (gate before o_proj), out = W_o u."""
    p = f"layers.{L}.self_attn."
    u = o_THV.reshape(x_TD.shape[0], -1)
    if tc.get("mla_use_output_gate", True):
        u = u * sigmoid(_lin(x_TD, hf[p + "g_proj.weight"]))
    return _lin(u, hf[p + "o_proj.weight"])


def mla_layer(hf, L, tc, x_TD, past_latent=None):
    """§5.2 naive (non-absorbed) MLA, NoPE, causal over [past cache rows | current tokens].

    x_TD: normed input [T, D]; past_latent: optional [P, kv_lora + rope] rows of earlier tokens.
    Returns (out_TD, latent_rows_T576 of the current tokens)."""
    p = f"layers.{L}.self_attn."
    x_TD = _f64(x_TD)
    T = x_TD.shape[0]
    nh, nope, rope, vd, r = (
        tc[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    q_THQ = mla_queries(hf, L, tc, x_TD)
    rows = mla_latent_rows(hf, L, tc, x_TD)
    all_rows = rows if past_latent is None else np.concatenate([_f64(past_latent), rows], axis=0)
    S, P = all_rows.shape[0], all_rows.shape[0] - T

    # Per head, kv_b rows are [k_nope (nope) ; v (vd)].
    kv_SHN = _lin(all_rows[:, :r], hf[p + "kv_b_proj.weight"]).reshape(S, nh, nope + vd)
    k_pe_SHR = np.broadcast_to(all_rows[:, None, r:], (S, nh, rope))  # one shared unrotated "pe" key
    key_SHQ = np.concatenate([kv_SHN[..., :nope], k_pe_SHR], axis=-1)
    scores_HTS = np.einsum("thq,shq->hts", q_THQ, key_SHQ) * (nope + rope) ** -0.5
    causal_TS = np.arange(S)[None, :] <= (P + np.arange(T))[:, None]
    probs_HTS = softmax(np.where(causal_TS[None], scores_HTS, -np.inf), axis=-1)
    o_THV = np.einsum("hts,shv->thv", probs_HTS, kv_SHN[..., nope:])
    return mla_output(hf, L, tc, x_TD, o_THV), rows


# ----------------------------------------------------------------------------------------------------------
# FFNs (§3, §6)
# ----------------------------------------------------------------------------------------------------------
def _situ_ffn(tc, x, w_gate, w_up, w_down):
    beta1, beta2 = tc["activation_situ_beta"], tc["activation_situ_linear_beta"]
    h = situ_glu(_lin(x, w_gate), _lin(x, w_up), beta1, beta2)
    return _lin(h, w_down)


def dense_mlp(hf, L, tc, x_TD):
    """§6 dense layer: W_d SiTU-GLU(W_g x, W_u x)."""
    p = f"layers.{L}.mlp."
    return _situ_ffn(tc, x_TD, hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"], hf[p + "down_proj.weight"])


_ROUTING_MARGINS = None  # a list while record_routing_margins() is active


@contextlib.contextmanager
def record_routing_margins():
    """Yields a list that gets, for every router call inside, the smallest gap between a token's k-th and
    (k+1)-th biased score: where it is within a float32 path's error, that path may pick the other expert."""
    global _ROUTING_MARGINS
    _ROUTING_MARGINS = []
    try:
        yield _ROUTING_MARGINS
    finally:
        _ROUTING_MARGINS = None


def router(hf, L, tc, x_TD):
    """§6 router: sigma(W_gate x); top-k of (scores + correction bias); weights from UNBIASED scores,
    renormalised with +1e-20 (when k > 1 and moe_renormalize), then times routed_scaling_factor.
    Returns (sel_TK int indices, weights_TK float64)."""
    p = f"layers.{L}.block_sparse_moe.gate."
    s_TE = sigmoid(_lin(x_TD, hf[p + "weight"]))
    k = tc["num_experts_per_token"]
    biased_TE = s_TE + _f64(hf[p + "e_score_correction_bias"])
    order_TE = np.argsort(-biased_TE, axis=-1, kind="stable")
    sel_TK = order_TE[:, :k]
    if _ROUTING_MARGINS is not None and k < biased_TE.shape[-1]:
        kth, next_ = (np.take_along_axis(biased_TE, order_TE[:, i : i + 1], -1) for i in (k - 1, k))
        _ROUTING_MARGINS.append(float(np.min(kth - next_)))
    w_TK = np.take_along_axis(s_TE, sel_TK, axis=-1)
    if k > 1 and tc.get("moe_renormalize", True):
        w_TK = w_TK / (np.sum(w_TK, axis=-1, keepdims=True) + 1e-20)
    return sel_TK, w_TK * tc["routed_scaling_factor"]


def expert_weights(hf, L, e):
    """Dequantised (w1 gate, w3 up, w2 down) of routed expert e, [out, in] float64 (§7.2)."""
    p = f"layers.{L}.block_sparse_moe.experts.{e}."
    return tuple(mxfp4_dequant(hf[p + f"{w}.weight_packed"], hf[p + f"{w}.weight_scale"]) for w in ("w1", "w3", "w2"))


def moe(hf, L, tc, x_TD):
    """§6 latent MoE: routed experts in the latent space z = W_rd x, weighted sum, RMSNorm, W_ru; plus the
    shared experts on the full x. The router sees the full x."""
    p = f"layers.{L}.block_sparse_moe."
    x_TD = _f64(x_TD)
    sel_TK, w_TK = router(hf, L, tc, x_TD)
    z_TR = _lin(x_TD, hf[p + "routed_expert_down_proj.weight"])
    y_lat_TR = np.zeros_like(z_TR)
    for e in np.unique(sel_TK):
        w1, w3, w2 = expert_weights(hf, L, int(e))
        t_idx, k_idx = np.nonzero(sel_TK == e)
        y_lat_TR[t_idx] += w_TK[t_idx, k_idx][:, None] * _situ_ffn(tc, z_TR[t_idx], w1, w3, w2)
    if tc.get("latent_moe_use_norm", True):  # the norm comes AFTER the weighted sum, before the up-projection
        y_lat_TR = rms_norm(y_lat_TR, hf[p + "routed_expert_norm.weight"], tc["rms_norm_eps"])
    out_TD = _lin(y_lat_TR, hf[p + "routed_expert_up_proj.weight"])
    if tc.get("num_shared_experts", 0) > 0:
        sh = p + "shared_experts."
        out_TD = out_TD + _situ_ffn(
            tc, x_TD, hf[sh + "gate_proj.weight"], hf[sh + "up_proj.weight"], hf[sh + "down_proj.weight"]
        )
    return out_TD


# ----------------------------------------------------------------------------------------------------------
# Whole model (§2.3, §8.1)
# ----------------------------------------------------------------------------------------------------------
def forward(hf, tc, tokens_T, cache=None):
    """§2.3 decoder loop with AttnRes blocks, output AttnRes, final norm, lm_head. Returns logits [T, V].

    cache: optional dict, read and updated in place, so prefill + decode calls chain: cache[L] is
    (state, conv_state) for KDA layers and the [P, 576] latent rows for MLA layers. AttnRes itself carries
    nothing across tokens."""
    eps, bs = tc["rms_norm_eps"], tc["attn_res_block_size"]
    P = _f64(hf["embed_tokens.weight"])[np.asarray(tokens_T)]
    blocks = []
    for L in range(tc["num_hidden_layers"]):
        p = f"layers.{L}."
        h = (
            attn_res(
                blocks + [P], hf[p + "self_attention_res_norm.weight"], hf[p + "self_attention_res_proj.weight"], eps
            )
            if blocks
            else P
        )
        if L % bs == 0:  # boundary: snapshot the ENTERING state (after the attention-site mix), reset P
            blocks.append(P)
            P = np.zeros_like(P)
        x = rms_norm(h, hf[p + "input_layernorm.weight"], eps)
        if is_mla_layer(tc, L):
            a, rows = mla_layer(hf, L, tc, x, None if cache is None else cache.get(L))
            if cache is not None:
                cache[L] = rows if cache.get(L) is None else np.concatenate([cache[L], rows], axis=0)
        else:
            state, conv = (None, None) if cache is None else cache.get(L, (None, None))
            a, state, conv = kda_layer(hf, L, tc, x, state, conv)
            if cache is not None:
                cache[L] = (state, conv)
        P = P + a
        h = attn_res(blocks + [P], hf[p + "mlp_res_norm.weight"], hf[p + "mlp_res_proj.weight"], eps)
        x = rms_norm(h, hf[p + "post_attention_layernorm.weight"], eps)
        P = P + (moe(hf, L, tc, x) if is_moe_layer(tc, L) else dense_mlp(hf, L, tc, x))
    h_out = attn_res(blocks + [P], hf["output_attn_res_norm.weight"], hf["output_attn_res_proj.weight"], eps)
    return _lin(rms_norm(h_out, hf["norm.weight"], eps), hf["lm_head.weight"])


# ----------------------------------------------------------------------------------------------------------
# Test fixtures: a tiny config with every structural feature, and random HF-format weights
# ----------------------------------------------------------------------------------------------------------
def tiny_text_config():
    """A small K3-shaped text_config (§1.2 keys). 7 layers, AttnRes blocks of 3 (boundaries at L = 0, 3, 6),
    MLA at 0-based L = 3 and 6 (the last layer, like K3), layer 0 dense, latent MoE with latent != hidden.
    MXFP4 needs expert input widths divisible by 32: latent 96 (3 groups) and intermediate 32."""
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 7,
        "intermediate_size": 96,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "attn_res_block_size": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,  # auto-derived HF attribute, unused (§1.2)
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "kda_layers": [1, 2, 3, 5, 6],
            "full_attn_layers": [4, 7],
        },
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 96,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 250,
        "eos_token_id": 252,
        "pad_token_id": 255,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                        "scale_dtype": "uint8",
                    },
                    "input_activations": None,
                }
            },
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head"],
        },
    }


def random_hf_tensors(tc, seed):
    """Random HF-format text weights for `tc` (§7.3 names and shapes, relative to language_model.model.,
    plus 'lm_head.weight'). BF16 tensors are float32 arrays holding bf16-exact values, so a bf16 load is
    lossless; the fp32 tensors of §7.3 (A_log, dt_bias, convs, o_norm, correction bias) are full float32."""
    rng = np.random.default_rng(seed)
    D, V = tc["hidden_size"], tc["vocab_size"]
    la = tc["linear_attn_config"]
    H, K, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    nh, nope, rope, vd = (tc[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    R, MI, E = tc["routed_expert_hidden_size"], tc["moe_intermediate_size"], tc["num_experts"]

    def bf16(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    def proj(out, inp):
        return bf16(rng.standard_normal((out, inp)) / math.sqrt(inp))

    def norm_w(n):
        return bf16(1.0 + 0.1 * rng.standard_normal(n))

    def mxfp4(out, inp):
        return (
            rng.integers(0, 256, (out, inp // 2), dtype=np.uint8),
            rng.integers(118, 127, (out, inp // 32), dtype=np.uint8),
        )

    hf = {
        "embed_tokens.weight": bf16(rng.standard_normal((V, D))),
        "lm_head.weight": proj(V, D),
        "norm.weight": norm_w(D),
        "output_attn_res_norm.weight": norm_w(D),
        "output_attn_res_proj.weight": proj(1, D),
    }
    for L in range(tc["num_hidden_layers"]):
        p = f"layers.{L}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            hf[p + n + ".weight"] = norm_w(D)
        hf[p + "self_attention_res_proj.weight"] = proj(1, D)
        hf[p + "mlp_res_proj.weight"] = proj(1, D)
        a = p + "self_attn."
        if is_mla_layer(tc, L):
            r, qr = tc["kv_lora_rank"], tc["q_lora_rank"]
            hf[a + "q_a_proj.weight"] = proj(qr, D)
            hf[a + "q_a_layernorm.weight"] = norm_w(qr)
            hf[a + "q_b_proj.weight"] = proj(nh * (nope + rope), qr)
            hf[a + "kv_a_proj_with_mqa.weight"] = proj(r + rope, D)
            hf[a + "kv_a_layernorm.weight"] = norm_w(r)
            hf[a + "kv_b_proj.weight"] = proj(nh * (nope + vd), r)
            hf[a + "g_proj.weight"] = proj(nh * vd, D)
            hf[a + "o_proj.weight"] = proj(D, nh * vd)
        else:
            C = H * K
            for n in "qkvg":
                hf[a + f"{n}_proj.weight"] = proj(C, D)
            for n in "qkv":
                hf[a + f"{n}_conv1d.weight"] = (rng.standard_normal((C, 1, width)) / math.sqrt(width)).astype(
                    np.float32
                )
            hf[a + "f_a_proj.weight"] = proj(K, D)
            hf[a + "f_b_proj.weight"] = proj(C, K)
            hf[a + "b_proj.weight"] = proj(H, D)
            a_log = np.zeros(max(128, -(-H // 128) * 128), np.float32)  # §7.4: padded with exact zeros
            a_log[:H] = np.log(rng.uniform(1.0, 16.0, H))
            hf[a + "A_log"] = a_log
            hf[a + "dt_bias"] = (0.5 * rng.standard_normal(C)).astype(np.float32)
            hf[a + "o_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
            hf[a + "o_proj.weight"] = proj(D, C)
        if is_moe_layer(tc, L):
            m = p + "block_sparse_moe."
            hf[m + "gate.weight"] = proj(E, D)
            hf[m + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
            hf[m + "routed_expert_down_proj.weight"] = proj(R, D)
            hf[m + "routed_expert_norm.weight"] = norm_w(R)
            hf[m + "routed_expert_up_proj.weight"] = proj(D, R)
            S = tc["num_shared_experts"] * MI
            if S:
                hf[m + "shared_experts.gate_proj.weight"] = proj(S, D)
                hf[m + "shared_experts.up_proj.weight"] = proj(S, D)
                hf[m + "shared_experts.down_proj.weight"] = proj(D, S)
            for e in range(E):
                for w, (out, inp) in (("w1", (MI, R)), ("w3", (MI, R)), ("w2", (R, MI))):
                    hf[m + f"experts.{e}.{w}.weight_packed"], hf[m + f"experts.{e}.{w}.weight_scale"] = mxfp4(out, inp)
        else:
            d, Iw = p + "mlp.", tc["intermediate_size"]
            hf[d + "gate_proj.weight"] = proj(Iw, D)
            hf[d + "up_proj.weight"] = proj(Iw, D)
            hf[d + "down_proj.weight"] = proj(D, Iw)
    return hf
