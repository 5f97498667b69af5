"""prefill(T) then N decode steps == one pass over the T+N tokens (ragged batches, both cache dtypes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rms

from k3jax import cache as cache_lib
from k3jax import model
from k3jax import params as P
from k3jax.config import preset

CFG = preset("tiny")
# What "one pass" is, per cache dtype, and the documented tolerance (median over the B x (N + 1) logit rows: a
# systematic error moves every row; row max: a wrong position, mask or length moves rows by far more):
# - bf16: the cache-free full forward. The same fp32 latent is rounded to bf16 on both paths, but prefill and
#   decode sum it in different orders, so now and then one element lands on the other side of a bf16 rounding
#   boundary (2^-8 of it): one such flip moved a row to 1.3e-5 (CI, seed 1620775290; the other 14 rows 1e-6 to
#   8e-6). Median <= 1e-5, rows <= 1e-3.
# - fp8: one extend over all T+N tokens through the same fp8 cache (so both sides read the same e4m3 rows; the
#   rounding itself is checked exactly in test_fp8_rows_within_e4m3_rounding). Against the unquantised forward
#   the tiny random model moves chaotically (medians 0.007-0.07 over 10 seeds, 0.074 failed CI) and a 10%
#   latent scale bug gives the same range, so that comparison could neither pass reliably nor catch a bug.
#   Measured over 10 seeds: median 1.0e-6 to 2.0e-6, rows <= 1.9e-5. Median <= 1e-5; rows <= 0.1 (an fp32
#   order difference can flip one element's e4m3 rounding, 2^-4 of it).
TOL = {"bf16": (1e-5, 1e-3), "fp8": (1e-5, 0.1)}


@pytest.fixture(scope="module")
def params():
    return P.cast_params(P.init_params(CFG, seed=int(np.random.default_rng().integers(1 << 30))), jnp.float32)


EXTEND = jax.jit(model.extend, static_argnames=("cfg", "dtype", "all_logits", "taps"))


def _prefill(params, seqs, lens, cache_dtype, all_logits=False):
    """A fresh cache with each sequence's first lens[b] tokens in one (right-padded) extend."""
    B = len(seqs)
    cache = cache_lib.init_cache(CFG, B, 32, jnp.float32, cache_dtype)
    toks = np.zeros((B, int(lens.max())), np.int32)
    for b in range(B):
        toks[b, : lens[b]] = seqs[b][: lens[b]]
    return EXTEND(
        params,
        jnp.asarray(toks),
        jnp.asarray(lens, jnp.int32),
        cache,
        cfg=CFG,
        dtype=jnp.float32,
        all_logits=all_logits,
    )


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_prefill_then_decode_equals_one_pass(params, cache_dtype, rng):
    B, N = 3, 4
    lens = rng.integers(3, 12, size=B)
    lens[0] = 11  # a long one and shorter ragged ones
    total = lens + N
    seqs = [rng.integers(0, CFG.vocab_size, size=int(t)) for t in total]
    logits, cache, _ = _prefill(params, seqs, lens, cache_dtype)
    got = [np.asarray(logits)]
    for i in range(N):
        nxt = np.array([s[lens[b] + i] for b, s in enumerate(seqs)], np.int32)
        logits, cache, _ = EXTEND(
            params, jnp.asarray(nxt)[:, None], jnp.ones((B,), jnp.int32), cache, cfg=CFG, dtype=jnp.float32
        )
        got.append(np.asarray(logits))
    assert np.array_equal(np.asarray(cache["lengths"]), total)
    if cache_dtype == "fp8":
        one = np.asarray(_prefill(params, seqs, total, "fp8", all_logits=True)[0])
    fwd = jax.jit(model.forward, static_argnums=(2, 3))
    errs = []
    for b in range(B):
        full = (
            one[b] if cache_dtype == "fp8" else np.asarray(fwd(params, jnp.asarray(seqs[b])[None], CFG, jnp.float32))[0]
        )
        want = full[lens[b] - 1 : lens[b] + N]  # logits at the last prompt token and at each decoded token
        mine = np.stack([g[b] for g in got])
        row_errs = [rel_rms(m, w) for m, w in zip(mine, want, strict=True)]
        print(f"{cache_dtype} seq {b} (prompt {lens[b]}): rel RMS per position", " ".join(f"{e:.1e}" for e in row_errs))
        errs += row_errs
    median_tol, row_max = TOL[cache_dtype]
    assert np.median(errs) <= median_tol and max(errs) <= row_max


def test_idle_slot_is_untouched(params, rng):
    """A slot with n_new = 0 keeps its state bit for bit (the decode loop relies on it for finished sequences)."""
    B = 2
    cache = cache_lib.init_cache(CFG, B, 16, jnp.float32, "bf16")
    toks = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(B, 5)), jnp.int32)
    _, cache, _ = model.extend(params, toks, jnp.array([5, 3], jnp.int32), cache, CFG, jnp.float32)
    nxt = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(B, 1)), jnp.int32)
    _, cache2, _ = model.extend(params, nxt, jnp.array([1, 0], jnp.int32), cache, CFG, jnp.float32)
    for L, (a, b) in enumerate(zip(cache["layers"], cache2["layers"], strict=True)):
        for k in a:
            assert np.array_equal(np.asarray(a[k])[1], np.asarray(b[k])[1]), (L, k)
            if k in ("state", "conv"):
                assert not np.array_equal(np.asarray(a[k])[0], np.asarray(b[k])[0]), (L, k)
    assert list(np.asarray(cache2["lengths"])) == [6, 3]


def test_fp8_rows_within_e4m3_rounding(rng):
    """write_rows/read_rows with the FP8 cache: each element within half an e4m3 ulp of its row-scaled value."""
    R, C = CFG.kv_lora_rank, CFG.mla_cache_width
    entry = {"rows": jnp.zeros((2, 8, C), cache_lib.FP8), "scales": jnp.ones((2, 8, 2), jnp.float32)}
    rows = rng.standard_normal((2, 3, C)) * np.exp(rng.uniform(-3, 3, size=(2, 3, 1)))
    pos = jnp.asarray([[0, 1, 2], [4, 5, 6]])
    entry = cache_lib.write_rows(entry, jnp.asarray(rows, jnp.float32), pos, jnp.ones((2, 3), bool), R)
    back = np.asarray(cache_lib.read_rows(entry, R, jnp.float32))[np.arange(2)[:, None], np.asarray(pos)]
    for part in (slice(0, R), slice(R, C)):
        x, y = rows[..., part], back[..., part]
        scale = np.abs(x).max(-1, keepdims=True) / 448.0
        bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-9)  # normals: half ulp; subnormals: half step
        assert np.all(np.abs(x - y) <= bound * 1.0001)
