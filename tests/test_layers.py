"""Every layer against the independent float64 NumPy oracle (tests/np_reference.py), fp32 compute.

Weights come from the oracle's own random HF-format generator and reach our layout through the converter's
transforms (transforms.from_hf), so the layout mapping is checked too. Layers run eagerly (no jit): at these
sizes op-by-op dispatch is much cheaper than compiling, which keeps the file fast on a 2-core CPU.
"""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import oracle_clear_of_route_ties, rel_rms

from k3jax import model, transforms
from k3jax import params as P
from k3jax.comm import Comm
from k3jax.config import preset
from k3jax.layers import common, kda, mla, moe
from pallas_kernels import policy as policy_lib
from pallas_kernels.collectives import reference
from pallas_kernels.moe import reference as moe_reference
from pallas_kernels.policy import DecodePolicy

F32 = jnp.float32
TOL = 1e-5  # relative RMS error of one layer, fp32 vs float64 (worst of 40 seeds per test: 2.2e-6, median 3e-7)
# A whole model is held to the product's bar (as in test_model_vs_reference.py): <= 2e-5 relative RMS in fp32.
# Over 30 seeds each of the three block layouts below the median is 1.3e-6..2.7e-6 and the worst 8.5e-6 (block 3
# over 8 layers), so 1e-5 would fail now and then on the float32 floor of an ill-conditioned draw. The bar still
# catches bookkeeping bugs: AttnRes weights off by 10% alone move the logits by 0.7 relative RMS.
MODEL_TOL = 2e-5
# The block layouts' whole models (test_attn_res_block_sizes_whole_model) check the AttnRes bookkeeping, whose
# bugs move the logits by O(0.1-1): over 600 draws of the deepest (14 layers, block 12) the median was 2.6e-6, the
# 99th percentile 1.1e-5 and the worst 6.8e-5 (routing margins >= 1.3e-4, so no expert flipped: the float32
# floor of an ill-conditioned draw; our model in float64 with its fp32 islands was 5.7e-6 off on it). The
# product's 2e-5 bar on a whole model is test_model_vs_reference's.
BOOKKEEPING_TOL = 1e-4


def model_from_oracle(cfg, rng):
    """(our params in fp32, the oracle's HF dict, the HF text_config) for a fresh random model."""
    tc = cfg.to_hf(wrapped=False)
    hf = ref.random_hf_tensors(tc, int(rng.integers(1 << 31)))
    flat = {}
    for spec in P.tensor_table(cfg):
        names = [n.removeprefix(P.HF_PREFIX).removeprefix("model.") for n in spec.hf_names]
        flat[spec.path] = jnp.asarray(transforms.from_hf(spec, [hf[n] for n in names]))
    return P.cast_params(P.unflatten(flat), F32), hf, tc


@pytest.fixture
def tiny(rng):
    cfg = preset("tiny")
    assert cfg.layer_kinds[:4] == ("kda_dense", "kda_moe", "kda_moe", "mla_moe")
    return (cfg, *model_from_oracle(cfg, rng))


def _x(rng, *shape):
    return rng.standard_normal(shape) * rng.uniform(0.5, 2.0)


def _check(got, want, what, tol=TOL):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    err = rel_rms(got, want)
    print(f"{what}: relative RMS error {err:.1e}")
    assert err <= tol, what


# ---- small operators --------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 3e-3])  # the small scale makes eps matter
def test_rms_norm(rng, scale):
    x, w = _x(rng, 5, 64) * scale, 1 + 0.1 * rng.standard_normal(64)
    _check(common.rms_norm(F32(x), F32(w), 1e-5), ref.rms_norm(F32(x), F32(w), 1e-5), "rms_norm")


@pytest.mark.parametrize("beta2", [25.0, None])
def test_situ_glu(rng, beta2):
    g, u = 20 * rng.standard_normal((6, 40)), 40 * rng.standard_normal((6, 40))  # reaches both soft caps
    _check(common.situ_glu(F32(g), F32(u), 4.0, beta2), ref.situ_glu(F32(g), F32(u), 4.0, beta2), "situ_glu")


def test_attn_res_operator(rng):
    N, T, D = int(rng.integers(2, 10)), 5, 48
    src = np.stack([_x(rng, T, D) * rng.uniform(0.1, 10) for _ in range(N)]).astype(np.float32)
    a, p = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    out, alpha = reference.attn_res(jnp.asarray(src), a, p, 1e-5, return_weights=True)
    _check(out, ref.attn_res(list(src), a, p[None], 1e-5), f"attn_res N={N}")
    np.testing.assert_allclose(np.sum(alpha, axis=0), 1.0, rtol=1e-6)
    one = reference.attn_res(jnp.asarray(src[:1]), a, p, 1e-5)  # one source: returned unchanged
    np.testing.assert_allclose(one, src[0], rtol=1e-6)


@pytest.mark.parametrize("block, layers", [(2, 5), (3, 8), (12, 14)])
def test_attn_res_block_sizes_whole_model(rng, block, layers):
    """Whole models whose AttnRes blocks are 2, 3 and 12 layers (block 2 over 5 layers ends on a boundary
    layer). KDA at layer 0, MLA elsewhere (an eager KDA layer costs ~10x an MLA one): the sublayers are
    covered below; this checks the block bookkeeping (snapshot of the entering prefix, reset, source counts,
    output mix)."""
    cfg = preset("tiny").replace(
        num_hidden_layers=layers, attn_res_block_size=block, full_attn_layers=tuple(range(2, layers + 1))
    )
    assert [L for L in range(layers) if cfg.is_block_boundary(L)] == list(range(0, layers, block))
    params, hf, tc = model_from_oracle(cfg, rng)
    # one length for all three: eager ops compile once
    tokens, want = oracle_clear_of_route_ties(hf, tc, lambda: rng.integers(0, cfg.vocab_size, 7))
    got = model.forward(params, jnp.asarray(tokens)[None], cfg, F32)[0]
    _check(got, want, f"forward block={block} layers={layers}", tol=BOOKKEEPING_TOL)


# ---- KDA --------------------------------------------------------------------------------------------------
def _kda_window(conv_tuple, H, K):
    """oracle conv state (q, k, v), each [W-1, H*K] -> ours [3, W-1, H, K]."""
    return np.stack([c.reshape(c.shape[0], H, K) for c in conv_tuple])


def test_kda_layer_from_zero_state(rng, tiny):
    cfg, params, hf, tc = tiny
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    T = int(rng.integers(5, 40))
    lengths = np.array([T, int(rng.integers(1, T))])
    x = _x(rng, 2, T, cfg.hidden_size)
    out, state, window = kda.kda_prefill(
        params["layers"][0]["attn"],
        F32(x),
        cfg,
        jnp.asarray(lengths),
        jnp.zeros((2, H, K, K), F32),
        jnp.zeros((2, 3, W - 1, H, K), F32),
    )
    for b, n in enumerate(lengths):
        o_ref, s_ref, conv_ref = ref.kda_layer(hf, 0, tc, x[b, :n])
        _check(np.asarray(out)[b, :n], o_ref, f"kda out b={b}")
        _check(state[b], s_ref, f"kda state b={b}")
        win_ref = _kda_window(conv_ref, H, K)  # fp32 projections: error scales with the row, not the element
        np.testing.assert_allclose(window[b], win_ref, rtol=1e-5, atol=2e-6 * np.max(np.abs(win_ref)))


def test_kda_layer_continues_across_pieces(rng, tiny):
    """Non-zero initial state and conv window; the sequence arrives in two right-padded pieces with
    per-sequence lengths (0 included: an idle slot must keep its state). Padding carries random garbage."""
    cfg, params, hf, tc = tiny
    H, K, W, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size, cfg.hidden_size
    p = params["layers"][1]["attn"]
    B, Tp = 3, 8
    state0 = 0.3 * rng.standard_normal((B, H, K, K))
    conv0 = [tuple(_x(rng, W - 1, H * K) for _ in range(3)) for _ in range(B)]
    n1, n2 = rng.integers(0, Tp + 1, B), rng.integers(1, Tp + 1, B)
    x1, x2 = _x(rng, B, Tp, D), _x(rng, B, Tp, D)
    step = jax.jit(kda.kda_prefill, static_argnums=2)  # same shapes twice: compile once
    out1, s, w = step(
        p, F32(x1), cfg, jnp.asarray(n1), F32(state0), F32(np.stack([_kda_window(c, H, K) for c in conv0]))
    )
    out2, s, w = step(p, F32(x2), cfg, jnp.asarray(n2), s, w)
    for b in range(B):
        x_b = np.concatenate([x1[b, : n1[b]], x2[b, : n2[b]]])
        o_ref, s_ref, conv_ref = ref.kda_layer(hf, 1, tc, x_b, state0[b], conv0[b])
        got = np.concatenate([np.asarray(out1)[b, : n1[b]], np.asarray(out2)[b, : n2[b]]])
        _check(got, o_ref, f"kda two pieces b={b} ({n1[b]}+{n2[b]})")
        _check(s[b], s_ref, f"kda state b={b}")
        win_ref = _kda_window(conv_ref, H, K)  # fp32 projections: error scales with the row, not the element
        np.testing.assert_allclose(w[b], win_ref, rtol=1e-5, atol=2e-6 * np.max(np.abs(win_ref)))


# ---- MLA --------------------------------------------------------------------------------------------------
def test_mla_full_and_cached(rng, tiny):
    cfg, params, hf, tc = tiny
    L = 3
    p = params["layers"][L]["attn"]
    T = int(rng.integers(4, 24))
    x = _x(rng, 1, T, cfg.hidden_size)
    o_ref, rows_ref = ref.mla_layer(hf, L, tc, x[0])
    q_a, kv, g = mla.mla_in_projections(p, F32(x))
    rows = mla.latent_rows(p, kv)
    _check(rows[0], rows_ref, "mla latent rows")
    full = mla.mla_full(p, F32(x), cfg)
    _check(full[0], o_ref, "mla_full")
    # absorbed form over the cache: all T queries at once, then only the last T2 with an earlier prefix
    # cached; the cache is longer than the sequence and its tail holds garbage that the mask must hide
    S = T + 5
    cache = jnp.concatenate([rows, F32(_x(rng, 1, S - T, rows.shape[-1]))], axis=1)
    cached = mla.mla_cached(p, q_a, g, cfg, cache, jnp.arange(1, T + 1)[None])
    _check(cached, full, "mla_cached vs mla_full", tol=1e-6)
    T1 = int(rng.integers(1, T))
    o2_ref, _ = ref.mla_layer(hf, L, tc, x[0, T1:], past_latent=rows_ref[:T1])
    cached2 = mla.mla_cached(p, q_a[:, T1:], g[:, T1:], cfg, cache, jnp.arange(T1 + 1, T + 1)[None])
    _check(cached2[0], o2_ref, "mla_cached after a cached prefix")


def test_mla_in_projections_are_one_gemv_call(rng, tiny):
    """A decode batch's q_a, kv_a and gate are one decode-GEMV call (table mla_in_launch; on CPU its reference
    runs, and is recorded), wider batches (prefill) the same maths without it, rounded to bf16, against float64
    from the HF rows (the out-major layout is the HF one: g's heads are its [H*Vd, D] rows)."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_mla(L)]))
    p = P.cast_params(params["layers"][L]["attn"], jnp.bfloat16)
    x = jnp.asarray(_x(rng, 2, 35, cfg.hidden_size), jnp.bfloat16)  # B*T = 70 > the GEMV's 64
    B, T = int(rng.integers(1, 3)), int(rng.integers(1, 33))  # B*T <= 64: a decode step or a verify block
    comm = Comm(policy=DecodePolicy("latency_specialized"))
    with policy_lib.recording(policy_lib.DispatchLog()) as wide:
        wide_outs = mla.mla_in_projections(p, x, comm.policy)
    with policy_lib.recording(policy_lib.DispatchLog()) as decode:
        outs = mla.mla_in_projections(p, x[:B, :T], comm.policy)
    assert "gemv mla_in_launch" not in wide.ops and decode.ops["gemv mla_in_launch"]["impl"] == "xla"
    H, Vd = cfg.num_attention_heads, cfg.v_head_dim
    x64 = np.asarray(x[:B, :T], np.float64)
    hf_names = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "g_proj.weight")
    for got, wide_got, name in zip(outs, wide_outs, hf_names, strict=True):
        w64 = np.asarray(hf[f"layers.{L}.self_attn.{name}"], np.float64)
        w64 = np.asarray(jnp.asarray(w64, jnp.bfloat16), np.float64)  # the stored bf16 weights
        want, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
        if name == "g_proj.weight":
            want, scale = want.reshape(B, T, H, Vd), scale.reshape(B, T, H, Vd)
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape, (name, got.shape)
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= 2**-8 * np.abs(want) + 2**-18 * scale), (name, float(err.max()))
        np.testing.assert_allclose(  # the same maths up to the order of the fp32 sums
            np.asarray(wide_got[:B, :T], np.float64), np.asarray(got, np.float64), rtol=2**-7, atol=2**-18 * scale.max()
        )


def test_mla_o_proj_is_the_decode_gemv(rng, tiny):
    """MLA's o_proj (o out-major [D, H, Vd], table version 7) is KDA's: a decode or verify step's tokens ask for
    the decode GEMV (table o_proj_launch; on CPU its reference runs, and is recorded), a prefill chunk's the same
    maths without it; rounded to bf16, against float64 from the HF o_proj rows."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_mla(L)]))
    w = P.cast_params(params["layers"][L]["attn"], jnp.bfloat16)["o"]
    H, Vd = cfg.num_attention_heads, cfg.v_head_dim
    y = jnp.asarray(_x(rng, 2, 35, H * Vd).reshape(2, 35, H, Vd), jnp.bfloat16)  # B*T = 70 > the GEMV's 64
    B, T = int(rng.integers(1, 3)), int(rng.integers(1, 33))
    policy = DecodePolicy("latency_specialized")
    with policy_lib.recording(policy_lib.DispatchLog()) as wide:
        wide_out = common.o_proj(y, w, policy)
    with policy_lib.recording(policy_lib.DispatchLog()) as decode:
        out = common.o_proj(y[:B, :T], w, policy)
    assert "gemv o_proj_launch" not in wide.ops and decode.ops["gemv o_proj_launch"]["impl"] == "xla"
    w64 = np.asarray(jnp.asarray(np.asarray(hf[f"layers.{L}.self_attn.o_proj.weight"]), jnp.bfloat16), np.float64)
    y64 = np.asarray(y[:B, :T], np.float64).reshape(B, T, H * Vd)
    want, scale = y64 @ w64.T, np.abs(y64) @ np.abs(w64).T
    assert out.dtype == jnp.bfloat16 and out.shape == want.shape
    err = np.abs(np.asarray(out, np.float64) - want)
    assert np.all(err <= 2**-8 * np.abs(want) + 2**-18 * scale), float(err.max())
    np.testing.assert_allclose(
        np.asarray(wide_out[:B, :T], np.float64), np.asarray(out, np.float64), rtol=2**-7, atol=2**-18 * scale.max()
    )


# ---- FFNs and MoE -----------------------------------------------------------------------------------------
def test_dense_mlp(rng, tiny):
    cfg, params, hf, tc = tiny
    x = _x(rng, 1, 7, cfg.hidden_size)
    got = model.ffn_layer(params["layers"][0]["ffn"], F32(x), cfg, False)
    _check(got[0], ref.dense_mlp(hf, 0, tc, x[0]), "dense mlp")


def test_moe(rng, tiny):
    """T > 64 so the routed experts also run in token chunks."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L)]))
    x = _x(rng, int(rng.integers(65, 90)), cfg.hidden_size)
    got, sel = moe.moe(params["layers"][L]["ffn"], F32(x), cfg, return_routing=True)
    sel_ref, _ = ref.router(hf, L, tc, x.astype(np.float32))
    np.testing.assert_array_equal(np.sort(sel, axis=-1), np.sort(sel_ref, axis=-1))
    _check(got, ref.moe(hf, L, tc, x.astype(np.float32)), f"moe layer {L}")


def test_moe_packed_impl(rng, tiny):
    """moe_impl packed (contract straight from the packed codes) against the oracle and the gather path."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L)]))
    x = _x(rng, int(rng.integers(3, 20)), cfg.hidden_size)
    gather = moe.moe(params["layers"][L]["ffn"], F32(x), cfg, comm=Comm(policy=DecodePolicy(moe_impl="gather")))
    _check(gather, ref.moe(hf, L, tc, x.astype(np.float32)), f"moe layer {L}, gather")
    packed = moe.moe(params["layers"][L]["ffn"], F32(x), cfg)  # the default policy's
    _check(packed, ref.moe(hf, L, tc, x.astype(np.float32)), f"moe layer {L}, packed")
    _check(packed, np.asarray(gather), f"moe layer {L}, packed vs gather", tol=1e-6)


def test_moe_in_projections_are_one_gemv_call(rng, tiny):
    """A decode batch's router logits, latent_down and shared gate/up are one decode-GEMV call (table
    moe_in_launch; on CPU its reference runs, and is recorded), wider batches the same maths without it: the
    logits fp32 (exact bf16 products, unrounded), the rest rounded to bf16, all against float64."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L)]))
    p = P.cast_params(params["layers"][L]["ffn"], jnp.bfloat16)
    x = jnp.asarray(_x(rng, 70, cfg.hidden_size), jnp.bfloat16)
    T = int(rng.integers(1, 65))
    comm = Comm(policy=DecodePolicy("latency_specialized"))
    with policy_lib.recording(policy_lib.DispatchLog()) as wide:
        wide_outs = moe.in_projections(p, x, comm)
    with policy_lib.recording(policy_lib.DispatchLog()) as decode:
        outs = moe.in_projections(p, x[:T], comm)
    assert "gemv moe_in_launch" not in wide.ops and decode.ops["gemv moe_in_launch"]["impl"] == "xla"
    x64 = np.asarray(x[:T], np.float64)
    for got, wide_got, name in zip(outs, wide_outs, ("router", "latent_down", "shared_gate", "shared_up"), strict=True):
        w64 = np.asarray(p[name], np.float64)
        want, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
        assert got.dtype == (jnp.float32 if name == "router" else jnp.bfloat16), name
        err = np.abs(np.asarray(got, np.float64) - want)
        bound = 2**-20 * scale if name == "router" else 2**-8 * np.abs(want) + 2**-18 * scale
        assert np.all(err <= bound), (name, float(err.max()))
        np.testing.assert_allclose(  # the same maths up to the order of the fp32 sums
            np.asarray(wide_got[:T], np.float64), np.asarray(got, np.float64), rtol=2**-7, atol=2**-18 * scale.max()
        )


def test_moe_finish_is_one_gemv_sum_call(rng, tiny):
    """A decode batch's latent_up + shared_down is one call of the pairs' GEMV (table moe_out_launch; on CPU its
    reference runs, and is recorded), wider batches the same maths without it: each product rounded to bf16, then
    a bf16 add (docs/model.md §6 step 5), against float64 from the weights."""
    cfg, params, hf, tc = tiny
    L = int(rng.choice([L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L)]))
    p = P.cast_params(params["layers"][L]["ffn"], jnp.bfloat16)
    (D, Dl), S = p["latent_up"].shape, p["shared_down"].shape[1]
    y_lat = jnp.asarray(_x(rng, 70, Dl), jnp.bfloat16)
    hidden = jnp.asarray(_x(rng, 70, S), jnp.bfloat16)
    T = int(rng.integers(1, 65))
    comm = Comm(policy=DecodePolicy("latency_specialized"))
    with policy_lib.recording(policy_lib.DispatchLog()) as wide:
        wide_y = moe.finish(p, y_lat, hidden, comm)
    with policy_lib.recording(policy_lib.DispatchLog()) as decode:
        y = moe.finish(p, y_lat[:T], hidden[:T], comm)
    assert "gemv_sum moe_out_launch" not in wide.ops and decode.ops["gemv_sum moe_out_launch"]["impl"] == "xla"

    def bf16(a):
        return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)

    ps = [
        np.asarray(a[:T], np.float64) @ np.asarray(p[n], np.float64).T
        for a, n in ((y_lat, "latent_up"), (hidden, "shared_down"))
    ]
    want = bf16(bf16(ps[0]) + bf16(ps[1]))
    assert y.dtype == jnp.bfloat16 and y.shape == (T, D)
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= 2**-8 * (np.abs(ps[0]) + np.abs(ps[1]) + np.abs(want))), float(err.max())
    np.testing.assert_allclose(  # the same maths up to the order of the fp32 sums
        np.asarray(wide_y[:T], np.float64), np.asarray(y, np.float64), rtol=2**-7, atol=2**-18 * np.abs(want).max()
    )


def test_moe_impl_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="moe_impl"):
        DecodePolicy(moe_impl="dense")


def test_moe_gather_budget_sets_the_token_chunk(rng, tiny, monkeypatch):
    """The routed experts gather at most GATHER_BUDGET_BYTES of expert copies per token chunk."""
    cfg, params, hf, tc = tiny
    L = next(L for L in range(cfg.num_hidden_layers) if cfg.is_moe(L))
    experts, k = params["layers"][L]["ffn"]["experts"], cfg.num_experts_per_token
    packed = "w1_codes" in experts  # two e2m1 codes per byte
    per_token = (
        k
        * 4
        * sum(
            int(np.prod(experts[m + "_codes" if packed else m].shape[1:])) * (2 if packed else 1)
            for m in ("w1", "w3", "w2")
        )
    )
    chunk = int(rng.integers(2, 6))
    monkeypatch.setattr(moe_reference, "GATHER_BUDGET_BYTES", chunk * per_token + per_token // 2)
    assert moe_reference.gather_token_chunk(experts, k, F32) == chunk
    x = _x(rng, 4 * chunk + 1, cfg.hidden_size)  # 5 chunks, the last one padded
    _check(
        moe.moe(params["layers"][L]["ffn"], F32(x), cfg),
        ref.moe(hf, L, tc, x.astype(np.float32)),
        f"moe in chunks of {chunk}",
    )


def test_router_bias_changes_the_choice_not_the_weights(rng):
    """The correction bias picks experts but the weights are the renormalised UNBIASED sigmoid scores."""
    cfg = preset("tiny").replace(routed_scaling_factor=2.5)
    params, hf, tc = model_from_oracle(cfg, rng)
    L, k, E = 1, cfg.num_experts_per_token, cfg.num_experts
    p = dict(params["layers"][L]["ffn"])
    x = _x(rng, 6, cfg.hidden_size).astype(np.float32)
    s = ref.sigmoid(x.astype(np.float64) @ np.asarray(p["router"], np.float64).T)  # unbiased scores [T, E]
    order = np.argsort(-s[0])
    top, a, b = set(order[:k].tolist()), int(order[k - 1]), int(order[k])
    cases = {
        # lifts the best unselected expert of token 0 just above its k-th: exactly one swap
        "one swap": (np.zeros(E).astype(np.float32), (top - {a}) | {b}, b, s[0, a] - s[0, b] + 1e-3),
        # a large bias on the k least likely experts of token 0 forces them for every token
        "forced": (np.zeros(E).astype(np.float32), set(order[-k:].tolist()), order[-k:], 1.5),
    }
    for name, (bias, want_sel0, idx, val) in cases.items():
        bias[idx] += val
        p["router_bias"] = jnp.asarray(bias)
        sel, w = moe.route(p, F32(x), cfg)
        sel, w = np.asarray(sel), np.asarray(w)
        assert set(sel[0].tolist()) == want_sel0 != top, name
        for t in range(x.shape[0]):
            want_w = s[t, sel[t]] / s[t, sel[t]].sum() * 2.5
            np.testing.assert_allclose(w[t], want_w, rtol=1e-6, err_msg=name)
        if name == "forced":
            assert all(set(r.tolist()) == want_sel0 for r in sel)
        hf[f"layers.{L}.block_sparse_moe.gate.e_score_correction_bias"] = bias
        sel_ref, w_ref = ref.router(hf, L, tc, x)
        np.testing.assert_array_equal(np.sort(sel, -1), np.sort(sel_ref, -1))
        _check(moe.moe(p, F32(x), cfg), ref.moe(hf, L, tc, x), f"moe with bias ({name})")
