"""k3jax.sampling against NumPy: top-k / top-p filtering, temperature-sampling frequencies, seeds, refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.sampling import SamplingError, SamplingParams, filtered_logits, probs, sample


def np_filtered(logits_BV, temperature, top_k, top_p):
    """float64 reference: divide by T, keep the k largest, then the smallest prefix (by probability) whose
    mass reaches top_p (renormalised over what top-k kept); everything else -inf."""
    x = np.asarray(logits_BV, np.float64) / temperature
    out = np.full_like(x, -np.inf)
    for b, row in enumerate(x):
        order = np.argsort(-row)
        keep = order[:top_k] if top_k else order
        p = np.exp(row[keep] - row[keep].max())
        p /= p.sum()
        n = int(np.searchsorted(np.cumsum(p), top_p)) + 1 if top_p < 1 else len(keep)  # first prefix >= top_p
        out[b, keep[:n]] = row[keep[:n]]
    return out


def np_probs(logits_BV, temperature, top_k, top_p):
    x = np_filtered(logits_BV, temperature, top_k, top_p)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _kept(x):
    return [set(np.flatnonzero(np.isfinite(r))) for r in np.asarray(x)]


def test_top_k_keeps_exactly_the_k_largest(rng):
    B, V = 6, int(rng.integers(20, 200))
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    for k in (1, int(rng.integers(2, V)), V):
        T = float(rng.uniform(0.3, 2.0))
        got = np.asarray(filtered_logits(jnp.asarray(logits), SamplingParams(temperature=T, top_k=k)))
        assert all(len(s) == k for s in _kept(got))
        assert _kept(got) == _kept(np_filtered(logits, T, k, 1.0))
        kept = np.isfinite(got)
        np.testing.assert_allclose(got[kept], (logits / np.float32(T))[kept], rtol=1e-6)


def test_top_k_at_least_vocab_keeps_everything(rng):
    """top_k >= vocab means no top-k cut (it must not fail inside lax.top_k)."""
    V = int(rng.integers(5, 50))
    logits = jnp.asarray(rng.normal(size=(3, V)), jnp.float32)
    got = filtered_logits(logits, SamplingParams(temperature=1.0, top_k=V + int(rng.integers(1, 100))))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits))


@pytest.mark.parametrize("top_k", [0, 7])
def test_top_p_keeps_smallest_prefix_reaching_p(rng, top_k):
    B, V = 8, int(rng.integers(20, 300))
    logits = rng.normal(size=(B, V)).astype(np.float32) * float(rng.uniform(0.5, 4))
    for p in (float(rng.uniform(0.05, 0.5)), float(rng.uniform(0.5, 0.99)), 1e-6):
        sp = SamplingParams(temperature=float(rng.uniform(0.5, 1.5)), top_k=top_k, top_p=p)
        got = np.asarray(filtered_logits(jnp.asarray(logits), sp))
        want = np_filtered(logits, sp.temperature, top_k, p)
        assert _kept(got) == _kept(want), p
        # the kept set reaches p and dropping its least likely member would not
        pr = np_probs(logits, sp.temperature, top_k, 1.0)
        for b, s in enumerate(_kept(got)):
            mass = pr[b, list(s)].sum()
            assert mass >= p - 1e-6 and mass - pr[b, list(s)].min() < p
        np.testing.assert_allclose(
            np.asarray(probs(jnp.asarray(logits), sp)), np_probs(logits, sp.temperature, top_k, p), atol=1e-6
        )


def test_greedy_is_argmax_and_probs_one_hot(rng):
    logits = rng.normal(size=(5, 40)).astype(np.float32)
    sp = SamplingParams()
    assert sp.greedy
    ids = np.asarray(sample(jnp.asarray(logits), jax.random.key(int(rng.integers(1 << 30))), sp))
    np.testing.assert_array_equal(ids, logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(probs(jnp.asarray(logits), sp)), np.eye(40)[logits.argmax(-1)])


def _chi2(counts, p):
    """Pearson chi-square over the categories with p > 0 (and a count outside them is an instant failure)."""
    assert counts[p == 0].sum() == 0, "sampled a token the filter removed"
    e = p[p > 0] * counts.sum()
    return float(((counts[p > 0] - e) ** 2 / e).sum()), int((p > 0).sum()) - 1


def _bound(df, z=4.75):
    """Wilson-Hilferty upper quantile of chi-square(df) at z sigma (4.75 sigma: one false failure in ~1e6)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.7)])
def test_sampling_frequencies_match_softmax(rng, top_k, top_p):
    V, N = 8, 40000
    logits = (rng.normal(size=V) * 1.5).astype(np.float32)
    T = float(rng.choice([rng.uniform(0.4, 0.6), rng.uniform(1.7, 2.5)]))  # far enough from 1 to be told apart
    sp = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=1234)
    ids = np.asarray(sample(jnp.tile(jnp.asarray(logits), (N, 1)), jax.random.key(sp.seed), sp))
    counts = np.bincount(ids, minlength=V)
    want = np_probs(logits[None], T, top_k, top_p)[0]
    stat, df = _chi2(counts, want)  # asserts nothing outside the kept set was sampled
    if df > 0:  # with a sharp distribution top-p may keep a single token (df = 0): then every draw is it
        print(f"T={T:.2f} chi2={stat:.1f} df={df} bound={_bound(df):.1f}")
        assert stat < _bound(df)
    # the test has power: the same counts are far outside the bound for the untempered distribution
    wrong = np_probs(logits[None], 1.0, 0, 1.0)[0]
    assert ((counts - wrong * N) ** 2 / (wrong * N)).sum() > 10 * _bound(V - 1)


def test_seeds(rng):
    logits = jnp.asarray(rng.normal(size=(256, 50)), jnp.float32)
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    s = int(rng.integers(1 << 30))
    a = np.asarray(sample(logits, jax.random.key(s), sp))
    b = np.asarray(sample(logits, jax.random.key(s), sp))
    c = np.asarray(sample(logits, jax.random.key(s + 1), sp))
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.3


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-0.2),
        dict(top_p=float("nan")),
        dict(top_k=-1),
    ],
)
def test_invalid_values_raise(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)
