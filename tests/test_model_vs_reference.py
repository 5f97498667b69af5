"""The whole tiny model and each layer against the independent float64 NumPy oracle (tests/np_reference.py)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import oracle_clear_of_route_ties, random_model, rel_rms

from k3jax import model
from k3jax.config import preset


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_full_model_matches_reference(name, rng):
    cfg = preset(name)
    tc = cfg.to_hf(wrapped=False)
    params, hf = random_model(cfg, int(rng.integers(1 << 30)))
    T = int(rng.integers(5, 23))
    tokens, want = oracle_clear_of_route_ties(hf, tc, lambda: rng.integers(0, cfg.vocab_size, size=(T,)))
    got = jax.jit(model.forward, static_argnums=(2, 3))(params, jnp.asarray(tokens)[None], cfg, jnp.float32)[0]
    err = rel_rms(got, want)
    print(f"{name}: T={T} relative RMS error vs float64 oracle = {err:.2e}")
    # The product's numerics bar: <= 2e-5 relative RMS in float32 at highest precision. Over 53 seeds
    # of the demo model the median is 3.3e-6 and the worst 1.04e-5; on that worst seed the NumPy oracle run in
    # float32 is off by 9.9e-6 too, so it is the float32 floor of an ill-conditioned draw, not our error.
    assert err <= 2e-5
