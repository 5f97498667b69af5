"""Row-parallel projection fused with its all-reduce (pallas_kernels/collectives/fused_projection.py).

CPU: the XLA reference vs float64 NumPy, dispatch/eligibility, the kernel's GEMM + epilogue in interpret mode
(one rank: semaphores and remote refs do not run in interpret mode), and the real two-rank kernel lowered
for CUDA inside shard_map on an abstract 2 x H100 mesh. GPU (>= 2 GPUs): real shapes vs float64, ranks
bit-identical, random sizes, back-to-back stress. Oracles are float64 sums written from the definition.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bench import fused_projection as bench_fp
from bench.fused_projection import draw, oracle, proj_bad, run_proj, stress
from pallas_kernels.collectives import api, fused_projection, reference
from pallas_kernels.policy import SPECIALIZED, XLA, DecodePolicy

BF16 = ml_dtypes.bfloat16
N_GPUS = sum(d.platform == "gpu" for d in jax.devices())
gpu2 = pytest.mark.skipif(N_GPUS < 2, reason="needs >= 2 GPUs")
cpu_only = pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="CPU-only check")
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
SM90 = (9, 0)


# This file tests the kernel itself, which the api only dispatches to when the policy opts in (see api.py).
FUSED = DecodePolicy("latency_specialized", fused_projection=True)


def _mesh(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])


def _plan(b, k, d, n=2, res=True, x_dtype=jnp.bfloat16, res_dtype=jnp.bfloat16, platform="gpu", arch=SM90, **kw):
    return api.plan_proj_all_reduce(
        (b, k), x_dtype, (k, d), x_dtype, (b, d) if res else None, res_dtype if res else None, n, platform, arch, **kw
    )


# ------------------------------------------------------------------------------- CPU: XLA reference
@pytest.mark.parametrize("backend", ["xla", "latency_specialized"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("residual", [True, False])
def test_reference_matches_float64(rng, backend, n, residual):
    """On CPU both backends run the XLA reference: psum of FP32 partials, one rounding, ranks identical."""
    b, k, d = int(rng.integers(1, 9)), 64 * int(rng.integers(1, 6)), 128 * int(rng.integers(1, 5))
    x, w, r = draw(rng, n, b, k, d, residual)
    y = run_proj(_mesh(n), x, w, r, policy=FUSED if backend == "latency_specialized" else XLA)
    assert y.shape == (n, b, d) and y.dtype == BF16
    ref, scale = oracle(x, w, r)
    assert not proj_bad(y, ref, scale)


def test_reference_keeps_residual_dtype_and_leading_axes(rng):
    """(B, T, K) activations and an FP32 residual: the output has the residual's shape and dtype."""
    n, b, t, k, d = 2, 2, 3, 128, 256
    x = rng.standard_normal((n, b, t, k)).astype(BF16)
    w = (rng.standard_normal((n, k, d)) / 16).astype(BF16)
    r = rng.standard_normal((b, t, d)).astype(np.float32)
    y = run_proj(_mesh(n), x, w, r)
    assert y.shape == (n, b, t, d) and y.dtype == np.float32
    ref, scale = oracle(x.reshape(n, b * t, k), w, r.reshape(b * t, d))
    assert not proj_bad(y.reshape(n, b * t, d), ref, scale)


def test_proj_bad_catches_a_missing_rank(rng):
    """The tolerance is tight enough that dropping one rank's partial (what a lost signal gives) fails."""
    n, b, k, d = 2, 4, 768, 512
    x, w, r = draw(rng, n, b, k, d)
    ref, scale = oracle(x, w, r)
    one_rank, _ = oracle(x[:1], w[:1], r)
    wrong = np.broadcast_to(one_rank.astype(BF16), (n, b, d))
    right = np.broadcast_to(ref.astype(BF16), (n, b, d)).copy()
    assert proj_bad(wrong, ref, scale) and not proj_bad(right, ref, scale)
    right.view(np.uint16)[1, 0, 0] ^= 1  # one rank's last bit differs
    assert proj_bad(right, ref, scale)


# ------------------------------------------------------------------------------- CPU: dispatch
def test_plan_takes_the_k3_shapes():
    for b in (1, 8, 64):
        for k, d in ((768, 7168), (1536, 7168), (1792, 3584), (224, 7168), (768, 3584)):
            for res in (True, False):
                plan = _plan(b, k, d, res=res)
                assert plan.algorithm == "fused", (b, k, d, plan)
                assert d % plan.tile_d == 0 and d // plan.tile_d <= api.H100_SMS
    assert (_plan(1, 768, 7168).tile_d, _plan(1, 768, 7168).stages) == (64, 8)  # 112 CTAs: one wave
    wide = _plan(1, 768, 7168, num_sms=100)  # 128-wide tiles: fewer weight tiles fit in SMEM
    fits = [s for s in range(2, 9) if fused_projection.smem_bytes(768, 2, 128, s) <= api.PROJ_SMEM_BUDGET]
    assert (wide.tile_d, wide.stages) == (128, max(fits))


@pytest.mark.parametrize(
    "why, kwargs",
    [
        ("platform", dict(platform="cpu")),
        ("Blackwell", dict(arch=(10, 0))),
        ("no GPU", dict(arch=None)),
        ("one rank", dict(n=1)),
        ("FP32 operands", dict(x_dtype=jnp.float32)),
        ("int residual", dict(res_dtype=jnp.int32)),
        ("too many tokens", dict(b=65)),
        ("K not a multiple of 32", dict(k=100)),
        ("one K tile", dict(k=32)),
        ("D not a multiple of 64", dict(d=7000)),
        ("grid larger than one wave", dict(d=64 * 1024)),
        ("exchange SMEM at 16 ranks", dict(n=16)),
    ],
)
def test_plan_falls_back_with_a_reason(why, kwargs):
    shape = dict(b=8, k=768, d=7168)
    shape.update({key: kwargs.pop(key) for key in ("b", "k", "d") if key in kwargs})
    plan = _plan(shape["b"], shape["k"], shape["d"], **kwargs)
    assert plan.algorithm == "xla" and plan.reason, why


def test_plan_refuses_mismatched_operands():
    ok = dict(n=2, platform="gpu", arch=SM90)
    assert (
        api.plan_proj_all_reduce((8, 768), jnp.bfloat16, (768, 7168), jnp.float16, None, None, **ok).algorithm == "xla"
    )
    assert (
        api.plan_proj_all_reduce((8, 768), jnp.bfloat16, (512, 7168), jnp.bfloat16, None, None, **ok).algorithm == "xla"
    )
    assert (
        api.plan_proj_all_reduce(
            (8, 768), jnp.bfloat16, (768, 7168), jnp.bfloat16, (8, 3584), jnp.bfloat16, **ok
        ).algorithm
        == "xla"
    )


def test_plan_random_shapes_fit(rng):
    """Eligible random shapes: tiles divide D, the grid is one wave, SMEM fits the budget."""
    for _ in range(300):
        n = int(rng.choice([2, 4, 8]))
        b, k, d = int(rng.integers(1, 65)), 32 * int(rng.integers(2, 120)), 64 * int(rng.integers(1, 300))
        plan = _plan(b, k, d, n=n, res=bool(rng.integers(2)))
        if plan.algorithm == "xla":
            continue
        tk = fused_projection.tile_k_for(k)
        assert d % plan.tile_d == 0 and plan.tile_d % tk == 0 and d // plan.tile_d <= api.H100_SMS
        assert 2 <= plan.stages <= fused_projection.MAX_STAGES
        assert fused_projection.smem_bytes(k, n, plan.tile_d, plan.stages) <= api.PROJ_SMEM_BUDGET


def test_unknown_backend_raises():
    with pytest.raises(ValueError):
        api.proj_all_reduce(jnp.ones((1, 64)), jnp.ones((64, 64)), policy=DecodePolicy("nccl"))


# ------------------------------------------------------------ CPU: the kernel in interpret mode, one rank
@cpu_only
@pytest.mark.parametrize(
    "b, k, d, res_dtype, max_stages",
    [
        (1, 256, 128, BF16, 2),  # B = 1: 63 rows of TMA zero fill; 4 K steps through a 2-slot ring
        (5, 96, 192, None, 8),  # odd B, tile_k 32 (64-byte swizzle), no residual
        (64, 192, 128, np.float32, 8),  # a full M tile, FP32 residual and output
        (13, 128, 128, BF16, 4),  # B > 8 and not a multiple of 8: padded to 16 rows (TMA box rule), sliced back
    ],
)
def test_kernel_interpret_one_rank(rng, b, k, d, res_dtype, max_stages):
    """The kernel's GEMM, padding and epilogue, executed on CPU (n = 1 has no exchange)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x = rng.standard_normal((1, b, k)).astype(BF16)
    w = (rng.standard_normal((1, k, d)) / np.sqrt(k)).astype(BF16)
    r = None if res_dtype is None else rng.standard_normal((b, d)).astype(res_dtype)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        y = fused_projection.proj_all_reduce(
            jnp.asarray(x[0]),
            jnp.asarray(w[0]),
            None if r is None else jnp.asarray(r),
            axis_name="tp",
            n=1,
            max_stages=max_stages,
            interpret=plgpu.InterpretGPUParams(detect_races=True),
        )
    assert y.dtype == (r.dtype if r is not None else BF16) and y.shape == (b, d)
    ref, scale = oracle(x, w, r)
    assert not proj_bad(np.asarray(y)[None], ref, scale)


# ------------------------------------------------- CPU: the two-rank kernel lowered for CUDA (not run)
@cpu_only
@pytest.mark.parametrize(
    "n, b, k, d, residual",
    [
        (2, 1, 768, 7168, jnp.bfloat16),
        (2, 8, 768, 7168, None),
        (2, 64, 1536, 7168, jnp.bfloat16),
        (2, 4, 224, 3584, jnp.float32),
        (4, 8, 768, 7168, jnp.bfloat16),
    ],
)
def test_kernel_lowers_for_cuda_in_shard_map(monkeypatch, n, b, k, d, residual):
    """api dispatch -> the fused kernel inside shard_map on an abstract n x H100 mesh, lowered for CUDA: layout
    and lowering errors of the real exchange kernel show on CPU, and no XLA all-reduce is left."""
    monkeypatch.setattr(api, "current_platform", lambda: "gpu")
    monkeypatch.setattr(api, "num_sms", lambda: 132)
    mesh = jax.sharding.AbstractMesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=H100)
    spec = jax.sharding.NamedSharding(mesh, P("tp"))
    args = [
        jax.ShapeDtypeStruct((n, b, k), jnp.bfloat16, sharding=spec),
        jax.ShapeDtypeStruct((n, k, d), jnp.bfloat16, sharding=spec),
    ]
    if residual is not None:
        args.append(jax.ShapeDtypeStruct((n, b, d), residual, sharding=spec))

    def per_rank(*a):
        return api.proj_all_reduce(*(v[0] for v in a), *(() if residual is not None else (None,)), "tp", policy=FUSED)[
            None
        ]

    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("tp"),) * len(args), out_specs=P("tp"), check_vma=False))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.all_reduce" not in text


@cpu_only
def test_fused_kernel_is_opt_in(monkeypatch, caplog):
    """Without the policy's fused_projection an eligible GPU call lowers to GEMM + XLA all-reduce and says why."""
    import logging

    from pallas_kernels import common

    monkeypatch.setattr(api, "current_platform", lambda: "gpu")
    monkeypatch.setattr(common, "gpu_arch", lambda: SM90)
    mesh = jax.sharding.AbstractMesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=H100)
    spec = jax.sharding.NamedSharding(mesh, P("tp"))
    args = [
        jax.ShapeDtypeStruct((2, 8, 768), jnp.bfloat16, sharding=spec),
        jax.ShapeDtypeStruct((2, 768, 7168), jnp.bfloat16, sharding=spec),
    ]
    per_rank = lambda x, w: api.proj_all_reduce(x[0], w[0], None, "tp", policy=SPECIALIZED)[None]  # noqa: E731
    f = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("tp"),) * 2, out_specs=P("tp"), check_vma=False))
    common.log_once.cache_clear()  # the reason may have been logged by an earlier test
    with caplog.at_level(logging.WARNING), jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" not in text and "all_reduce" in text
    assert any("fused_projection=True" in r.getMessage() for r in caplog.records)


@cpu_only
def test_fallback_logs_the_reason_once(rng, caplog):
    """On CPU latency_specialized falls back to the reference and says why."""
    import logging

    from pallas_kernels import common

    common.log_once.cache_clear()
    x, w, r = draw(rng, 2, 2, 64, 128)
    with caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        y = run_proj(_mesh(2), x, w, r)
    assert any("proj_all_reduce" in m and "platform cpu" in m for m in caplog.messages)
    ref, scale = oracle(x, w, r)
    assert not proj_bad(y, ref, scale)


@cpu_only
@pytest.mark.parametrize("calls", [bench_fp.PAIR, ((4, 768, 7168, False), (4, 768, 7168, False))])
def test_stress_harness_on_the_fallback(monkeypatch, calls):
    """The GPU stress loop's checking logic, run on CPU through the fallback (few steps): clean on the right
    sum, and every call counted bad when the result is 5% off."""
    seed = int(np.random.default_rng().integers(2**31))
    report = stress(_mesh(2), steps=3, seed=seed, calls=calls)
    assert report["bad_calls"] == 0 and report["residual_ranks_identical"], report
    off = lambda x, w, r, axis, **kw: reference.proj_all_reduce(x, w, r, axis) * 1.05  # noqa: E731
    monkeypatch.setattr(api, "proj_all_reduce", off)
    report = stress(_mesh(2), steps=3, seed=seed, calls=calls)
    assert report["bad_calls"] == 3 * len(calls), report


@pytest.mark.parametrize("name", ["xla_f32", "xla_bf16", "dot+ar", "fused", "fused@d128", "fused@s4"])
def test_bench_chains_compute_the_sum(rng, name):
    """Every timed variant computes the same chained result (its own rounding aside): the bench times the
    right thing. On CPU the Pallas variants run their fallback; on GPUs the kernels."""
    mesh = _mesh(2)
    b, k, d = 2, 128, 256
    xs = rng.standard_normal((2, bench_fp.CHAIN, b, k)).astype(BF16)
    ws = (rng.standard_normal((2, bench_fp.CHAIN, k, d)) / np.sqrt(2 * k)).astype(BF16)
    r = np.broadcast_to(rng.standard_normal((1, b, d)).astype(BF16), (2, b, d)).copy()
    f, put = bench_fp.build_chain(mesh, name)
    y = np.asarray(f(*put(xs, ws, r)), np.float64)
    want = r[0].astype(np.float64)
    for c in range(bench_fp.CHAIN):
        want = want + sum(xs[i, c].astype(np.float64) @ ws[i, c].astype(np.float64) for i in range(2))
    np.testing.assert_allclose(y[0], want, rtol=0.05, atol=0.05 * np.abs(want).max())
    np.testing.assert_array_equal(y[1], y[0])


# --------------------------------------------------------------------------------- GPU: the kernel
def _assert_kernel_path(mesh, x, w, r):
    """The api really dispatches to the fused kernel on this machine (no silent fallback to psum)."""
    from bench.collectives import sharded

    args = [x, w] + ([] if r is None else [np.ascontiguousarray(np.broadcast_to(r, (mesh.size, *r.shape)))])
    f, put = sharded(
        mesh,
        lambda a, b, *c: api.proj_all_reduce(a, b, *(c or (None,)), "tp", policy=FUSED),
        len(args),
    )
    text = f.lower(*put(*args)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.all_reduce" not in text


@gpu2
@pytest.mark.gpu2
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("k, d", [(768, 7168), (1536, 7168), (1792, 3584)])
@pytest.mark.parametrize("b", [1, 8, 64])
def test_pallas_real_shapes(rng, b, k, d, residual):
    """Within one rounding + FP32 accumulation allowance of float64, ranks bit-identical; same check on the
    XLA reference so the two are held to one standard."""
    mesh = _mesh(2)
    x, w, r = draw(rng, 2, b, k, d, residual)
    _assert_kernel_path(mesh, x, w, r)
    ref, scale = oracle(x, w, r)
    y = run_proj(mesh, x, w, r)
    assert not proj_bad(y, ref, scale)
    assert not proj_bad(run_proj(mesh, x, w, r, policy=XLA), ref, scale)


@gpu2
@pytest.mark.gpu2
def test_pallas_random_sizes(rng):
    mesh = _mesh(2)
    for _ in range(6):
        b, k, d = int(rng.integers(1, 65)), 32 * int(rng.integers(2, 80)), 64 * int(rng.integers(1, 129))
        x, w, r = draw(rng, 2, b, k, d, bool(rng.integers(2)))
        ref, scale = oracle(x, w, r)
        assert not proj_bad(run_proj(mesh, x, w, r), ref, scale), (b, k, d)


@gpu2
@pytest.mark.gpu2
@pytest.mark.parametrize("tile_d, max_stages", [(128, 8), (64, 2)])
def test_pallas_other_tiles(rng, tile_d, max_stages):
    mesh = _mesh(2)
    x, w, r = draw(rng, 2, 8, 768, 7168)
    ref, scale = oracle(x, w, r)
    assert not proj_bad(run_proj(mesh, x, w, r, tile_d=tile_d, max_stages=max_stages), ref, scale)


@gpu2
@pytest.mark.gpu2
def test_pallas_fp32_residual(rng):
    mesh = _mesh(2)
    x, w, r = draw(rng, 2, 8, 768, 7168, res_dtype=np.float32)
    y = run_proj(mesh, x, w, r)
    assert y.dtype == np.float32
    ref, scale = oracle(x, w, r)
    assert not proj_bad(y, ref, scale)


@gpu2
@pytest.mark.gpu2
def test_pallas_back_to_back_stress(rng):
    """300 loop steps x 2 different fused calls back to back on fresh device-drawn data, all checked."""
    report = stress(_mesh(2), steps=300, seed=int(rng.integers(2**31)))
    assert report["bad_calls"] == 0 and report["residual_ranks_identical"], report


def test_reference_is_what_api_xla_runs(rng):
    """policy=XLA is the reference, bit for bit (the oracle for the GPU tests above)."""
    n = 2
    x, w, r = draw(rng, n, 3, 128, 256)
    mesh = _mesh(n)
    got = run_proj(mesh, x, w, r, policy=XLA)
    from bench.collectives import sharded

    f, put = sharded(mesh, lambda a, b, c: reference.proj_all_reduce(a, b, c, "tp"), 3)
    want = np.asarray(f(*put(x, w, np.ascontiguousarray(np.broadcast_to(r, (n, *r.shape))))))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
