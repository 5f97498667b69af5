"""pallas_kernels.collectives: dispatch and the XLA fallback on CPU; the Pallas kernels on >= 2 GPUs.

Oracles are float64 NumPy sums of the per-rank inputs (written from the definition, not from the code).
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels.collectives import api

BF16 = ml_dtypes.bfloat16
N_GPUS = sum(d.platform == "gpu" for d in jax.devices())
gpu2 = pytest.mark.skipif(N_GPUS < 2, reason="needs >= 2 GPUs")


# ---------------------------------------------------------------------------------------------- helpers
def _mesh(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices")
  return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:n])


def _sharded(mesh, fn, n_in, n_out):
  """jit(shard_map(fn)) where every operand/result carries a leading rank axis of size n."""
  spec = P("tp")
  inner = lambda *a: jax.tree.map(lambda y: y[None], fn(*(v[0] for v in a)))
  out_specs = spec if n_out == 1 else (spec,) * n_out
  f = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * n_in, out_specs=out_specs,
                            check_vma=False))
  sharding = jax.sharding.NamedSharding(mesh, spec)
  return lambda *a: f(*(jax.device_put(v, sharding) for v in a))


def _np_add_rmsnorm(x_nBD, res_BD, w_D, eps):
  """K3_SPEC RMSNorm after a residual add: fp32/64 maths, bf16 rounding of new, of x*r, and of the product."""
  s = x_nBD.astype(np.float64).sum(0)
  new = (res_BD.astype(np.float64) + s).astype(BF16)
  nf = new.astype(np.float64)
  inv = 1.0 / np.sqrt(np.mean(nf * nf, axis=-1, keepdims=True) + eps)
  normed = ((nf * inv).astype(BF16).astype(np.float64) * w_D.astype(np.float64)).astype(BF16)
  return new, normed


def _ulps(a, ref):
  """|a - ref| in BF16 ulps of ref."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return np.abs(a - ref) / 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)


def _assert_fused_close(new, normed, ref_new, ref_normed):
  """FP32 kernel vs FP64 oracle: new within 1 ulp (double rounding), normed within 3 (two more roundings)."""
  assert _ulps(new, ref_new).max() <= 1
  assert _ulps(normed, ref_normed).max() <= 3


def _assert_sum_close(y_nshape, x_nshape, dtype):
  """Each rank's result is within one rounding of the float64 sum, and all ranks agree bit for bit."""
  ref = x_nshape.astype(np.float64).sum(0)
  y = np.asarray(y_nshape)
  eps = float(jnp.finfo(dtype).eps)
  scale = np.abs(x_nshape.astype(np.float64)).sum(0)
  np.testing.assert_array_less(np.abs(y[0].astype(np.float64) - ref), eps * scale + 1e-30)
  for r in range(1, y.shape[0]):
    np.testing.assert_array_equal(y[r].view(np.uint8), y[0].view(np.uint8))


# ------------------------------------------------------------------------------- CPU: dispatch logic
def test_plan_falls_back_when_ineligible():
  assert api.plan_all_reduce((1, 7168), jnp.bfloat16, 2, "cpu").algorithm == "xla"
  assert api.plan_all_reduce((1, 7168), jnp.bfloat16, 1, "gpu").algorithm == "xla"
  assert api.plan_all_reduce((1, 7168), jnp.int32, 2, "gpu").algorithm == "xla"
  assert api.plan_all_reduce((3, 100), jnp.bfloat16, 2, "gpu").algorithm == "xla"
  assert api.plan_all_reduce((0, 7168), jnp.bfloat16, 2, "gpu").algorithm == "xla"
  assert api.plan_add_rmsnorm((1, 7168), jnp.bfloat16, (1, 7168), jnp.bfloat16, (7168,), 2,
                              "cpu").algorithm == "xla"
  assert api.plan_add_rmsnorm((1, 7168), jnp.bfloat16, (1, 7168), jnp.bfloat16, (3584,), 2,
                              "gpu").algorithm == "xla"
  assert api.plan_add_rmsnorm((1, 200), jnp.bfloat16, (1, 200), jnp.bfloat16, (200,), 2,
                              "gpu").algorithm == "xla"
  assert api.plan_add_rmsnorm((1, 65536), jnp.bfloat16, (1, 65536), jnp.bfloat16, (65536,), 2,
                              "gpu").algorithm == "xla"


def test_plan_blocks_tile_the_message(rng):
  """Random eligible sizes: blocks divide the rows, fit the per-CTA budget, two-shot splits evenly."""
  for _ in range(200):
    n = int(rng.choice([2, 4, 8]))
    dtype = rng.choice([jnp.bfloat16, jnp.float32])
    shape = (int(rng.integers(1, 65)), 128 * int(rng.integers(1, 80)))
    m = math.prod(shape) // 128
    for algorithm in (None, "one_shot", "one_shot_st", "two_shot"):
      plan = api.plan_all_reduce(shape, dtype, n, "gpu", algorithm)
      # two-shot needs a block count divisible by n; otherwise the plan falls back to one-shot.
      assert plan.algorithm == (algorithm or "one_shot_st") or (algorithm, plan.algorithm) == (
          "two_shot", "one_shot")
      assert m % plan.block_rows == 0
      assert plan.block_rows * 128 * jnp.dtype(dtype).itemsize <= api.BLOCK_BYTES
      if plan.algorithm == "two_shot":
        assert (m // plan.block_rows) % n == 0
  # small messages take 4 KB blocks (more CTAs), large ones 16 KB.
  assert api.plan_all_reduce((1, 7168), jnp.bfloat16, 2, "gpu").block_rows == 14  # 4 CTAs
  assert api.plan_all_reduce((64, 7168), jnp.bfloat16, 2, "gpu").block_rows == 64
  for b in (1, 8, 64):
    for d in (7168, 3584):
      assert api.plan_all_reduce((b, d), jnp.bfloat16, 2, "gpu").algorithm != "xla"
      plan = api.plan_add_rmsnorm((b, d), jnp.bfloat16, (b, d), jnp.bfloat16, (d,), 2, "gpu")
      assert plan.algorithm == "one_shot_add_rmsnorm" and plan.block_rows == d // 128


# --------------------------------------------------------------------------------- CPU: XLA fallback
@pytest.mark.parametrize("backend", ["xla", "latency_specialized"])
@pytest.mark.parametrize("n", [2, 4])
def test_fallback_all_reduce_matches_sum(rng, backend, n):
  mesh = _mesh(n)
  x = rng.standard_normal((n, 3, 7168)).astype(BF16)
  f = _sharded(mesh, lambda v: api.all_reduce(v, "tp", backend=backend), 1, 1)
  y = np.asarray(f(x))
  assert y.dtype == x.dtype and y.shape == x.shape
  _assert_sum_close(y, x, jnp.bfloat16)


@pytest.mark.parametrize("backend", ["xla", "latency_specialized"])
def test_fallback_add_rmsnorm_matches_numpy(rng, backend):
  n, b, d = 2, 4, 3584
  mesh = _mesh(n)
  x = rng.standard_normal((n, b, d)).astype(BF16)
  res = np.broadcast_to(rng.standard_normal((b, d)).astype(BF16), (n, b, d))
  w = np.broadcast_to((1 + 0.1 * rng.standard_normal(d)).astype(BF16), (n, d))
  f = _sharded(mesh, lambda v, r, g: api.all_reduce_add_rmsnorm(v, r, g, 1e-5, "tp", backend=backend), 3, 2)
  new, normed = (np.asarray(a) for a in f(x, np.ascontiguousarray(res), np.ascontiguousarray(w)))
  ref_new, ref_normed = _np_add_rmsnorm(x, res[0], w[0], 1e-5)
  for r in range(n):
    _assert_fused_close(new[r], normed[r], ref_new, ref_normed)


# --------------------------------------------------------------------------------- GPU: the kernels
@gpu2
@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_st", "two_shot"])
@pytest.mark.parametrize("shape", [(1, 7168), (8, 7168), (64, 7168), (1, 3584), (64, 3584), (3, 1280)])
def test_pallas_all_reduce_real_shapes(rng, algorithm, shape):
  mesh = _mesh(2)
  x = rng.standard_normal((2, *shape)).astype(BF16)
  f = _sharded(mesh, lambda v: api.all_reduce(v, "tp", backend="latency_specialized",
                                              algorithm=algorithm), 1, 1)
  _assert_sum_close(np.asarray(f(x)), x, jnp.bfloat16)


@gpu2
@pytest.mark.gpu
def test_pallas_all_reduce_random_sizes(rng):
  mesh = _mesh(2)
  for _ in range(4):
    shape = (int(rng.integers(1, 65)), 128 * int(rng.integers(1, 64)))
    x = (rng.standard_normal((2, *shape)) * 10.0 ** rng.uniform(-3, 3)).astype(BF16)
    f = _sharded(mesh, lambda v: api.all_reduce(v, "tp", backend="latency_specialized"), 1, 1)
    _assert_sum_close(np.asarray(f(x)), x, jnp.bfloat16)


@gpu2
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 7168), (64, 7168), (8, 3584)])
def test_pallas_add_rmsnorm(rng, shape):
  mesh = _mesh(2)
  b, d = shape
  x = rng.standard_normal((2, b, d)).astype(BF16)
  res = np.ascontiguousarray(np.broadcast_to(rng.standard_normal((b, d)).astype(BF16), (2, b, d)))
  w = np.ascontiguousarray(np.broadcast_to((1 + 0.1 * rng.standard_normal(d)).astype(BF16), (2, d)))
  f = _sharded(mesh, lambda v, r, g: api.all_reduce_add_rmsnorm(
      v, r, g, 1e-5, "tp", backend="latency_specialized"), 3, 2)
  new, normed = (np.asarray(a) for a in f(x, res, w))
  ref_new, ref_normed = _np_add_rmsnorm(x, res[0], w[0], 1e-5)
  _assert_fused_close(new[0], normed[0], ref_new, ref_normed)
  np.testing.assert_array_equal(new[1].view(np.uint16), new[0].view(np.uint16))
  np.testing.assert_array_equal(normed[1].view(np.uint16), normed[0].view(np.uint16))


@gpu2
@pytest.mark.gpu
def test_pallas_back_to_back_stress(rng):
  """500 loop steps, each four different all-reduce kernels back to back on fresh data, all checked."""
  from bench.collectives import stress  # the same loop the benchmark runs with 2000 steps

  report = stress(_mesh(2), steps=500, seed=int(rng.integers(2**31)))
  assert report["bad_calls"] == 0, report
