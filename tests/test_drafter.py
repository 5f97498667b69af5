"""DSpark drafter (docs/model.md §9) against an independent float64 NumPy transcription of §9.3 from the HF
tensors; config/table/checkpoint round trips; the drafter inside speculative decoding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rms

from convert.fake_dspark import tiny_dspark_config, write_fake_dspark
from convert.safetensors_io import read, read_header
from k3jax import cache as cache_lib
from k3jax import drafter_params as DP
from k3jax import model, speculative
from k3jax.config import preset
from k3jax.drafter import DSparkDrafter
from k3jax.params import cast_params, init_params

F32 = jnp.float32


def test_release_config_and_table():
    c = DP.DSparkConfig()
    assert DP.DSparkConfig.from_hf(c.to_hf()) == c
    assert abs(c.softmax_scale - 0.130861) < 1e-6  # §9.3
    n = sum(math.prod(s.shape) for s in DP.tensor_table(c))
    assert n == 2_387_907_841  # §9.1: the checkpoint's owned count (the embed_tokens copy is not owned)


def test_checkpoint_roundtrip(tmp_path, rng):
    c = tiny_dspark_config(preset("tiny"))
    want = write_fake_dspark(str(tmp_path), c, seed=int(rng.integers(1 << 30)))
    c2, got = DP.load(str(tmp_path))
    assert c2 == c
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ---- float64 NumPy reference (HF tensors, naive un-absorbed MLA, complex-number RoPE) ----------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _inv_freq(c):
    d, base, f = c.qk_rope_head_dim, c.rope_theta, c.rope_factor
    pos_freqs = base ** (np.arange(0, d, 2) / d)

    def corr(rot):
        return d * np.log(c.rope_original_max_position_embeddings / (rot * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(np.floor(corr(c.rope_beta_fast)), 0), min(np.ceil(corr(c.rope_beta_slow)), d - 1)
    if lo == hi:
        hi += 0.001
    extrapolate = 1 - np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)
    return (1 / (f * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate


def _rope(x, pos, c):  # x [..., T, (H,) P] as complex pairs (2i, 2i+1)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    ang = np.asarray(pos, np.float64)[:, None] * _inv_freq(c)[None]
    if z.ndim == 3:
        ang = ang[:, None]
    z = z * np.exp(1j * ang)
    return np.stack([z.real, z.imag], -1).reshape(x.shape)


def _kv(hf, j, x, pos, c):
    a = f"layers.{j}.self_attn."
    kv = x @ hf[a + "kv_a_proj_with_mqa.weight"].T
    R = c.kv_lora_rank
    return _rms(kv[:, :R], hf[a + "kv_a_layernorm.weight"], 1e-6), _rope(kv[:, R:], pos, c)


def reference_propose(hf, c, embed, lm_head, taps_TC, anchor, preds, K):
    """One sequence: context taps at positions 0..S-1, anchor at S. preds: Markov predecessors (K)."""
    S = taps_TC.shape[0]
    eps, H, N = c.rms_norm_eps, c.num_attention_heads, c.qk_nope_head_dim
    ctx = _rms(taps_TC @ hf["context_proj.weight"].T, hf["context_norm.weight"], eps)
    x = embed[[anchor] + [c.mask_token_id] * (K - 1)]
    bpos = S + np.arange(K)
    for j in range(c.num_hidden_layers):
        a = f"layers.{j}.self_attn."
        hn = _rms(x, hf[f"layers.{j}.input_layernorm.weight"], eps)
        q_lat = _rms(hn @ hf[a + "q_a_proj.weight"].T, hf[a + "q_a_layernorm.weight"], 1e-6)
        q = q_lat @ hf[a + "q_b_proj.weight"].T
        q = q.reshape(K, H, -1)
        q_nope, q_pe = q[..., :N], _rope(q[..., N:], bpos, c)
        c0, p0 = _kv(hf, j, ctx, np.arange(S), c)
        c1, p1 = _kv(hf, j, hn, bpos, c)
        lat, k_pe = np.concatenate([c0, c1]), np.concatenate([p0, p1])
        kvb = (lat @ hf[a + "kv_b_proj.weight"].T).reshape(len(lat), H, -1)
        k_nope, v = kvb[..., :N], kvb[..., N:]
        s = np.einsum("thn,shn->hts", q_nope, k_nope) + np.einsum("the,se->hts", q_pe, k_pe)
        s *= c.softmax_scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hts,shv->thv", p, v).reshape(K, -1)
        x = x + o @ hf[a + "o_proj.weight"].T
        m = f"layers.{j}.mlp."
        hn = _rms(x, hf[f"layers.{j}.post_attention_layernorm.weight"], eps)
        g = hn @ hf[m + "gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (hn @ hf[m + "up_proj.weight"].T)) @ hf[m + "down_proj.weight"].T
    h = _rms(x, hf["final_norm.weight"], eps)
    e = hf["markov_head.markov_w1.weight"][preds]
    logits = h @ lm_head + e @ hf["markov_head.markov_w2.weight"].T
    feat = np.concatenate([h, e], -1)
    z = feat @ hf["confidence_head.proj.weight"][0] + hf["confidence_head.proj.bias"][0]
    conf = 1 / (1 + np.exp(-z))
    return logits, conf


def test_dspark_matches_reference(tmp_path, rng):
    target = preset("tiny")
    c = tiny_dspark_config(target, rope_factor=4.0, rope_original_max_position_embeddings=16)  # a real ramp
    write_fake_dspark(str(tmp_path), c, seed=int(rng.integers(1 << 30)))
    _, dp = DP.load(str(tmp_path), F32)
    entries = read_header(str(tmp_path / "model.safetensors"))
    hf = {k: np.asarray(read(e), np.float64) for k, e in entries.items()}
    D, V, K, B = c.hidden_size, c.vocab_size, 5, 2
    embed, lm_head = rng.standard_normal((V, D)), rng.standard_normal((D, V)) / np.sqrt(D)
    tp = {"embed": jnp.asarray(embed, F32), "lm_head": jnp.asarray(lm_head, F32)}
    n = np.array([int(rng.integers(3, 9)), int(rng.integers(9, 14))])
    T = 14
    taps = {L: rng.standard_normal((B, T, D)) for L in c.target_layer_ids}
    d = DSparkDrafter(c)
    state = d.init_state(B, 32, F32)
    # context in two pieces (a prefill, then a commit of 1 + junk rows), as the speculative loop feeds it
    first = n - 1
    jt = {L: jnp.asarray(v, F32) for L, v in taps.items()}
    zeros = jnp.zeros(B, jnp.int32)
    state = d.observe(dp, tp, state, jnp.zeros((B, T), jnp.int32), jnp.asarray(first), zeros, jt)
    last = {}
    for L, v in taps.items():
        rows = np.full((B, 3, D), 1e3)  # junk beyond the one committed row
        rows[:, 0] = v[np.arange(B), first]
        last[L] = jnp.asarray(rows, F32)
    state = d.observe(dp, tp, state, jnp.zeros((B, 3), jnp.int32), jnp.ones(B, jnp.int32), jnp.asarray(first), last)
    anchor = rng.integers(0, V, size=B)
    prop = d.propose(
        dp,
        tp,
        state,
        jnp.asarray(anchor, jnp.int32),
        jnp.asarray(n, jnp.int32),
        K,
        jax.random.key(int(rng.integers(1 << 30))),
        1.0,
    )
    greedy = d.propose(dp, tp, state, jnp.asarray(anchor, jnp.int32), jnp.asarray(n, jnp.int32), K, None, 0.0)
    for b in range(B):
        cat = np.concatenate([taps[L][b, : n[b]] for L in c.target_layer_ids], -1)
        drafts = np.asarray(prop.drafts_BK[b])
        logits, conf = reference_propose(hf, c, embed, lm_head, cat, anchor[b], [anchor[b], *drafts[:-1]], K)
        q = np.exp(logits - logits.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        err = rel_rms(prop.q_BKV[b], q)
        print(f"b={b} context={n[b]} q rel err {err:.2e}")
        assert err < 1e-4
        np.testing.assert_allclose(np.asarray(prop.confidence_BK[b]), conf, rtol=1e-4, atol=1e-6)
        # greedy: the reference Markov chain of argmaxes
        preds, want = [anchor[b]], []
        for i in range(K):
            padded = preds + [0] * (K - len(preds))  # rows past i do not influence row i
            lg, _ = reference_propose(hf, c, embed, lm_head, cat, anchor[b], padded, K)
            want.append(int(lg[i].argmax()))
            preds.append(want[-1])
        np.testing.assert_array_equal(np.asarray(greedy.drafts_BK[b]), want)


# ---- in the speculative loop ------------------------------------------------------------------------------


def test_dspark_in_speculative_loop(tmp_path, rng):
    """Greedy speculative decoding with DSpark == plain greedy decoding, and the drafter's context cache,
    built step by step from verify taps, equals one built from a single forward over the final sequence."""
    cfg = preset("tiny").replace(num_hidden_layers=4, full_attn_layers=(2, 4))
    seed = int(rng.integers(1 << 30))
    params = cast_params(jax.jit(lambda: init_params(cfg, seed))(), F32)
    c = tiny_dspark_config(cfg)
    write_fake_dspark(str(tmp_path), c, seed=seed)
    _, dp = DP.load(str(tmp_path), F32)
    drafter = DSparkDrafter(c)
    B, K, max_new, P = 2, 3, 8, 7
    n_prompt = np.array([P, int(rng.integers(2, P))], np.int32)
    prompt = rng.integers(0, cfg.vocab_size, size=(B, P)).astype(np.int32)
    spec = speculative.SpecConfig(cfg, drafter, K, max_new, dtype=F32)
    max_len = P + max_new + K + 1
    st = speculative.prefill_jit(
        spec, params, dp, jnp.asarray(prompt), jnp.asarray(n_prompt), jax.random.key(0), max_len
    )
    st = speculative.loop_jit(spec, params, dp, st)
    out = np.asarray(st.out_BN)
    got = out[:, :max_new]
    lengths = np.asarray(st.cache["lengths"])  # every token committed to the target cache
    seq = np.zeros((B, lengths.max()), np.int32)
    for b in range(B):
        full = np.concatenate([prompt[b, : n_prompt[b]], out[b]])
        seq[b, : lengths[b]] = full[: lengths[b]]
    # one causal extend over everything committed: its argmax at each position is plain greedy decoding, and
    # its taps rebuild the drafter's context cache in one go
    cache = cache_lib.init_cache(cfg, B, max_len, F32, "bf16")
    logits, _, taps = model.extend(
        params, jnp.asarray(seq), jnp.asarray(lengths), cache, cfg, F32, all_logits=True, taps=drafter.taps
    )
    for b in range(B):
        want = np.asarray(logits[b, n_prompt[b] - 1 : lengths[b]]).argmax(-1)
        n = min(max_new, len(want))
        np.testing.assert_array_equal(got[b, :n], want[:n])
    fresh = drafter.observe(
        dp,
        params,
        drafter.init_state(B, max_len, F32),
        jnp.asarray(seq),
        jnp.asarray(lengths),
        jnp.zeros(B, jnp.int32),
        taps,
    )
    for r_got, r_want in zip(st.draft_state["rows"], fresh["rows"], strict=True):
        for b in range(B):
            assert rel_rms(r_got[b, : lengths[b]], r_want[b, : lengths[b]]) < 1e-5
    print("accepted per step:", speculative.stats(st)["accepted_per_step"].tolist())


@pytest.mark.parametrize("bad", ["mla_use_nope"])
def test_config_refuses_nope(bad):
    with pytest.raises(ValueError):
        DP.DSparkConfig.from_hf(DP.DSparkConfig().to_hf() | {bad: True})
