"""Continuous batching: more requests than slots, finished slots refilled between decode chunks, and every
request gets exactly the tokens it gets when run alone."""

import jax.numpy as jnp
import numpy as np

from k3jax import params as P
from k3jax.config import preset
from k3jax.engine import Engine

CFG = preset("tiny")


def test_serve_refills_slots_and_matches_solo_runs(rng):
    params = P.cast_params(P.init_params(CFG, seed=int(rng.integers(1 << 30))), jnp.float32)
    eng = Engine(CFG, params, max_len=48, max_batch=2, dtype=jnp.float32, cache_dtype="bf16", steps_per_call=4)
    n_req = 5
    prompts = [list(rng.integers(0, CFG.vocab_size, size=int(rng.integers(2, 9)))) for _ in range(n_req)]
    finished = []
    got = eng.serve(prompts, max_new_tokens=10, stop_ids=[-1], on_finish=lambda i, t: finished.append(i))
    assert sorted(finished) == list(range(n_req))
    solo = Engine(CFG, params, max_len=48, max_batch=1, dtype=jnp.float32, cache_dtype="bf16", steps_per_call=4)
    for i, p in enumerate(prompts):
        want = solo.generate([p], max_new_tokens=10, stop_ids=[-1]).tokens[0]
        assert got[i] == want, (i, got[i], want)
    assert len({tuple(t) for t in got}) > 1  # distinct prompts give distinct continuations


def test_serve_stop_token_frees_the_slot(rng):
    """A request that stops early hands its slot to the next one; the later requests are unaffected."""
    params = P.cast_params(P.init_params(CFG, seed=int(rng.integers(1 << 30))), jnp.float32)
    eng = Engine(CFG, params, max_len=48, max_batch=1, dtype=jnp.float32, cache_dtype="bf16", steps_per_call=4)
    prompts = [list(rng.integers(0, CFG.vocab_size, size=5)) for _ in range(3)]
    free = eng.serve(prompts, max_new_tokens=8, stop_ids=[-1])
    stop = free[0][2]  # the third token of request 0 becomes the stop token
    got = eng.serve(prompts, max_new_tokens=8, stop_ids=[stop])
    assert got[0] == free[0][: free[0].index(stop) + 1]
    for i in (1, 2):
        cut = free[i].index(stop) + 1 if stop in free[i] else len(free[i])
        assert got[i] == free[i][:cut]
    assert np.all([len(t) >= 1 for t in got])
