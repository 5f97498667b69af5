"""MLA decode attention (pallas_kernels.mla_decode): the reference, the sm90 kernel (interpret mode on CPU at
small shapes, CUDA lowering at the real ones, real shapes on the GPU) and the sm100 kernel (interpret mode and
CUDA lowering under an abstract B200; no Blackwell GPU here) against a float64 NumPy oracle written from
docs/model.md §5.3, against the naive (non-absorbed) form of §5.2, and against each other."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testbase import abstract_gpu, cpu_only, gpu_only

from pallas_kernels import common
from pallas_kernels.mla_decode import api, kernel, kernel_sm100, reference, sm90, sm100
from pallas_kernels.policy import SPECIALIZED, XLA, DispatchLog, recording

SCALE = 192**-0.5  # (qk_nope + qk_rope)^-1/2, §5.2
E = 64  # rope dim
FP8_MAX = 448.0


# ---- inputs and the oracle ----------------------------------------------------------------------------------
def make_entry(rng, B, S, R, cache):
    """A cache entry of fresh random rows: "fp8" quantised by k3jax.cache's rule (per-row, per-part max / 448),
    "bf16" stored as bf16. The k_pe part has its own (larger) range, as the unnormalised tail does."""
    x = rng.standard_normal((B, S, R + E), dtype=np.float32)
    x[..., R:] *= 4.0
    if cache == "bf16":
        return {"rows": jnp.asarray(x, jnp.bfloat16)}
    sc = np.stack([np.abs(x[..., :R]).max(-1), np.abs(x[..., R:]).max(-1)], axis=-1) / FP8_MAX
    x[..., :R] /= sc[..., :1]
    x[..., R:] /= sc[..., 1:]
    return {"rows": jnp.asarray(x, jnp.float8_e4m3fn), "scales": jnp.asarray(sc, jnp.float32)}


def make_queries(rng, B, T, H, R, dtype):
    q_lat = jnp.asarray(rng.standard_normal((B, T, H, R)), dtype)
    q_pe = jnp.asarray(0.5 * rng.standard_normal((B, T, H, E)), dtype)
    return q_lat, q_pe


def ragged_lengths(S, B, T):
    """Causal decode lengths (token t at position L + t sees L + t + 1 rows) whose last token sees 1, 17, S - 1,
    then random lengths: the ragged batch of the spec's tests. One sequence sees S - 1 (every split has rows)."""
    last = ([S - 1] if B == 1 else [1, 17, S - 1]) + list(np.random.default_rng().integers(T, S + 1, max(0, B - 3)))
    last = np.maximum(np.array(last[:B]), T)  # T tokens need T positions
    return jnp.asarray(last[:, None] - T + 1 + np.arange(T)[None], jnp.int32)


def rows_f64(entry, R, b=slice(None), n=None):
    """Sequence(s) b's first n rows, exactly dequantised, in float64."""
    rows = np.asarray(entry["rows"][b, :n], np.float64)
    if "scales" in entry:
        sc = np.asarray(entry["scales"][b, :n], np.float64)
        rows = np.concatenate([rows[..., :R] * sc[..., :1], rows[..., R:] * sc[..., 1:]], axis=-1)
    return rows


def oracle(q_lat, q_pe, entry, key_len, kv_offset=0):
    """§5.3 in float64 over the exactly dequantised rows -> (o_lat [B, T, H, R], lse [B, T, H]); a sequence at
    a time, over the rows it can see (GPU shapes: 64 x 8192 rows would be 2.4 GB of float64)."""
    B, T, H, R = q_lat.shape
    q = np.concatenate([np.asarray(q_lat, np.float64), np.asarray(q_pe, np.float64)], axis=-1)
    key_len = np.clip(np.asarray(key_len) - kv_offset, 0, entry["rows"].shape[1])
    o, lse = np.zeros((B, T, H, R)), np.full((B, T, H), -np.inf)
    for b in range(B):
        n = int(key_len[b].max())
        if n == 0:
            continue
        rows = rows_f64(entry, R, b, n)
        s = (q[b].reshape(T * H, -1) @ rows.T).reshape(T, H, n) * SCALE
        s = np.where(np.arange(n) < key_len[b][:, None, None], s, -np.inf)
        top = s.max(-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        p = np.exp(s - top)
        l = p.sum(-1, keepdims=True)
        w = (p / np.where(l > 0, l, 1.0)).reshape(T * H, n)
        o[b] = (w @ rows[:, :R]).reshape(T, H, R)
        with np.errstate(divide="ignore"):
            lse[b] = (top + np.log(l))[..., 0]
    return o, lse


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values"
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def interpret(detect_races=True):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=detect_races)


def run_kernel(q_lat, q_pe, entry, key_len, tuning=None, body=sm90, **kw):
    """A body (sm90 or sm100) in interpret mode (CPU) under its abstract GPU, race detection on."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    with abstract_gpu(body.ARCH):
        got = body.mla_decode_attention(
            q_lat, q_pe, entry, key_len, scale=SCALE, tuning=tuning or body.TUNING, interpret=interpret(), **kw
        )
    assert not get_races().races_found
    return got


# ---- the reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("T", [1, 4])
def test_reference_matches_numpy(rng, cache, T):
    """float32 compute: the reference equals §5.3 over the dequantised rows (ragged lengths, T causal tokens)."""
    B, H, R, S = 3, 4, 64, 70
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    got = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert rel_err(got, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-6


def test_reference_slices_combine_to_the_whole(rng):
    """Context parallelism's maths: the cache split into position slices (kv_offset), each slice's (o, lse) with
    return_lse, merged by api.combine, equals attention over the whole cache; a slice with nothing visible
    contributes lse = -inf."""
    B, T, H, R, S = 3, 2, 2, 64, 90
    entry = make_entry(rng, B, S, R, "fp8")
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = jnp.asarray([[1, 2], [40, 41], [S - 1, S]], jnp.int32)
    parts = []
    for lo, hi in [(0, 30), (30, 64), (64, S)]:
        part = {k: v[:, lo:hi] for k, v in entry.items()}
        o, lse = reference.mla_decode_attention(q_lat, q_pe, part, key_len, scale=SCALE, kv_offset=lo, return_lse=True)
        o_ref, lse_ref = oracle(q_lat, q_pe, part, key_len, kv_offset=lo)
        np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(o), o_ref, rtol=1e-5, atol=1e-6)
        parts.append((o, lse))
    whole = api.combine(parts)
    assert rel_err(whole, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-6


# ---- the kernel in interpret mode ---------------------------------------------------------------------------
# (B, T, H, R, S, tuning changes): ragged lengths 1 / 17 / S - 1 in every batch; head groups (max_cols), one or
# several splits and stages
KERNEL_CASES = [
    (3, 1, 3, 128, 300, {}),
    (3, 5, 2, 64, 150, {"min_split_blocks": 1}),
    (4, 4, 4, 128, 200, {"max_cols": 8, "stages": {"fp8": 1, "bf16": 1}}),
    (3, 8, 1, 64, 64, {"max_splits": 1}),
]


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H, R, S, changes", KERNEL_CASES)
def test_kernel_interpret_float32_equals_reference(rng, cache, B, T, H, R, S, changes):
    """float32 compute: the kernel (bf16 pieces, exact products) equals the reference to 1e-5 relative, and
    the reference equals the float64 oracle (so the kernel does too)."""
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    got = run_kernel(q_lat, q_pe, entry, key_len, dict(sm90.TUNING, **changes))
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert got.dtype == jnp.float32 and got.shape == (B, T, H, R)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(got, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-5


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("T", [1, 6])
def test_kernel_interpret_bf16_no_less_accurate_than_reference(rng, cache, T):
    """bf16 compute: against the float64 oracle the kernel's error is no larger than the reference's (which
    rounds the dequantised rows and the probabilities to bf16; the kernel rounds P unnormalised and the
    output once). Relative Frobenius error over the batch, 10% margin for chance."""
    B, H, R, S = 3, 3, 128, 260
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.bfloat16)
    key_len = ragged_lengths(S, B, T)
    got = run_kernel(q_lat, q_pe, entry, key_len)
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert got.dtype == jnp.bfloat16
    want = oracle(q_lat, q_pe, entry, key_len)[0]
    assert rel_err(got, want) <= 1.1 * rel_err(ref, want)


@cpu_only
@pytest.mark.parametrize("body, cache, R", [(sm90, "fp8", 64), (sm100, "fp8", 128), (sm100, "bf16", 128)])
def test_kernel_interpret_equals_the_naive_form(rng, body, cache, R):
    """The absorbed kernel path (q_lat = W_UKᵀ q_nope, o = W_UV o_lat) equals §5.2's naive form (keys and values
    expanded per head from the latent) in float32 (sm100: R a multiple of 128)."""
    B, T, H, S, NOPE = 3, 3, 2, 130, 32
    entry = make_entry(rng, B, S, R, cache)
    w_uk = rng.standard_normal((H, NOPE, R)) / np.sqrt(R)
    w_uv = rng.standard_normal((H, NOPE, R)) / np.sqrt(R)
    q_nope = rng.standard_normal((B, T, H, NOPE))
    q_pe = 0.5 * rng.standard_normal((B, T, H, E))
    key_len = ragged_lengths(S, B, T)
    q_lat = jnp.asarray(np.einsum("bthn,hnr->bthr", q_nope, w_uk), jnp.float32)
    o_lat = run_kernel(q_lat, jnp.asarray(q_pe, jnp.float32), entry, key_len, body=body)
    got = np.einsum("bthr,hvr->bthv", np.asarray(o_lat, np.float64), w_uv)
    rows = rows_f64(entry, R)  # naive: per-head keys [k_nope | k_pe] and values from the latent
    k_nope = np.einsum("bsr,hnr->bshn", rows[..., :R], w_uk)
    v = np.einsum("bsr,hvr->bshv", rows[..., :R], w_uv)
    s = (np.einsum("bthn,bshn->bths", q_nope, k_nope) + np.einsum("bthe,bse->bths", q_pe, rows[..., R:])) * SCALE
    s = np.where(np.arange(S) < np.asarray(key_len)[:, :, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bths,bshv->bthv", p / p.sum(-1, keepdims=True), v)
    assert rel_err(got, want) < 1e-5


@cpu_only
@pytest.mark.parametrize(
    "body, cache, R, S", [(sm90, "bf16", 64, 200), (sm100, "bf16", 128, 300), (sm100, "fp8", 128, 300)]
)
def test_kernel_interpret_slices_and_lse(rng, body, cache, R, S):
    """return_lse over position slices (kv_offset): the kernel's (o, lse) per slice equal the oracle's, and the
    combined slices equal the whole (one slice sees nothing for the shortest sequence: lse = -inf, o = 0)."""
    B, T, H = 3, 2, 2
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = jnp.asarray([[1, 2], [17, 18], [S - 1, S]], jnp.int32)
    parts = []
    for lo, hi in [(0, S // 2), (S // 2, S)]:
        part = {k: v[:, lo:hi] for k, v in entry.items()}
        o, lse = run_kernel(q_lat, q_pe, part, key_len, kv_offset=lo, return_lse=True, body=body)
        o_ref, lse_ref = oracle(q_lat, q_pe, part, key_len, kv_offset=lo)
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(lse_ref))
        fin = np.isfinite(lse_ref)
        np.testing.assert_allclose(np.asarray(lse)[fin], lse_ref[fin], rtol=1e-6, atol=1e-5)
        assert rel_err(o, o_ref) < 1e-5
        parts.append((o, lse))
    assert rel_err(api.combine(parts), oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-5


# ---- the Blackwell (sm100) kernel in interpret mode (an abstract B200) ----------------------------------------
# (B, T, H, R, S, tuning changes): blocks of 128 positions, ragged lengths 1 / 17 / the whole cache in every batch;
# several splits and two stages, one or eight query tokens, one stage and one split over a cache of one block, two
# O^T row tiles (R = 256)
SM100_CASES = [
    (3, 1, 3, 128, 300, {}),
    (3, 8, 2, 128, 260, {"min_split_blocks": 1}),
    (3, 4, 4, 256, 128, {"stages": {"fp8": 1, "bf16": 1}, "max_splits": 1}),
]


def whole_cache_lengths(S, B, T):
    """ragged_lengths with the third sequence's last token seeing all S rows (the last block is a whole one)."""
    return ragged_lengths(S, B, T).at[2].add(1)


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H, R, S, changes", SM100_CASES)
def test_sm100_kernel_interpret_float32_equals_reference(rng, cache, B, T, H, R, S, changes):
    """float32 compute on tcgen05 (3 pieces per operand, TMEM accumulators simulated, race-checked): the kernel
    equals the reference to 1e-5 relative, and the float64 oracle too."""
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = whole_cache_lengths(S, B, T)
    got = run_kernel(q_lat, q_pe, entry, key_len, dict(sm100.TUNING, **changes), body=sm100)
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert got.dtype == jnp.float32 and got.shape == (B, T, H, R)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(got, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-5


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("T", [1, 8])
def test_sm100_kernel_interpret_bf16_no_less_accurate_than_reference(rng, cache, T):
    """bf16 compute: against the float64 oracle the sm100 kernel's error is no larger than the reference's
    (relative Frobenius error over the batch, 10% margin for chance)."""
    B, H, R, S = 3, 2, 128, 260
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.bfloat16)
    key_len = whole_cache_lengths(S, B, T)
    got = run_kernel(q_lat, q_pe, entry, key_len, body=sm100)
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert got.dtype == jnp.bfloat16
    want = oracle(q_lat, q_pe, entry, key_len)[0]
    assert rel_err(got, want) <= 1.1 * rel_err(ref, want)


# ---- float32 as XLA GPU compiles the wrapper --------------------------------------------------------------
# XLA GPU's excess-precision pass (SimplifyFPConversions) folds a chain of float converts into its input, so
# q - f32(bf16(q)) is 0 there; XLA:CPU runs the same pass where its oneDNN custom calls are on. Compiling the
# kernel's XLA wrapper with this option reproduces on CPU what the H200 ran (the float32 failure of issue 27:
# every q piece after the first was 0, so float32 was bf16- or f16-accurate).
GPU_CONVERT_FOLDING = {"xla_cpu_experimental_onednn_custom_call": True}


def compiled_like_gpu(fn, *args, static=()):
    """fn(*args) compiled on CPU with XLA GPU's convert folding (static: the positions of static arguments)."""
    dyn = [a for i, a in enumerate(args) if i not in static]
    return jax.jit(fn, static_argnums=static).lower(*args).compile(compiler_options=GPU_CONVERT_FOLDING)(*dyn)


@cpu_only
def test_cpu_compile_option_folds_converts_as_xla_gpu_does(rng):
    """The emulation the tests below rely on: with it, f32 -> bf16 -> f32 is folded away (x - x' = 0); without
    it the rounding stays (if XLA:CPU changes, this says the tests below no longer reproduce the GPU)."""
    x = jnp.asarray(rng.standard_normal(64), jnp.float32)

    def residual(x):
        return x - x.astype(jnp.bfloat16).astype(jnp.float32)

    assert np.any(np.asarray(jax.jit(residual)(x)) != 0)
    np.testing.assert_array_equal(np.asarray(compiled_like_gpu(residual, x)), 0.0)


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_q_pieces_sum_to_q_as_xla_gpu_compiles_them(rng, cache):
    """float32 queries become 3 pieces in the MMA type (bf16, or f16 with a power-of-two column scaling) whose
    sum is q to fp32's precision, also when XLA folds convert pairs: each later piece is nonzero and the sum,
    the scaling undone, is q to 2^-32 of its column's largest element."""
    B, T, H, R = 2, 3, 4, 128
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    rows_dtype = jnp.float8_e4m3fn if cache == "fp8" else jnp.bfloat16
    launch = kernel.pick_launch(sm90.TUNING, B, T, H, R, E, 1024, rows_dtype, jnp.float32)
    Hg, N = launch.heads_per_group, launch.cols
    args = (q_lat, q_pe, Hg, N, kernel.mma_dtype(rows_dtype), 3, SCALE)
    q_BGPNC, colscale_BGN = compiled_like_gpu(kernel._q_pieces, *args, static=(2, 3, 4, 5, 6))
    pieces = np.asarray(q_BGPNC.astype(jnp.float32), np.float64)
    undo = np.asarray(colscale_BGN, np.float64) / np.float64(np.float32(SCALE * kernel.LOG2E))  # powers of two
    got = pieces.sum(axis=2) * undo[..., None]  # [B, G, N, C]
    G = H // Hg
    want = np.concatenate([np.asarray(q_lat, np.float64), np.asarray(q_pe, np.float64)], axis=-1)
    want = want.reshape(B, T, G, Hg, R + E).swapaxes(1, 2).reshape(B, G, T * Hg, R + E)
    got, later = got[:, :, : T * Hg], pieces[:, :, 1:, : T * Hg]
    assert np.all(np.abs(later).max(axis=-1) > 0), "a later piece is all zeros: the convert pair was folded"
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert err.max() <= 2.0**-32


KERNELS = {sm90: kernel, sm100: kernel_sm100}  # a body -> its kernel module


@cpu_only
@pytest.mark.parametrize("body", [sm90, sm100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_kernel_interpret_float32_with_the_wrapper_as_xla_gpu_compiles_it(rng, cache, body):
    """The H200's float32 failure at reduced width: the q pieces made as XLA GPU compiles them, the kernel
    (interpret mode, tuning.json's launch: several context splits) over long ragged lengths 1 / 17 / S - 1,
    the splits combined: 1e-5 relative to the float64 oracle and to the reference."""
    B, T, H, R, S = 3, 2, 3, 128, 1100
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    launch = body.launch_for(q_lat, q_pe, entry)
    assert launch.splits > 1
    mdt = kernel.mma_dtype(entry["rows"].dtype)
    args = (q_lat, q_pe, launch.heads_per_group, launch.cols, mdt, 3, SCALE)
    q_BGPNC, colscale_BGN = compiled_like_gpu(kernel._q_pieces, *args, static=(2, 3, 4, 5, 6))
    rows, scales = entry["rows"], entry.get("scales")
    with abstract_gpu(body.ARCH):  # the kernel compiled as usual: on the GPU Mosaic, not XLA, compiles its body
        o, lse = KERNELS[body].partials_from_pieces(
            q_BGPNC, colscale_BGN, rows, scales, key_len, R=R, launch=launch, interpret=interpret()
        )
    got = kernel.combine_splits(o, lse, T, H, launch.heads_per_group)[0]
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    assert rel_err(got, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-5
    assert rel_err(got, ref) < 1e-5


# ---- CUDA lowering at the real shapes ------------------------------------------------------------------------
def _lower(B, T, H, S, cache, dtype=jnp.bfloat16, tuning=None, return_lse=False, body=sm90):
    sd = jax.ShapeDtypeStruct
    R = 512
    q_lat, q_pe = sd((B, T, H, R), dtype), sd((B, T, H, E), dtype)
    rows = sd((B, S, R + E), jnp.float8_e4m3fn if cache == "fp8" else jnp.bfloat16)
    entry = {"rows": rows, **({"scales": sd((B, S, 2), jnp.float32)} if cache == "fp8" else {})}
    key_len = sd((B, T), jnp.int32)

    def f(q_lat, q_pe, entry, key_len):
        return body.mla_decode_attention(
            q_lat, q_pe, entry, key_len, scale=SCALE, tuning=tuning or body.TUNING, return_lse=return_lse
        )

    with abstract_gpu(body.ARCH):
        lowered = jax.jit(f).trace(q_lat, q_pe, entry, key_len).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    return lowered


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "B, T, H, S",
    [(1, 1, 6, 8192), (64, 1, 6, 8192), (8, 1, 12, 32768), (64, 1, 12, 1024), (1, 1, 96, 8192), (8, 8, 6, 8192)],
)
def test_kernel_lowers_for_cuda_at_real_shapes(cache, B, T, H, S):
    """R = 512, E = 64: TP16 (6 heads) / TP8 (12) / TP1 (96), batch 1-64, 1 or 8 queries, with tuning.json's
    launch (P·V into the running accumulator)."""
    lowered = _lower(B, T, H, S, cache)
    assert lowered.out_info.shape == (B, T, H, 512) and lowered.out_info.dtype == jnp.bfloat16


VARIANTS = {  # tuning changes the GPU tests run beside tuning.json's own launch
    "add": dict(acc="add", max_cols=16),  # a fresh P·V accumulator per block: what interpret mode runs
    "qk_regs": dict(qk_regs=True),  # fp8: the scores' MMA takes the converted chunks from registers
}


@cpu_only
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H", [(8, 4, 12), (64, 8, 12), (1, 1, 96)])
def test_kernel_variants_lower_for_cuda(variant, cache, B, T, H):
    """The launch variants lower too (qk_regs only changes the fp8 path), at 1-8 queries x TP8 / TP1 heads."""
    _lower(B, T, H, 8192, cache, tuning=dict(sm90.TUNING, **VARIANTS[variant]))


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_kernel_lowers_for_cuda_in_float32_and_with_lse(cache):
    """float32 compute (3 bf16 pieces per operand) and the context-parallel (o, lse) output lower."""
    lowered = _lower(8, 2, 6, 8192, cache, dtype=jnp.float32, return_lse=True)
    o, lse = lowered.out_info
    assert o.shape == (8, 2, 6, 512) and lse.shape == (8, 2, 6) and o.dtype == lse.dtype == jnp.float32


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H", [(1, 1, 6), (64, 1, 6), (1, 8, 6), (64, 8, 6), (1, 1, 12), (64, 8, 12)])
def test_sm100_kernel_lowers_for_cuda_at_real_shapes(cache, B, T, H):
    """The sm100 kernel (tcgen05, TMEM) lowers for a B200 at one TP16 (6 heads) / TP8 (12) rank's widths: R = 512,
    E = 64, S = 8192, batch 1 / 64, 1 or 8 queries, tuning.json's sm100 launch."""
    lowered = _lower(B, T, H, 8192, cache, body=sm100)
    assert lowered.out_info.shape == (B, T, H, 512) and lowered.out_info.dtype == jnp.bfloat16


@cpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_sm100_kernel_lowers_for_cuda_in_float32_and_with_lse(cache):
    """float32 compute (3 pieces per operand: smaller head groups, SMEM) and the (o, lse) output lower for a B200."""
    lowered = _lower(8, 2, 6, 8192, cache, dtype=jnp.float32, return_lse=True, body=sm100)
    o, lse = lowered.out_info
    assert o.shape == (8, 2, 6, 512) and lse.shape == (8, 2, 6) and o.dtype == lse.dtype == jnp.float32


# ---- launch choice, refusals, the api --------------------------------------------------------------------
@pytest.mark.parametrize("B, T, H, S", [(1, 1, 6, 8192), (64, 1, 6, 8192), (8, 8, 12, 8192), (1, 8, 96, 32768)])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_launch_fits_what_it_claims(B, T, H, S, cache, dtype):
    """pick_launch: head groups divide H within max_cols, columns are whole WGMMA N steps, SMEM holds the
    stages, splits stay within the capacity's blocks and fill one wave of `ctas` CTAs, never part of a second."""
    t = sm90.TUNING
    launch = kernel.pick_launch(t, B, T, H, 512, E, S, jnp.float8_e4m3fn if cache == "fp8" else jnp.bfloat16, dtype)
    Hg, N = launch.heads_per_group, launch.cols
    assert H % Hg == 0 and T * Hg <= max(t["max_cols"], T) and N % 8 == 0 and T * Hg <= N < T * Hg + 8
    assert 1 <= launch.splits <= min(t["max_splits"], -(-S // 64)) and launch.stages >= 1
    ctas = B * (H // Hg) * launch.splits  # one wave, and as full as the other bounds let it be
    assert launch.splits == 1 or ctas <= t["ctas"]
    assert launch.splits in (t["max_splits"], -(-S // 64) // t["min_split_blocks"]) or ctas + B * (H // Hg) > t["ctas"]
    assert kernel.smem_bytes(512, E, N, launch.stages, jnp.bfloat16 if cache == "bf16" else jnp.uint8, dtype) <= (
        kernel.SMEM_BYTES
    )


@pytest.mark.parametrize("bad", ["rows_f32", "short_cache", "odd_rank", "no_scales"])
def test_kernel_refuses_what_it_cannot_run(bad):
    B, T, H, R, S = 2, 1, 2, 128, 100
    sd = jax.ShapeDtypeStruct
    q_lat, q_pe = sd((B, T, H, R if bad != "odd_rank" else 96), jnp.bfloat16), sd((B, T, H, E), jnp.bfloat16)
    rdt = jnp.float32 if bad == "rows_f32" else jnp.float8_e4m3fn
    rows = sd((B, 40 if bad == "short_cache" else S, q_lat.shape[-1] + E), rdt)
    scales = None if bad in ("no_scales", "rows_f32") else sd((B, rows.shape[1], 2), jnp.float32)
    launch = kernel.pick_launch(sm90.TUNING, B, T, H, q_lat.shape[-1], E, rows.shape[1], rdt, q_lat.dtype)
    with pytest.raises(NotImplementedError):
        kernel.check_supported(q_lat, q_pe, rows, scales, launch)


@pytest.mark.parametrize("B, T, H, S", [(1, 1, 6, 8192), (64, 8, 6, 8192), (8, 8, 12, 8192), (1, 8, 96, 32768)])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sm100_launch_fits_what_it_claims(B, T, H, S, cache, dtype):
    """kernel_sm100.pick_launch: head groups divide H within max_cols, columns are whole tcgen05 N steps, TMEM and
    SMEM hold the accumulators and the stages, splits stay within the capacity's blocks of 128 and fill one wave
    of `ctas` CTAs, never part of a second."""
    t, rdt = sm100.TUNING, jnp.float8_e4m3fn if cache == "fp8" else jnp.bfloat16
    launch = kernel_sm100.pick_launch(t, B, T, H, 512, E, S, rdt, dtype)
    Hg, N = launch.heads_per_group, launch.cols
    assert H % Hg == 0 and T * Hg <= max(t["max_cols"], T) and N % 16 == 0 and T * Hg <= N < T * Hg + 16
    assert 1 <= launch.splits <= min(t["max_splits"], -(-S // 128)) and launch.stages >= 1
    ctas = B * (H // Hg) * launch.splits  # one wave, and as full as the other bounds let it be
    assert launch.splits == 1 or ctas <= t["ctas"]
    assert launch.splits in (t["max_splits"], -(-S // 128) // t["min_split_blocks"]) or ctas + B * (H // Hg) > t["ctas"]
    assert kernel_sm100.tmem_cols(512, N, rdt) <= kernel_sm100.TMEM_COLS
    assert kernel_sm100.smem_bytes(512, E, N, launch.stages, rdt, dtype) <= kernel_sm100.SMEM_BYTES


@pytest.mark.parametrize("bad", ["rows_f32", "short_cache", "rank_64", "no_scales", "wide_columns"])
def test_sm100_kernel_refuses_what_it_cannot_run(bad):
    """R a multiple of 128 (an O^T row tile), a cache of at least one block of 128, the TMEM of the columns."""
    B, T, H, S = 2, 1, 2, 300
    R = 64 if bad == "rank_64" else 128
    sd = jax.ShapeDtypeStruct
    q_lat, q_pe = sd((B, T, H, R), jnp.bfloat16), sd((B, T, H, E), jnp.bfloat16)
    rdt = jnp.float32 if bad == "rows_f32" else jnp.float8_e4m3fn
    rows = sd((B, 100 if bad == "short_cache" else S, R + E), rdt)
    scales = None if bad in ("no_scales", "rows_f32") else sd((B, rows.shape[1], 2), jnp.float32)
    launch = kernel_sm100.pick_launch(sm100.TUNING, B, T, H, R, E, rows.shape[1], rdt, q_lat.dtype)
    if bad == "wide_columns":  # (2 + 1) x 192 TMEM columns for fp8 at R = 128
        launch = dataclasses.replace(launch, cols=192)
    with pytest.raises(NotImplementedError):
        kernel_sm100.check_supported(q_lat, q_pe, rows, scales, launch)


@pytest.mark.parametrize(
    "kind, body", [("NVIDIA H100 80GB HBM3", sm90), ("NVIDIA B200", sm100), ("NVIDIA GB300", sm100)]
)
def test_api_picks_the_body_by_compute_capability(kind, body):
    """Compute capability 9 -> the sm90 body, 10 (B200's 10.0, GB300's 10.3) -> the sm100 body."""
    device = jax.sharding.AbstractDevice(device_kind=kind, platform="gpu", num_cores=8)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        assert api._kernel_op(SPECIALIZED).func is body.mla_decode_attention


def test_api_on_blackwell_refuses_by_its_own_tuning_section():
    """On an abstract B200 the sm100 section decides: serve false, or no sm100 section, refuses (the XLA fallback
    then runs), saying which."""
    from pallas_kernels.policy import Tuning

    sm90_only = {"sm90": sm90.load_tuning()}
    off = SPECIALIZED.replace(
        tuning=Tuning.from_files(mla_decode=dict(sm90_only, sm100=dict(sm100.TUNING, serve=False)))
    )
    missing = SPECIALIZED.replace(tuning=Tuning.from_files(mla_decode=sm90_only))
    with abstract_gpu("sm100"):
        with pytest.raises(NotImplementedError, match="sm100 'serve': false"):
            api._kernel_op(off)
        with pytest.raises(NotImplementedError, match="no 'sm100' section"):
            api._kernel_op(missing)


@cpu_only
def test_api_on_an_abstract_b200_runs_the_sm100_kernel(rng, monkeypatch):
    """Through the api's dispatch on an abstract B200: the sm100 body runs (interpret mode here), the dispatch log
    says pallas, and float32 equals the reference to 1e-5."""
    B, T, H, R, S = 3, 2, 2, 128, 200
    entry = make_entry(rng, B, S, R, "fp8")
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = whole_cache_lengths(S, B, T)
    monkeypatch.setattr(
        sm100, "ops", lambda policy: functools.partial(sm100.mla_decode_attention, interpret=interpret())
    )
    log = DispatchLog()
    with recording(log), abstract_gpu("sm100"):
        got = api.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE, policy=SPECIALIZED)
    assert log.ops[api.OP] == {"impl": "pallas", "reason": None}
    assert rel_err(got, reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)) < 1e-5


def test_api_falls_back_to_the_reference_off_hopper(rng, caplog):
    """On CPU the kernel refuses (no sm90): the api runs the reference, records why and logs it once."""
    B, T, H, R, S = 2, 1, 2, 64, 80
    entry = make_entry(rng, B, S, R, "fp8")
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    log = DispatchLog()
    common.log_once.cache_clear()  # an earlier test in this process may have logged the same refusal
    with recording(log), caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        got = api.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE, policy=SPECIALIZED)
        api.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE, policy=XLA)
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert log.ops[api.OP]["impl"] == "xla"
    if jax.default_backend() == "cpu":
        assert any("mla_decode_attention" in r.message and "no GPU" in r.message for r in caplog.records)


def test_api_serves_the_kernel_by_tuning_json():
    """On an sm90 device the shipped tuning serves the kernel (serve: true since its H200 run); a table with
    serve false makes the api refuse it, saying so (the XLA fallback then runs)."""
    from pallas_kernels.policy import Tuning

    table = sm90.load_tuning()
    assert table["serve"] is True
    off = SPECIALIZED.replace(tuning=Tuning.from_files(mla_decode={"sm90": dict(table, serve=False)}))
    with abstract_gpu("sm90"):
        assert callable(api._kernel_op(SPECIALIZED))
        with pytest.raises(NotImplementedError, match="switched off"):
            api._kernel_op(off)


@pytest.mark.parametrize("bad", ["not_a_dict", "rows_width", "scales_shape", "key_len_shape", "key_len_float"])
def test_api_refuses_malformed_input(rng, bad):
    B, T, H, R, S = 2, 1, 2, 64, 80
    entry = make_entry(rng, B, S, R, "fp8")
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    if bad == "not_a_dict":
        entry = entry["rows"]
    elif bad == "rows_width":
        entry = dict(entry, rows=entry["rows"][..., :-1])
    elif bad == "scales_shape":
        entry = dict(entry, scales=entry["scales"][..., :1])
    elif bad == "key_len_shape":
        key_len = key_len[:, None]
    else:
        key_len = key_len.astype(jnp.float32)
    with pytest.raises(ValueError):
        api.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)


def test_mla_cached_reads_the_fp8_entry_as_its_dequantised_rows(rng, tiny_cfg_params):
    """The layer's cached path takes the cache entry: an fp8 entry gives exactly what its dequantised rows
    (k3jax.cache.read_rows, the old whole-cache path) give."""
    from k3jax import cache as cache_lib
    from k3jax.layers import mla

    cfg, p = tiny_cfg_params
    B, T, S = 2, 3, 24
    R = cfg.kv_lora_rank
    x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
    entry = cache_lib.init_cache(cfg, B, S, jnp.float32, "fp8")["layers"][cfg.mla_layers[0]]
    rows = jnp.asarray(rng.standard_normal((B, S, cfg.mla_cache_width)), jnp.float32)
    entry = cache_lib.write_rows(entry, rows, jnp.broadcast_to(jnp.arange(S), (B, S)), jnp.ones((B, S), bool), R)
    key_len = jnp.asarray([[5, 6, 7], [S - 2, S - 1, S]], jnp.int32)
    q_a, _, g = mla.mla_in_projections(p, x)
    got = mla.mla_cached(p, q_a, g, cfg, entry, key_len)
    want = mla.mla_cached(p, q_a, g, cfg, cache_lib.read_rows(entry, R, jnp.float32), key_len)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@cpu_only
def test_mla_cached_runs_the_kernel_under_the_specialized_policy(rng, monkeypatch):
    """The layer's cached path under latency_specialized reaches the kernel (interpret mode here) with the fp8
    entry as stored, records it, and equals the XLA path to 1e-5 in float32 (a tiny config with R = 64 and
    E = 64, widths the kernel takes)."""
    from k3jax import cache as cache_lib
    from k3jax import params as P
    from k3jax.config import preset
    from k3jax.layers import mla

    cfg = preset("tiny").replace(kv_lora_rank=64, qk_rope_head_dim=64)
    p = P.cast_params(P.init_params(cfg, int(rng.integers(1 << 30))), jnp.float32)["layers"][cfg.mla_layers[0]]["attn"]
    B, T, S = 2, 2, 80
    x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.float32)
    entry = cache_lib.init_cache(cfg, B, S, jnp.float32, "fp8")["layers"][cfg.mla_layers[0]]
    rows = jnp.asarray(rng.standard_normal((B, S, cfg.mla_cache_width)), jnp.float32)
    entry = cache_lib.write_rows(entry, rows, jnp.broadcast_to(jnp.arange(S), (B, S)), jnp.ones((B, S), bool), 64)
    key_len = jnp.asarray([[1, 2], [S - 1, S]], jnp.int32)
    monkeypatch.setattr(
        api, "_kernel_op", lambda policy: functools.partial(sm90.mla_decode_attention, interpret=interpret())
    )
    q_a, _, g = mla.mla_in_projections(p, x)
    log = DispatchLog()
    with recording(log), abstract_gpu("sm90"):
        got = mla.mla_cached(p, q_a, g, cfg, entry, key_len, SPECIALIZED)
    assert log.ops[api.OP] == {"impl": "pallas", "reason": None}
    want = mla.mla_cached(p, q_a, g, cfg, entry, key_len, XLA)
    assert rel_err(got, want) < 1e-5


@pytest.fixture(scope="module")
def tiny_cfg_params(seed):
    """The tiny preset and its first MLA layer's random fp32 attention weights."""
    from k3jax import params as P
    from k3jax.config import preset

    cfg = preset("tiny")
    params = P.cast_params(P.init_params(cfg, seed), jnp.float32)
    return cfg, params["layers"][cfg.mla_layers[0]]["attn"]


# ---- the GPU (real shapes) ----------------------------------------------------------------------------------
GPU_CASES = [  # B, T, H, S: lengths 1, 17, S - 1 (+ random) in every batch
    (1, 1, 6, 8192),  # batch 1: a split a block (128 CTAs, tuning.json)
    (3, 1, 6, 8192),
    (4, 8, 6, 8192),
    (8, 1, 12, 8192),
    (3, 8, 12, 8192),
    (64, 1, 6, 8192),
    (3, 1, 96, 8192),
]


def _gpu_bf16_case(rng, variant, cache, B, T, H, S):
    R = 512
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.bfloat16)
    key_len = ragged_lengths(S, B, T)
    tuning = dict(sm90.TUNING, **VARIANTS.get(variant, {}))
    got = sm90.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE, tuning=tuning)
    ref = reference.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE)
    want = oracle(q_lat, q_pe, entry, key_len)[0]
    assert rel_err(got, want) <= 1.1 * rel_err(ref, want)


@gpu_only
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H, S", GPU_CASES)
def test_kernel_on_gpu_bf16_no_less_accurate_than_reference(rng, cache, B, T, H, S):
    """Real widths (R = 512), lengths 1 / 17 / 8191 in one batch, 1 or 8 queries, TP16 / TP8 / TP1 heads: against
    the float64 oracle the kernel (tuning.json's launch) is no less accurate than the reference."""
    _gpu_bf16_case(rng, "tuned", cache, B, T, H, S)


@gpu_only
@pytest.mark.parametrize("variant, cache", [("add", "fp8"), ("add", "bf16"), ("qk_regs", "fp8")])
@pytest.mark.parametrize("B, T, H, S", [(3, 1, 6, 8192), (3, 8, 12, 8192)])
def test_kernel_variants_on_gpu_no_less_accurate_than_reference(rng, variant, cache, B, T, H, S):
    """The launch variants (VARIANTS) likewise, at 1 and 8 queries."""
    _gpu_bf16_case(rng, variant, cache, B, T, H, S)


@gpu_only
@pytest.mark.parametrize("variant", ["tuned", "qk_regs"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("B, T, H, S", [(1, 1, 6, 8192), (3, 1, 6, 8192), (3, 4, 12, 8192)])
def test_kernel_on_gpu_float32_matches_numpy(rng, variant, cache, B, T, H, S):
    """float32 compute on the tensor cores, exact pieces (no TF32): 1e-5 relative to the oracle."""
    if variant == "qk_regs" and cache == "bf16":
        pytest.skip(f"{variant} changes the fp8 path only")
    R = 512
    entry = make_entry(rng, B, S, R, cache)
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.float32)
    key_len = ragged_lengths(S, B, T)
    tuning = dict(sm90.TUNING, **VARIANTS.get(variant, {}))
    got = sm90.mla_decode_attention(q_lat, q_pe, entry, key_len, scale=SCALE, tuning=tuning)
    assert rel_err(got, oracle(q_lat, q_pe, entry, key_len)[0]) < 1e-5


@gpu_only
def test_api_on_gpu_runs_the_kernel(rng):
    B, T, H, R, S = 2, 1, 6, 512, 1024
    entry = make_entry(rng, B, S, R, "fp8")
    q_lat, q_pe = make_queries(rng, B, T, H, R, jnp.bfloat16)
    log = DispatchLog()
    with recording(log):
        api.mla_decode_attention(q_lat, q_pe, entry, ragged_lengths(S, B, T), scale=SCALE, policy=SPECIALIZED)
    assert log.ops[api.OP] == {"impl": "pallas", "reason": None}


@gpu_only
def test_model_on_gpu_float32_same_logits_with_the_kernel():
    """The whole decode step (Engine, fp8 cache) under latency_specialized against auto in float32 at a small
    config whose MLA widths the kernel takes (R = 128, E = 64): the MLA layers run the kernel (decode_ops says
    so) and the logits agree to 1e-5 with the same greedy tokens."""
    from k3jax import params as params_lib
    from k3jax.config import preset
    from k3jax.engine import Engine

    cfg = preset("demo").replace(kv_lora_rank=128, qk_rope_head_dim=64)
    seed = int(np.random.default_rng().integers(1 << 30))
    params = params_lib.cast_params(params_lib.init_params(cfg, seed), jnp.float32)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (5, 3))
    logits = {}
    with jax.default_matmul_precision("highest"):
        for backend in ("auto", "latency_specialized"):
            eng = Engine(cfg, params, max_len=96, max_batch=3, dtype=jnp.float32, backend=backend)
            step, cache, out = jax.jit(eng.step_fn), eng.new_cache(3), []
            for t in tokens:
                lg, cache = step(eng.params, jnp.asarray(t[:, None], jnp.int32), jnp.ones(3, jnp.int32), cache)
                out.append(np.asarray(lg, np.float64))
            logits[backend] = np.stack(out)
            if backend == "latency_specialized":
                assert eng.dispatch_logs["decode"].ops[api.OP]["impl"] == "pallas"
    got, ref = logits["latency_specialized"], logits["auto"]
    assert rel_err(got, ref) <= 1e-5
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
