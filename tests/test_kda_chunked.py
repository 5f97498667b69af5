"""KDA chunked delta rule (docs/model.md §4.5) against the recurrent definition (§4.4) in float64 (the oracle's).

Random lengths, including ones the chunk does not divide and ones shorter than a chunk, a non-zero initial
state, V != K (catches axis mix-ups), and a gate pinned near the -5 lower bound for 64+ steps: there
exp(-cumsum g) reaches exp(5 * chunk), the fp32 overflow pitfall of §4.5.
"""

import functools

import jax
import np_reference as ref
import numpy as np
import pytest
from helpers import rel_rms

from k3jax.layers import kda

B, H, K, V = 2, 3, 8, 12


@functools.cache
def _chunked(chunk):
    return jax.jit(functools.partial(kda.delta_rule_chunked, chunk=chunk))


def _inputs(rng, T, g_of, K=K):
    q = ref.l2_normalize(rng.standard_normal((B, T, H, K))) * K**-0.5
    k = ref.l2_normalize(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    beta = rng.uniform(0.0, 1.0, (B, T, H))
    state = 0.5 * rng.standard_normal((B, H, K, V))
    return q, k, v, g_of((B, T, H, K)), beta, state


def _check(rng, T, chunk, g_of, tol=2e-6, K=K):
    q, k, v, g, beta, state = _inputs(rng, T, g_of, K)
    want = [ref.kda_recurrence(q[b], k[b], v[b], g[b], beta[b], state[b]) for b in range(B)]
    o, S = _chunked(chunk)(*(np.float32(a) for a in (q, k, v, g, beta, state)))
    o, S = np.asarray(o), np.asarray(S)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
    o_err = rel_rms(o, np.stack([w[0] for w in want]))
    s_err = rel_rms(S, np.stack([w[1] for w in want]))
    print(f"T={T} chunk={chunk}: rel RMS output {o_err:.1e}, state {s_err:.1e}")
    assert o_err <= tol and s_err <= tol


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_equals_recurrent_on_random_lengths(rng, chunk):
    lengths = [
        1,
        chunk * int(rng.integers(1, 3)),  # shorter than a chunk; an exact multiple
        chunk * int(rng.integers(1, 3)) + int(rng.integers(1, chunk)),
    ]  # a ragged last chunk
    for T in lengths:
        _check(rng, T, chunk, lambda s: rng.uniform(-5.0, 0.0, s))


def test_strong_decay_near_the_bound_stays_finite(rng):
    """Half the key dims decay at ~-5 per step (cumulative -400 over the sequence), the rest barely decay,
    so the state keeps information while the strongly decaying products span exp(+-80) inside a chunk."""
    T = int(rng.integers(64, 97))

    def g_of(s):
        slow = rng.random(s[-1]) < 0.5
        return np.where(slow, rng.uniform(-0.05, 0.0, s), rng.uniform(-5.0, -4.95, s))

    _check(rng, T, kda.CHUNK, g_of)


def test_all_dims_at_the_bound(rng):
    """Every dim at the bound: the state forgets within a few steps; still exact and finite. K = 64 gives the
    small q/k entries (~1/K) of real heads, which a chunk-start factorisation flushes to zero at exp(-80)."""
    _check(rng, int(rng.integers(64, 97)), kda.CHUNK, lambda s: rng.uniform(-5.0, -4.99, s), K=64)
