"""Shared pieces of the routed-experts tests: random MXFP4 experts with the extreme codes and scales, routings
with shared and unchosen experts, and float64 NumPy oracles written from docs/model.md §3 / §6 / §7.2."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import np_reference as ref
import numpy as np

BETA1, BETA2 = 4.0, 25.0  # activation_situ_beta, activation_situ_linear_beta


def _codes_scales(r, E, out, inp, scale_spread):
    """Uniform random bytes (every code, ±0 and ±6 among them) with whole rows of ±0 / ±6 in some experts, and
    E8M0 scales around 2^-3 (so products stay O(1)) spread by up to 2^±scale_spread."""
    codes = r.integers(0, 256, (E, out, inp // 2), dtype=np.uint8)
    for c in (0x00, 0x88, 0x77, 0xFF, 0x7F, 0x08):  # +0 +0 | -0 -0 | +6 +6 | -6 -6 | +6 -6 | -0 +0
        codes[r.integers(E), r.integers(out)] = c
    spread = r.integers(-scale_spread, scale_spread + 1, (E, out, inp // 32))
    scales = (124 + spread).astype(np.uint8)
    return codes, scales


def make_experts(r, E, I, L, scale_spread=20):
    """MXFP4 experts: w1 / w3 [E, I, L], w2 [E, L, I] as (codes, scales) NumPy arrays, and the jnp dict."""
    np_ex = {}
    for name, (out, inp) in dict(w1=(I, L), w3=(I, L), w2=(L, I)).items():
        np_ex[name] = _codes_scales(r, E, out, inp, scale_spread)
    jnp_ex = {}
    for name, (c, s) in np_ex.items():
        jnp_ex[name + "_codes"], jnp_ex[name + "_scales"] = jnp.asarray(c), jnp.asarray(s)
    return np_ex, jnp_ex


def make_routing(r, T, k, E, unchosen=3, everyone=True):
    """sel [T, k] (distinct experts per token) over all but `unchosen` experts, with (everyone) one expert
    every token picks, so a group can be larger than a token tile; fp32 weights in (0, 1)."""
    pool = r.permutation(E)[: E - unchosen]
    rows = []
    for _ in range(T):
        if everyone:
            rest = r.choice(pool[1:], k - 1, replace=False)
            rows.append(r.permutation(np.concatenate([pool[:1], rest])))
        else:
            rows.append(r.choice(pool, k, replace=False))
    return np.stack(rows).astype(np.int32), r.uniform(0.05, 1.0, (T, k)).astype(np.float32)


def situ_glu(g, u):
    """docs/model.md §3 in float64 with a logistic accurate in its far tail: np_reference's 0.5 (1 + tanh(x / 2))
    cancels to 0 below x ~ -37, where the kernel's fp32 still has e^x (the experts' 2^±20 scales reach it)."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    e = np.exp(-np.abs(g))
    sig = np.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return BETA1 * np.tanh(g / BETA1) * sig * BETA2 * np.tanh(u / BETA2)


def bf16(x):
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def dequant(np_ex, name, e):
    c, s = np_ex[name]
    return ref.mxfp4_dequant(c[e], s[e])


def oracle(np_ex, z, sel, w, rounded):
    """sum_k w W2(SiTU-GLU(W1 z, W3 z)) in float64, with (rounded) or without the spec's bf16 roundings;
    also the per-element error scale sum_k w |W2| |h| (what an fp32 / bf16 difference is measured against)."""
    z = np.asarray(z, np.float64)
    rnd = bf16 if rounded else (lambda a: a)
    T, L = z.shape
    y, scale = np.zeros((T, L)), np.zeros((T, L))
    for t in range(T):
        for j, e in enumerate(sel[t]):
            g, u = rnd(dequant(np_ex, "w1", e) @ z[t]), rnd(dequant(np_ex, "w3", e) @ z[t])
            h = rnd(situ_glu(g, u))
            W2 = dequant(np_ex, "w2", e)
            y[t] += float(w[t, j]) * rnd(W2 @ h)
            scale[t] += float(w[t, j]) * (np.abs(W2) @ np.abs(h))
    return (rnd(y) if rounded else y), scale


def interpret_params():
    """Interpret mode with the race detector on."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True)


def races_found():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    return get_races().races_found


def abstract_experts(E, I, L):
    """MXFP4 experts as ShapeDtypeStructs (what lowering and the refusals need)."""
    sds = jax.ShapeDtypeStruct
    ex = {}
    for name, (out, inp) in dict(w1=(I, L), w3=(I, L), w2=(L, I)).items():
        ex[name + "_codes"] = sds((E, out, inp // 2), jnp.uint8)
        ex[name + "_scales"] = sds((E, out, inp // 32), jnp.uint8)
    return ex


def inputs(r, T, E, I, L, k=4):
    """Random experts, z [T, L] bf16 and a routing (with a shared expert from T = 2 on)."""
    np_ex, ex = make_experts(r, E, I, L)
    z = jnp.asarray(r.standard_normal((T, L)), jnp.bfloat16)
    sel, w = make_routing(r, T, k, E, everyone=T > 1)
    return np_ex, ex, z, sel, w


def check_against_reference_and_numpy(got, reference_out, np_ex, z, sel, w):
    """A kernel's bf16 y [T, L] against the XLA reference's (the same rounding points: within 2^-6 of the
    element's scale sum_k w |W2| |h|) and against float64 NumPy (no less accurate than the reference)."""
    got, want = np.asarray(got, np.float64), np.asarray(reference_out, np.float64)
    exact, scale = oracle(np_ex, z, sel, w, rounded=False)
    assert np.all(np.abs(got - want) <= 2**-6 * scale), np.max(np.abs(got - want) / scale)
    err_kernel, err_ref = (np.mean(np.abs(a - exact) / scale) for a in (got, want))
    assert err_kernel <= 1.25 * err_ref + 2**-12, (err_kernel, err_ref)


def check_fused_glu(grouped, launch, check):
    """launch with fused_glu (SiTU-GLU in the gate/up kernel, h written by it) against the same launch without it:
    check(groups, the unfused run's partials, the fused run's h, its y), e.g. each body's check_sums over the
    unfused fp32 sums W1 z / W3 z with the fused h and down sums. grouped(launch) -> (groups, part, h, y)."""
    groups, part, _, _ = grouped(launch)
    fused_groups, no_part, h, y = grouped(dataclasses.replace(launch, fused_glu=True))
    assert no_part is None and h.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(fused_groups.row_P), np.asarray(groups.row_P))
    check(groups, part, h, y)


def check_sums(np_ex, z, sel, groups, g_RI, u_RI, h_RI, y_RL, k):
    """Each (token, expert) pair's W1 z and W3 z (g, u: the gate/up partials summed), h = SiTU-GLU of their bf16
    roundings (natural order) and W2 h (the down kernel's fp32 out) against float64: the GEMMs within 1e-5 of
    the element's scale sum |W| |x|; h within one bf16 ulp (<= 2^-7 |h|: XLA's fp32 tanh / logistic before the
    rounding against NumPy's; 11.8125 vs 11.875 on the H200), values below fp32's normal range aside (a
    sigmoid(g) that a device flushes to 0 moves h by at most beta1 * 2^-126 * |u|, since
    |SiTU(g)| <= beta1 * sigmoid(g) and |cap(u)| <= |u| there)."""
    g_all, u_all, h, y = (np.asarray(a, np.float64) for a in (g_RI, u_RI, h_RI, y_RL))
    z64 = np.asarray(z, np.float64)
    for pair, pos in enumerate(np.asarray(groups.row_P)):
        t, e = pair // k, sel[pair // k, pair % k]
        for got, name in ((g_all[pos], "w1"), (u_all[pos], "w3")):
            W = dequant(np_ex, name, e)
            assert np.all(np.abs(got - W @ z64[t]) <= 1e-5 * (np.abs(W) @ np.abs(z64[t]))), (name, pos)
        g, u = g_all[pos], u_all[pos]
        h_want = bf16(situ_glu(bf16(g), bf16(u)))
        bad = np.abs(h[pos] - h_want) > 2**-7 * np.abs(h_want) + 2.0**-126 * (1 + BETA1 * np.abs(u))
        assert not np.any(bad), (pos, h[pos][bad], h_want[bad], g[bad], u[bad])
        W2 = dequant(np_ex, "w2", e)
        assert np.all(np.abs(y[pos] - W2 @ h[pos]) <= 1e-5 * (np.abs(W2) @ np.abs(h[pos]))), pos
