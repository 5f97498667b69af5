"""Self-checks of the float64 NumPy oracle (tests/np_reference.py) against independently coded forms of docs/model.md.

No k3jax here: these make sure the oracle itself is right before anything is tested against it.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import np_reference as ref  # noqa: E402

TC = ref.tiny_text_config()
MLA_L = [L for L in range(TC["num_hidden_layers"]) if ref.is_mla_layer(TC, L)]
KDA_L = [L for L in range(TC["num_hidden_layers"]) if not ref.is_mla_layer(TC, L)]
MOE_L = [L for L in range(TC["num_hidden_layers"]) if ref.is_moe_layer(TC, L)]


@pytest.fixture(scope="module")
def hf():
    return ref.random_hf_tensors(TC, seed=int(np.random.default_rng().integers(1 << 31)))


@pytest.fixture
def rng():
    return np.random.default_rng()


def test_tiny_config_has_every_structural_feature():
    assert MLA_L == [3, 6] and 0 not in MOE_L and MOE_L == list(range(1, 7))
    assert TC["routed_expert_hidden_size"] != TC["hidden_size"]
    assert TC["routed_expert_hidden_size"] % 32 == 0 and TC["moe_intermediate_size"] % 32 == 0


# ---- KDA: recurrent form (§4.4) == chunk form (§4.5) ------------------------------------------------------
def _kda_chunk_form(q_THK, k_THK, v_THV, g_THK, beta_TH, S_HKV, chunk):
    """§4.5 written independently: per head and chunk, pairwise-difference exponentials exp(G_r - G_c)."""
    T, H, K = q_THK.shape
    S_HKV = S_HKV.copy()
    o_THV = np.zeros(v_THV.shape)
    for h in range(H):
        S = S_HKV[h]
        for i0 in range(0, T, chunk):
            sl = slice(i0, min(i0 + chunk, T))
            q, k, v, b = q_THK[sl, h], k_THK[sl, h], v_THV[sl, h], beta_TH[sl, h]
            C = q.shape[0]
            G = np.cumsum(g_THK[sl, h], axis=0)  # [C, K]
            diff_CCK = G[:, None, :] - G[None, :, :]
            lower = np.tril(np.ones((C, C), bool))
            decay_CCK = np.exp(np.where(lower[:, :, None], diff_CCK, 0.0))  # only c <= r is ever used
            Lm = np.where(np.tril(lower, -1), b[:, None] * np.einsum("rd,rcd,cd->rc", k, decay_CCK, k), 0.0)
            Tm = np.linalg.solve(np.eye(C) + Lm, np.diag(b))
            W = Tm @ (np.exp(G) * k)
            U = Tm @ v
            Aqk = np.where(lower, np.einsum("rd,rcd,cd->rc", q, decay_CCK, k), 0.0)
            Vt = U - W @ S
            o_THV[sl, h] = (q * np.exp(G)) @ S + Aqk @ Vt
            S = np.exp(G[-1])[:, None] * S + (np.exp(G[-1][None, :] - G) * k).T @ Vt
        S_HKV[h] = S
    return o_THV, S_HKV


def test_kda_recurrence_equals_chunk_form(rng):
    T, H, K, V = 11, 3, 8, 6  # T not a multiple of the chunk, V != K
    q = ref.l2_normalize(rng.standard_normal((T, H, K))) * K**-0.5
    k = ref.l2_normalize(rng.standard_normal((T, H, K)))
    v = rng.standard_normal((T, H, V))
    g = -5.0 * ref.sigmoid(2.0 * rng.standard_normal((T, H, K)))  # bounded form, in (-5, 0)
    beta = ref.sigmoid(rng.standard_normal((T, H)))
    S0 = rng.standard_normal((H, K, V))
    o_rec, S_rec = ref.kda_recurrence(q, k, v, g, beta, S0)
    o_chk, S_chk = _kda_chunk_form(q, k, v, g, beta, S0, chunk=4)
    np.testing.assert_allclose(o_rec, o_chk, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S_rec, S_chk, rtol=1e-10, atol=1e-12)
    assert np.abs(o_rec).max() > 1e-3  # not a trivially-zero comparison


def test_kda_layer_split_sequence_with_states_equals_full(hf, rng):
    L = KDA_L[1]
    x = rng.standard_normal((9, TC["hidden_size"]))
    out_full, S_full, conv_full = ref.kda_layer(hf, L, TC, x)
    out_a, S_a, conv_a = ref.kda_layer(hf, L, TC, x[:2])  # shorter than the conv window
    conv_dict = dict(zip("qkv", conv_a, strict=True))
    out_b, S_b, conv_b = ref.kda_layer(hf, L, TC, x[2:], S_a, conv_dict)
    np.testing.assert_allclose(np.concatenate([out_a, out_b]), out_full, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S_b, S_full, rtol=1e-10, atol=1e-12)
    for a, b in zip(conv_b, conv_full, strict=True):
        np.testing.assert_array_equal(a, b)


# ---- MLA: absorbed (§5.3) == naive (§5.2) -----------------------------------------------------------------
def _mla_absorbed(hf, L, tc, x_TD, past_rows):
    """§5.3: q_lat = W_UK^T q_nope, scores vs the cached latent, value = latent, then W_UV."""
    p = f"layers.{L}.self_attn."
    nh, nope, rope, vd, r = 4, 16, 8, 16, 16
    cq = ref.rms_norm(x_TD @ hf[p + "q_a_proj.weight"].T, hf[p + "q_a_layernorm.weight"], 1e-6)
    q = (cq @ np.float64(hf[p + "q_b_proj.weight"]).T).reshape(len(x_TD), nh, nope + rope)
    kv = x_TD @ np.float64(hf[p + "kv_a_proj_with_mqa.weight"]).T
    rows = np.concatenate([ref.rms_norm(kv[:, :r], hf[p + "kv_a_layernorm.weight"], 1e-6), kv[:, r:]], -1)
    cache = np.concatenate([past_rows, rows])
    W = np.float64(hf[p + "kv_b_proj.weight"]).reshape(nh, nope + vd, r)
    q_lat = np.einsum("hnr,thn->thr", W[:, :nope], q[..., :nope])
    s = np.einsum("thr,sr->ths", q_lat, cache[:, :r]) + np.einsum("the,se->ths", q[..., nope:], cache[:, r:])
    s = s / np.sqrt(nope + rope)
    P, T = len(past_rows), len(x_TD)
    s = np.where(np.arange(P + T)[None, None, :] <= P + np.arange(T)[:, None, None], s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("hvr,thr->thv", W[:, nope:], np.einsum("ths,sr->thr", prob, cache[:, :r]))
    u = o.reshape(T, -1) * ref.sigmoid(x_TD @ np.float64(hf[p + "g_proj.weight"]).T)
    return u @ np.float64(hf[p + "o_proj.weight"]).T


def test_mla_absorbed_equals_naive_and_cache_split(hf, rng):
    assert (
        TC["num_attention_heads"],
        TC["qk_nope_head_dim"],
        TC["qk_rope_head_dim"],
        TC["v_head_dim"],
        TC["kv_lora_rank"],
    ) == (4, 16, 8, 16, 16)
    L = MLA_L[0]
    x = rng.standard_normal((7, TC["hidden_size"]))
    out_full, rows_full = ref.mla_layer(hf, L, TC, x)
    assert rows_full.shape == (7, TC["kv_lora_rank"] + TC["qk_rope_head_dim"])
    out_a, rows_a = ref.mla_layer(hf, L, TC, x[:4])
    out_b, rows_b = ref.mla_layer(hf, L, TC, x[4:], past_latent=rows_a)
    np.testing.assert_allclose(np.concatenate([out_a, out_b]), out_full, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([rows_a, rows_b]), rows_full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(_mla_absorbed(hf, L, TC, x[4:], rows_a), out_b, rtol=1e-10, atol=1e-12)


# ---- MXFP4 (§7.2) -----------------------------------------------------------------------------------------
def test_mxfp4_golden_pack_and_group_axis(rng):
    # §7.2 golden bytes: codes 0..15 pack two per byte (low nibble first) into 0x10, 0x32, ..., 0xFE.
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], np.uint8)  # 32 codes = 1 group
    w = ref.mxfp4_dequant(packed, np.array([[127]], np.uint8))  # 2^0
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(w[0], (mags + [-m for m in mags]) * 2)
    assert np.signbit(w[0, 8])  # code 8 is -0
    # Scales: E8M0 2^(e-127) per 32 consecutive `in` elements of a row. All codes 2 (= 1.0) expose the scale.
    e = rng.integers(110, 140, (3, 4), dtype=np.uint8)
    w = ref.mxfp4_dequant(np.full((3, 64), 0x22, np.uint8), e)
    assert w.shape == (3, 128)
    for o in range(3):
        for g in range(4):
            np.testing.assert_array_equal(w[o, 32 * g : 32 * g + 32], 2.0 ** (int(e[o, g]) - 127))


# ---- AttnRes (§2.1) ---------------------------------------------------------------------------------------
def test_attn_res_single_and_identical_sources(rng):
    T, D = 5, 32
    v = rng.standard_normal((T, D))
    a, p = 1 + 0.1 * rng.standard_normal(D), rng.standard_normal((1, D))
    np.testing.assert_allclose(ref.attn_res([v], a, p, 1e-5), v, rtol=1e-14)
    np.testing.assert_allclose(ref.attn_res([v, v, v], a, p, 1e-5), v, rtol=1e-13)
    # A source whose normalised key is far better aligned with a*p wins the softmax, whatever its scale.
    w = 1e3 * (p[0] / a)[None, :].repeat(T, 0)  # RMSNorm_a(w) is proportional to p: score ~ sqrt(D)*|p|
    mixed = ref.attn_res([v, w], a, 20.0 * p, 1e-5)
    np.testing.assert_allclose(mixed, w, rtol=1e-6)


# ---- Router (§6) ------------------------------------------------------------------------------------------
def test_router_bias_selects_but_does_not_weight(hf, rng):
    L = MOE_L[0]
    x = rng.standard_normal((6, TC["hidden_size"]))
    h = dict(hf)
    bias = np.zeros(TC["num_experts"])
    bias[5] = 100.0  # forces expert 5 into every token's top-k
    h[f"layers.{L}.block_sparse_moe.gate.e_score_correction_bias"] = bias
    sel, w = ref.router(h, L, TC, x)
    assert sel.shape == w.shape == (6, TC["num_experts_per_token"])
    assert all(5 in row for row in sel)
    s = ref.sigmoid(x @ np.float64(hf[f"layers.{L}.block_sparse_moe.gate.weight"]).T)
    s_sel = np.take_along_axis(s, sel, 1)
    np.testing.assert_allclose(w, s_sel / s_sel.sum(1, keepdims=True))
    np.testing.assert_allclose(w.sum(1), TC["routed_scaling_factor"])


# ---- Whole model (§2.3) -----------------------------------------------------------------------------------
def test_forward_causal_and_cached_decode_matches_full(hf, rng):
    tokens = rng.integers(0, TC["vocab_size"], 8)
    logits = ref.forward(hf, TC, tokens)
    assert logits.shape == (8, TC["vocab_size"]) and np.isfinite(logits).all() and logits.std() > 1e-3
    np.testing.assert_allclose(ref.forward(hf, TC, tokens[:5]), logits[:5], rtol=1e-9, atol=1e-10)
    cache = {}
    pre = ref.forward(hf, TC, tokens[:6], cache)
    steps = [ref.forward(hf, TC, tokens[t : t + 1], cache) for t in (6, 7)]
    np.testing.assert_allclose(np.concatenate([pre, *steps]), logits, rtol=1e-9, atol=1e-10)


def test_attn_res_source_counts_follow_spec_table(hf, rng, monkeypatch):
    """§2.4: attention site ceil(L/bs)+1 sources (none at L=0), MLP site floor(L/bs)+2, output ceil(n/bs)+1;
    blocks[0] is the raw embedding."""
    calls = []
    real = ref.attn_res
    monkeypatch.setattr(ref, "attn_res", lambda src, *a: calls.append(list(src)) or real(src, *a))
    tokens = rng.integers(0, TC["vocab_size"], 3)
    ref.forward(hf, TC, tokens)
    bs, n = TC["attn_res_block_size"], TC["num_hidden_layers"]
    want = [2]  # layer 0: MLP site only
    for L in range(1, n):
        want += [-(-L // bs) + 1, L // bs + 2]
    want.append(-(-n // bs) + 1)
    assert [len(c) for c in calls] == want
    emb = np.float64(hf["embed_tokens.weight"])[tokens]
    assert all(np.array_equal(c[0], emb) for c in calls)
    # At a boundary L > 0 the stored block is the ENTERING P (last attention-site source), not the mix h.
    for L in range(bs, n, bs):
        att, mlp = calls[2 * L - 1], calls[2 * L]
        assert np.array_equal(mlp[-2], att[-1]) and not np.allclose(mlp[-2], real(att, *_res_w(hf, L)))


def _res_w(hf, L):
    p = f"layers.{L}."
    norm_w, proj_w = hf[p + "self_attention_res_norm.weight"], hf[p + "self_attention_res_proj.weight"]
    return norm_w, proj_w, TC["rms_norm_eps"]
