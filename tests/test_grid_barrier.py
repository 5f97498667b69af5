"""pallas_kernels.common.grid_barrier: a persistent launch's grid-wide barrier (bench/grid_barrier.py's kernels).
GPU only where it runs (interpret mode runs no semaphores); on CPU the kernels lower for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import grid_barrier as gb
from tests.kernel_testbase import abstract_gpu, cpu_only, gpu_only, rng


@cpu_only
@pytest.mark.parametrize("G, R", [(132, 4), (264, 1)])
def test_barrier_kernels_lower_for_cuda(G, R):
    with abstract_gpu("sm90"):
        for lowered in (
            jax.jit(gb.barriers(G, R)).trace().lower(lowering_platforms=("cuda",)),
            jax.jit(gb.exchange(G, R))
            .trace(jax.ShapeDtypeStruct((G, gb.LANES), jnp.int32))
            .lower(lowering_platforms=("cuda",)),
        ):
            assert "mosaic_gpu" in lowered.as_text()


def test_exchange_reference_is_the_sum_of_the_neighbours_rows():
    """The NumPy side, by a loop: in round r the row of CTA i + 1 holds seed[i + 1] + r."""
    seed = rng().integers(0, 1 << 20, (5, gb.LANES), dtype=np.int32)
    last, sums = gb.exchange_want(seed, 3)
    want = sum(np.roll(seed, -1, axis=0).astype(np.int64) + r for r in range(3))
    assert np.array_equal(sums, want) and np.array_equal(last, seed + 2)


@gpu_only
@pytest.mark.parametrize("G, R", [(132, 3), (264, 5)])
def test_exchange_on_gpu_sees_every_neighbours_write(G, R):
    """Without the barriers' ordering a CTA reads its neighbour's row of an earlier round (or before its write)."""
    seed = rng().integers(0, 1 << 20, (G, gb.LANES), dtype=np.int32)
    got = jax.jit(gb.exchange(G, R))(jnp.asarray(seed))
    for g, w in zip(got, gb.exchange_want(seed, R), strict=True):
        assert np.array_equal(np.asarray(g), w)
    assert np.all(np.asarray(jax.jit(gb.barriers(G, R))()) == R)
