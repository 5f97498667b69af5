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
from pallas_kernels.policy import SPECIALIZED, XLA, DecodePolicy, DispatchLog, Tuning, recording

BF16 = ml_dtypes.bfloat16
N_GPUS = sum(d.platform == "gpu" for d in jax.devices())
gpu2 = pytest.mark.skipif(N_GPUS < 2, reason="needs >= 2 GPUs")


# ---------------------------------------------------------------------------------------------- helpers
def _mesh(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    return jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:n])


def _sharded(mesh, fn, n_in, n_out):
    """jit(shard_map(fn)) where every operand/result carries a leading rank axis of size n."""
    spec = P("tp")
    inner = lambda *a: jax.tree.map(lambda y: y[None], fn(*(v[0] for v in a)))
    out_specs = spec if n_out == 1 else (spec,) * n_out
    f = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * n_in, out_specs=out_specs, check_vma=False))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    put = lambda a: [jax.device_put(v, sharding) for v in a]  # noqa: E731
    call = lambda *a: f(*put(a))  # noqa: E731
    call.lower = lambda *a: f.lower(*put(a))  # what the api dispatched to, for tests that check it
    return call


def _np_add_rmsnorm(x_nBD, res_BD, w_D, eps):
    """docs/model.md §1.5 RMSNorm after a residual add: fp32/64 maths, bf16 rounding of new, of x*r, and of the
    product."""
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


def _assert_ranks_identical(*arrays_n):
    """Every rank's result has rank 0's bits (arrays with a leading rank axis)."""
    for a in arrays_n:
        for r in range(1, a.shape[0]):
            np.testing.assert_array_equal(a[r].view(np.uint8), a[0].view(np.uint8))


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
    assert api.plan_add_rmsnorm((1, 7168), jnp.bfloat16, (1, 7168), jnp.bfloat16, (7168,), 2, "cpu").algorithm == "xla"
    assert api.plan_add_rmsnorm((1, 7168), jnp.bfloat16, (1, 7168), jnp.bfloat16, (3584,), 2, "gpu").algorithm == "xla"
    assert api.plan_add_rmsnorm((1, 200), jnp.bfloat16, (1, 200), jnp.bfloat16, (200,), 2, "gpu").algorithm == "xla"
    assert (
        api.plan_add_rmsnorm((1, 65536), jnp.bfloat16, (1, 65536), jnp.bfloat16, (65536,), 2, "gpu").algorithm == "xla"
    )


def test_plan_blocks_tile_the_message(rng):
    """Random eligible sizes: blocks divide the rows and fit the per-CTA budget; unknown kernels are refused."""
    t = XLA.table("collectives")  # the thresholds are the policy's tuning data
    for _ in range(200):
        n = int(rng.choice([2, 4, 8]))
        dtype = rng.choice([jnp.bfloat16, jnp.float32])
        shape = (int(rng.integers(1, 65)), 128 * int(rng.integers(1, 80)))
        m = math.prod(shape) // 128
        nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        auto = (
            "xla"
            if nbytes < t["psum_below_bytes"].get(str(n), 0)
            else "one_shot_st"
            if nbytes <= t["one_shot_st_max_bytes"]
            else "one_shot"
        )
        for algorithm in (None, "one_shot", "one_shot_st"):
            plan = api.plan_all_reduce(shape, dtype, n, "gpu", algorithm)
            assert plan.algorithm == (algorithm or auto)
            if plan.algorithm == "xla":  # psum chosen from the measurements
                assert "measured" in plan.reason
                continue
            assert m % plan.block_rows == 0
            assert plan.block_rows * 128 * jnp.dtype(dtype).itemsize <= t["block_bytes"]
    with pytest.raises(ValueError, match="one_shot_st"):  # two_shot: removed (never chosen, never faster)
        api.plan_all_reduce((64, 7168), jnp.bfloat16, 2, "gpu", "two_shot")
    # the measured choices at 2 ranks: psum for small messages, plain stores, then TMA; 16 KB blocks.
    assert api.plan_all_reduce((1, 7168), jnp.bfloat16, 2, "gpu").algorithm == "xla"
    assert api.plan_all_reduce((16, 7168), jnp.bfloat16, 2, "gpu").algorithm == "xla"
    assert api.plan_all_reduce((32, 7168), jnp.bfloat16, 2, "gpu") == api.Plan("one_shot", 64)
    assert api.plan_all_reduce((8, 7168), jnp.bfloat16, 4, "gpu") == api.Plan("one_shot_st", 64)
    for b in (1, 8, 64):
        for d in (7168, 3584):
            assert api.plan_all_reduce((b, d), jnp.bfloat16, 4, "gpu").algorithm != "xla"
            plan = api.plan_add_rmsnorm((b, d), jnp.bfloat16, (b, d), jnp.bfloat16, (d,), 2, "gpu")
            assert plan.algorithm == "one_shot_add_rmsnorm" and plan.block_rows == d // 128


# --------------------------------------------------------------------------------- CPU: XLA fallback
@pytest.mark.parametrize("backend", ["xla", "latency_specialized"])
@pytest.mark.parametrize("n", [2, 4])
def test_fallback_all_reduce_matches_sum(rng, backend, n):
    mesh = _mesh(n)
    x = rng.standard_normal((n, 3, 7168)).astype(BF16)
    f = _sharded(mesh, lambda v: api.all_reduce(v, "tp", policy=DecodePolicy(backend)), 1, 1)
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
    f = _sharded(
        mesh, lambda v, r, g: api.all_reduce_add_rmsnorm(v, r, g, 1e-5, "tp", policy=DecodePolicy(backend)), 3, 2
    )
    new, normed = (np.asarray(a) for a in f(x, np.ascontiguousarray(res), np.ascontiguousarray(w)))
    ref_new, ref_normed = _np_add_rmsnorm(x, res[0], w[0], 1e-5)
    for r in range(n):
        _assert_fused_close(new[r], normed[r], ref_new, ref_normed)


# ------------------------------------------------- layer boundary: all-reduce + prefix + AttnRes + RMSNorm
def _np_mix_norm(x_nBD, prefix_BD, blocks_NBD, res_norm_w, res_proj_w, w_D, eps):
    """docs/model.md §2.1-2.3 in float64 with its bf16 roundings: the all-reduced a, P' = P + a, the AttnRes
    softmax over depth of RMS-scaled scores against q = norm * proj, mixing the RAW sources, then RMSNorm."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    rnd = lambda a: a.astype(BF16).astype(np.float64)  # noqa: E731
    a = rnd(f64(x_nBD).sum(0))
    new = a if prefix_BD is None else rnd(f64(prefix_BD) + a)
    h = new
    if blocks_NBD is not None:
        v = np.concatenate([f64(blocks_NBD), new[None]])
        score = (v @ (f64(res_norm_w) * f64(res_proj_w))) / np.sqrt(np.mean(v * v, axis=-1) + eps)
        alpha = np.exp(score - score.max(0))
        alpha /= alpha.sum(0)
        h = rnd(np.einsum("nb,nbd->bd", alpha, v))
    n = rnd(h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps))
    return new.astype(BF16), rnd(n * f64(w_D)).astype(BF16)


def _mix_inputs(rng, n, b, d, n_blocks, prefix):
    """Per-rank partials plus replicated prefix / blocks / weights, at the scale of a trained residual stream."""
    s = 10.0 ** rng.uniform(-1, 1)
    x = (rng.standard_normal((n, b, d)) * s).astype(BF16)
    p = (rng.standard_normal((b, d)) * s * 4).astype(BF16) if prefix else None
    blocks = (rng.standard_normal((n_blocks, b, d)) * s * rng.uniform(0.5, 8, (n_blocks, 1, 1))).astype(BF16)
    # res_proj at 2/sqrt(d): depth scores of O(1), so the softmax mixes several sources instead of picking one
    # (a saturated softmax would hide a wrong score scale).
    res_norm, norm = ((1 + 0.3 * rng.standard_normal(d)).astype(BF16) for _ in range(2))
    res_proj = (rng.standard_normal(d) * 2 / np.sqrt(d)).astype(BF16)
    return x, p, blocks if n_blocks else None, (res_norm, res_proj, norm)


def _mix_call(mesh, x, p, blocks, weights, backend):
    """jit(shard_map) of api.all_reduce_mix_norm over per-rank partials x and replicated prefix / blocks /
    weights (None prefix or blocks are left out), and its operands."""
    n = mesh.size
    rep = lambda a: np.ascontiguousarray(np.broadcast_to(a, (n, *a.shape)))  # noqa: E731
    operands = [x] + [rep(a) for a in (p, blocks) if a is not None] + [rep(w) for w in weights]

    def per_rank(v, *rest):
        rest = list(rest)
        pv = rest.pop(0) if p is not None else None
        bv = tuple(rest.pop(0)) if blocks is not None else None  # [N, ...] -> N blocks, as the model holds them
        return api.all_reduce_mix_norm(v, pv, bv, *rest, 1e-5, "tp", policy=DecodePolicy(backend))

    return _sharded(mesh, per_rank, len(operands), 2), operands


def _assert_mix_close(new, normed, ref_new, ref_normed):
    """new is one rounding of an FP32 sum (<= 1 ulp off the FP64 one). normed is three roundings further, and
    the AttnRes mix sum_i alpha_i v_i can cancel: where it does, FP32 accumulation error is small against the
    row but many ulps of that element (17 seen with the XLA reference). So normed may be off by 3 ulps plus
    2^-16 of its row's RMS (the XLA reference's worst excess over 400 draws: 2^-22)."""
    assert _ulps(new, ref_new).max() <= 1
    ref = np.asarray(ref_normed, np.float64)
    excess = _ulps(normed, ref) - 3  # in ulps of each element
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)
    rms = np.sqrt(np.mean(ref * ref, axis=-1, keepdims=True))
    assert np.all(excess * ulp <= 2.0**-16 * rms), (excess.max(), (excess * ulp / rms).max())


def test_plan_mix_norm():
    ok = dict(x_dtype=jnp.bfloat16, n=2, platform="gpu")
    for b, d, p, nb in [(1, 7168, True, 8), (64, 7168, False, 1), (8, 3584, False, 0)]:
        plan = api.plan_mix_norm((b, d), prefix_shape=(b, d) if p else None, block_shapes=[(b, d)] * nb, **ok)
        assert plan.algorithm == "mix_norm" and plan.block_rows == d // 128
    for kw in [
        dict(platform="cpu"),
        dict(n=1, tuning=_single_device_tuning(False).get("collectives")),
        dict(x_dtype=jnp.int32),
        dict(prefix_shape=(2, 7168)),
        dict(block_shapes=[(1, 7168), (2, 7168)]),
        dict(x_shape=(1, 7000)),
        dict(x_shape=(1, 16384)),
        dict(x_dtype=jnp.float32, block_shapes=[(1, 7168)] * 8),
    ]:  # 8 fp32 blocks overflow SMEM
        args = dict(ok, x_shape=(1, 7168), prefix_shape=(1, 7168), block_shapes=[(1, 7168)] * 3) | kw
        assert api.plan_mix_norm(**args).algorithm == "xla", kw


def test_pick_attnres_reads_rules_by_blocks():
    """The tuning's mix_norm_attnres: one form for every block count, or rules whose first covering N picks it;
    batched only where the tile has its group of 4; an unknown form is refused, naming the choices."""
    from pallas_kernels.collectives import mix_norm

    rules = [{"max_blocks": 4, "form": "two_pass"}, {"form": "batched"}]
    assert [mix_norm.pick_attnres(n, rules, 4) for n in (1, 4, 5, 8)] == ["two_pass"] * 2 + ["batched"] * 2
    assert mix_norm.pick_attnres(8, rules, 1) == "online"
    assert [mix_norm.pick_attnres(n, None, 4) for n in (1, 2)] == ["two_pass", "online"]
    assert mix_norm.pick_attnres(3, [{"max_blocks": 2, "form": "batched"}], 4) == "online"  # no rule: the default
    with pytest.raises(ValueError, match="two_pass"):
        mix_norm.pick_attnres(2, "fast", 4)


def _single_device_tuning(on):
    """The collectives tuning with mix_norm_single_device set (the boundary kernel at n == 1, no exchange)."""
    return Tuning.from_files(collectives=dict(XLA.table("collectives"), mix_norm_single_device=on))


def test_plan_mix_norm_one_device_follows_the_tuning():
    """n == 1 (TP1, the rank slice's stub): refused, saying why, where the tuning turns it off; where on, the
    same checks as with an exchange; without a tuning, tuning.json's entry decides."""
    args = dict(x_shape=(1, 7168), x_dtype=jnp.bfloat16, prefix_shape=(1, 7168), block_shapes=[(1, 7168)] * 8)
    off = api.plan_mix_norm(**args, n=1, platform="gpu", tuning=_single_device_tuning(False).get("collectives"))
    assert off.algorithm == "xla" and "mix_norm_single_device" in off.reason
    on = _single_device_tuning(True).get("collectives")
    plan = api.plan_mix_norm(**args, n=1, platform="gpu", tuning=on)
    default = plan if XLA.table("collectives")["mix_norm_single_device"] else off
    assert api.plan_mix_norm(**args, n=1, platform="gpu") == default
    assert plan == api.plan_mix_norm(**args, n=2, platform="gpu") and plan.algorithm == "mix_norm"
    for kw in [dict(platform="cpu"), dict(x_shape=(1, 7000)), dict(x_dtype=jnp.float32)]:  # fp32: 8 blocks
        assert api.plan_mix_norm(**(args | dict(n=1, platform="gpu") | kw), tuning=on).algorithm == "xla", kw


@pytest.mark.parametrize("prefix, n_blocks", [(True, 3), (False, 2), (False, 0)])
@pytest.mark.parametrize("backend", ["xla", "latency_specialized"])
def test_fallback_mix_norm_matches_numpy(rng, backend, prefix, n_blocks):
    """The XLA path (the fallback and the GPU tests' reference) against the float64 oracle, on 2 CPU ranks."""
    n, b, d = 2, 3, 1024
    x, p, blocks, (rn, rp, w) = _mix_inputs(rng, n, b, d, n_blocks, prefix)
    f, operands = _mix_call(_mesh(n), x, p, blocks, (rn, rp, w), backend)
    new, normed = (np.asarray(a) for a in f(*operands))
    ref_new, ref_normed = _np_mix_norm(x, p, blocks, rn, rp, w, 1e-5)
    for r in range(n):
        _assert_mix_close(new[r], normed[r], ref_new, ref_normed)


@pytest.mark.skipif(N_GPUS > 0, reason="interpret-mode test, CPU only")
@pytest.mark.parametrize(
    "prefix, n_blocks, attnres, q",
    [
        (True, 3, "online", 3),
        (True, 3, "two_pass", 2),
        (False, 1, "online", 4),
        (False, 0, "online", 3),
        (True, 3, "batched", 8),
        (False, 1, "batched", 4),
        (True, 8, "batched", 4),
        (False, 2, "batched", 3),  # 3 lane rows: no group of 4, the online form runs
    ],
)
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_mix_norm_kernel_interpret_one_rank(rng, prefix, n_blocks, attnres, q, arch):
    """The kernel's epilogue maths in interpret mode (one rank: no exchange, which interpret mode cannot run),
    AttnRes in one pass (online softmax), in two, and with the scores' sums batched (the sources from SMEM)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from kernel_testbase import abstract_gpu

    from pallas_kernels.collectives import mix_norm

    b = int(rng.integers(1, 4))
    x, p, blocks, (rn, rp, w) = _mix_inputs(rng, 1, b, q * 128, n_blocks, prefix)
    t = mix_norm.tile_shape(q * 128)
    assert t == ((q // 4, 4, 128) if q % 4 == 0 else (q, 1, 128))
    tile = lambda a: None if a is None else jnp.asarray(a).reshape(*a.shape[:-1], *t)  # noqa: E731
    with abstract_gpu(arch):
        new, normed = mix_norm.mix_norm(
            tile(x[0]),
            tile(p),
            [] if blocks is None else [tile(b) for b in blocks],
            (tile(rn), tile(rp)),
            tile(w),
            1e-5,
            axis_name="tp",
            n=1,
            interpret=plgpu.InterpretGPUParams(detect_races=True),
            attnres=attnres,
        )
    assert not get_races().races_found
    ref_new, ref_normed = _np_mix_norm(x, p, blocks, rn, rp, w, 1e-5)
    _assert_mix_close(np.asarray(new).reshape(b, -1), np.asarray(normed).reshape(b, -1), ref_new, ref_normed)


@pytest.mark.skipif(N_GPUS > 0, reason="interpret-mode test, CPU only")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("prefix, n_blocks", [(True, 3), (False, 1), (False, 0)])
def test_mix_norm_api_one_device_interpret(monkeypatch, rng, dtype, prefix, n_blocks):
    """api.all_reduce_mix_norm without an axis (axis_name None): with mix_norm_single_device on it plans as on a
    GPU and runs the kernel at n == 1 (interpret mode, an abstract sm90), equal to reference.mix_norm of the
    partial; with it off the refusal gives exactly reference.mix_norm."""
    import functools

    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from kernel_testbase import abstract_gpu

    from pallas_kernels.collectives import mix_norm, reference

    monkeypatch.setattr(api, "current_platform", lambda: "gpu")
    interpret = plgpu.InterpretGPUParams(detect_races=True)
    monkeypatch.setattr(mix_norm, "mix_norm", functools.partial(mix_norm.mix_norm, interpret=interpret))
    b, d = int(rng.integers(1, 4)), 128 * int(rng.integers(2, 5))
    x, p, blocks, weights = _mix_inputs(rng, 1, b, d, n_blocks, prefix)
    cast = lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float32), dtype)  # noqa: E731
    x, p, weights = cast(x[0]), cast(p), [cast(w) for w in weights]
    blocks = None if blocks is None else [cast(v) for v in blocks]
    ref_new, ref_normed = reference.mix_norm(x, p, blocks, *weights, 1e-5)
    for on in (False, True):
        policy = DecodePolicy("latency_specialized", tuning=_single_device_tuning(on))
        log = DispatchLog()
        with recording(log), abstract_gpu("sm90"):
            new, normed = api.all_reduce_mix_norm(x, p, blocks, *weights, 1e-5, None, policy=policy)
        assert log.ops["all_reduce_mix_norm"]["impl"] == ("pallas" if on else "xla"), log.ops
        assert new.dtype == normed.dtype == dtype
        np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(ref_new, np.float32))  # one rounding
        if not on:
            assert "mix_norm_single_device" in log.ops["all_reduce_mix_norm"]["reason"]
            np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(ref_normed, np.float32))
        elif dtype == jnp.float32:  # other fp32 orders (online softmax, the tile's sums): 2^-18 of the row's
            ref = np.asarray(ref_normed, np.float64)  # RMS at worst over 300 draws, a few ulps of its largest
            rms = np.sqrt(np.mean(ref * ref, axis=-1, keepdims=True))
            assert np.all(np.abs(np.asarray(normed, np.float64) - ref) <= 2.0**-16 * rms)
        else:  # other fp32 summation orders before three bf16 roundings: the n == 1 kernel tests' bound
            _assert_mix_close(new, normed, ref_new, ref_normed)
    assert not get_races().races_found


def _lower_for_cuda(monkeypatch, n, per_rank, shapes, dtype):
    """StableHLO text of jit(shard_map(per_rank)) over per-rank operands [n, *shape] on an abstract n x H100
    mesh, lowered for CUDA (not run; the api plans as on a GPU). per_rank gets [1, ...] slices."""
    from kernel_testbase import DEVICE_KINDS

    monkeypatch.setattr(api, "current_platform", lambda: "gpu")
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS["sm90"], platform="gpu", num_cores=8)
    mesh = jax.sharding.AbstractMesh(
        (n,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    spec = jax.sharding.NamedSharding(mesh, P("tp"))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=spec) for s in shapes]
    f = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(P("tp"),) * len(args), out_specs=(P("tp"),) * 2, check_vma=False)
    )
    with jax.sharding.use_abstract_mesh(mesh):
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(N_GPUS > 0, reason="lowering test on CPU")
@pytest.mark.parametrize(
    "n, b, prefix, n_blocks, dtype, attnres",
    [
        (2, 1, True, 8, jnp.bfloat16, None),
        (2, 64, False, 1, jnp.bfloat16, None),
        (4, 8, False, 0, jnp.bfloat16, None),
        (2, 3, True, 2, jnp.float32, None),
        (2, 1, True, 8, jnp.bfloat16, "batched"),
        (2, 64, False, 1, jnp.bfloat16, "batched"),
        (2, 3, True, 2, jnp.float32, "batched"),
    ],
)
def test_mix_norm_lowers_for_cuda_in_shard_map(monkeypatch, n, b, prefix, n_blocks, dtype, attnres):
    """api -> the exchange kernel inside shard_map, lowered for CUDA; float32 is what the TP2 float32 GPU model
    test runs; attnres: the collectives tuning's mix_norm_attnres (None: tuning.json's)."""
    d = 7168 if dtype == jnp.bfloat16 else 512
    policy = SPECIALIZED
    if attnres:
        table = dict(XLA.table("collectives"), mix_norm_attnres=attnres)
        policy = SPECIALIZED.replace(tuning=Tuning.from_files(collectives=table))

    def per_rank(v, *rest):
        rest = [a[0] for a in rest]
        pv = rest.pop(0) if prefix else None
        bv = [rest.pop(0) for _ in range(n_blocks)]
        new, normed = api.all_reduce_mix_norm(v[0], pv, bv, *rest, 1e-5, "tp", policy=policy)
        return new[None], normed[None]

    # x, prefix, each block, weights
    text = _lower_for_cuda(monkeypatch, n, per_rank, [(n, b, d)] * (1 + prefix + n_blocks) + [(n, d)] * 3, dtype)
    assert "mosaic_gpu" in text and "stablehlo.all_reduce" not in text
    assert "stablehlo.concatenate" not in text  # the blocks go in as they are: no stacked copy per boundary
    # what a trace calls the launch: a layer boundary (with AttnRes) apart from the latent norm (without)
    from pallas_kernels.collectives import mix_norm

    name, other = (mix_norm.BOUNDARY_KERNEL, mix_norm.NORM_KERNEL)[:: 1 if n_blocks else -1]
    assert f"{name}_mosaic_gpu" in text and other not in text


@pytest.mark.skipif(N_GPUS > 0, reason="lowering test on CPU")
@pytest.mark.parametrize("backend, n_blocks", [("latency_specialized", 3), ("latency_specialized", 0), ("xla", 3)])
def test_model_boundary_is_one_kernel(monkeypatch, backend, n_blocks):
    """The model's layer boundary (k3jax.layers.boundary.join, the stored blocks as the trunk's list) under a
    sharded Comm: with latency_specialized one Mosaic GPU launch and nothing else collective, no stacked copy
    of the blocks; with xla the NCCL all-reduce and no Mosaic kernel."""
    from k3jax.comm import Comm
    from k3jax.layers import boundary

    b, d = 2, 7168

    def per_rank(part, prefix, *rest):
        rest = [a[0] for a in rest]
        blocks, (rn, rp, w) = rest[:n_blocks], rest[n_blocks:]
        comm = Comm("tp", DecodePolicy(backend))
        new, normed = boundary.join(comm, part[0], w, 1e-5, "attn_out", prefix[0], blocks, {"norm": rn, "proj": rp})
        assert comm.counts == {"attn_out": 1}
        return new[None], normed[None]

    text = _lower_for_cuda(monkeypatch, 2, per_rank, [(2, b, d)] * (2 + n_blocks) + [(2, d)] * 3, jnp.bfloat16)
    mosaic_calls = text.count("@mosaic_gpu")
    if backend == "latency_specialized":
        assert mosaic_calls == 1 and "stablehlo.all_reduce" not in text and "stablehlo.concatenate" not in text
    else:
        assert mosaic_calls == 0 and "stablehlo.all_reduce" in text


@pytest.mark.skipif(N_GPUS > 0, reason="lowering test on CPU")
@pytest.mark.parametrize("on", [True, False])
def test_unsharded_boundary_is_one_kernel_when_tuned_on(monkeypatch, on):
    """The model's layer boundary without a tensor-parallel axis (Comm(None), latency_specialized), lowered for
    CUDA on an abstract H100: with mix_norm_single_device one Mosaic GPU launch (the kernel at n == 1: no
    exchange), else the XLA ops; no collective either way, and none counted."""
    from kernel_testbase import abstract_gpu

    from k3jax.comm import Comm
    from k3jax.layers import boundary

    monkeypatch.setattr(api, "current_platform", lambda: "gpu")
    b, d, n_blocks = 2, 7168, 3
    comm = Comm(None, DecodePolicy("latency_specialized", tuning=_single_device_tuning(on)))
    assert comm.fuses_boundaries

    def f(part, prefix, *rest):
        blocks, (rn, rp, w) = rest[:n_blocks], rest[n_blocks:]
        return boundary.join(comm, part, w, 1e-5, "attn_out", prefix, list(blocks), {"norm": rn, "proj": rp})

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(b, d)] * (2 + n_blocks) + [(d,)] * 3]
    with abstract_gpu("sm90"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu") == (1 if on else 0)
    assert "stablehlo.all_reduce" not in text and not comm.counts
    if on:
        assert "stablehlo.concatenate" not in text  # the blocks go in as they are


# --------------------------------------------------------------------------------- GPU: the kernels
@gpu2
@pytest.mark.gpu2
@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_st"])
@pytest.mark.parametrize("shape", [(1, 7168), (8, 7168), (64, 7168), (1, 3584), (64, 3584), (3, 1280)])
def test_pallas_all_reduce_real_shapes(rng, algorithm, shape):
    mesh = _mesh(2)
    x = rng.standard_normal((2, *shape)).astype(BF16)
    f = _sharded(mesh, lambda v: api.all_reduce(v, "tp", policy=SPECIALIZED, algorithm=algorithm), 1, 1)
    _assert_sum_close(np.asarray(f(x)), x, jnp.bfloat16)


@gpu2
@pytest.mark.gpu2
def test_pallas_all_reduce_random_sizes(rng):
    mesh = _mesh(2)
    for _ in range(4):
        shape = (int(rng.integers(1, 65)), 128 * int(rng.integers(1, 64)))
        x = (rng.standard_normal((2, *shape)) * 10.0 ** rng.uniform(-3, 3)).astype(BF16)
        # a random kernel: the size-based choice sends most decode sizes to psum at 2 ranks
        alg = str(rng.choice(["one_shot", "one_shot_st"]))
        f = _sharded(mesh, lambda v, alg=alg: api.all_reduce(v, "tp", policy=SPECIALIZED, algorithm=alg), 1, 1)
        _assert_sum_close(np.asarray(f(x)), x, jnp.bfloat16)


@gpu2
@pytest.mark.gpu2
@pytest.mark.parametrize("shape", [(1, 7168), (64, 7168), (8, 3584)])
def test_pallas_add_rmsnorm(rng, shape):
    mesh = _mesh(2)
    b, d = shape
    x = rng.standard_normal((2, b, d)).astype(BF16)
    res = np.ascontiguousarray(np.broadcast_to(rng.standard_normal((b, d)).astype(BF16), (2, b, d)))
    w = np.ascontiguousarray(np.broadcast_to((1 + 0.1 * rng.standard_normal(d)).astype(BF16), (2, d)))
    f = _sharded(mesh, lambda v, r, g: api.all_reduce_add_rmsnorm(v, r, g, 1e-5, "tp", policy=SPECIALIZED), 3, 2)
    new, normed = (np.asarray(a) for a in f(x, res, w))
    ref_new, ref_normed = _np_add_rmsnorm(x, res[0], w[0], 1e-5)
    _assert_fused_close(new[0], normed[0], ref_new, ref_normed)
    _assert_ranks_identical(new, normed)


@gpu2
@pytest.mark.gpu2
def test_pallas_back_to_back_stress(rng):
    """500 loop steps, each the three all-reduce kernels back to back on fresh data, all checked. No NCCL call
    or host sync sits between the Pallas calls, so a rank that read a stale signal or a peer's previous buffer
    would produce a wrong sum."""
    mesh, steps, d = _mesh(2), 500, 7168
    xa = rng.standard_normal((2, steps, 1, d)).astype(BF16)  # TMA one-shot
    xs = rng.standard_normal((2, steps, 8, d)).astype(BF16)  # plain-store one-shot
    xc = rng.standard_normal((2, steps, 1, d)).astype(BF16)  # fused add + RMSNorm
    res = np.ascontiguousarray(np.broadcast_to(rng.standard_normal((steps, 1, d)).astype(BF16), (2, steps, 1, d)))
    w = np.ascontiguousarray(np.broadcast_to((1 + 0.1 * rng.standard_normal(d)).astype(BF16), (2, d)))
    ls = "latency_specialized"

    def loop(xa, xs, xc, res, w):
        def body(i, out):
            a = api.all_reduce(xa[i], "tp", backend=ls, algorithm="one_shot")
            s = api.all_reduce(xs[i], "tp", backend=ls, algorithm="one_shot_st")
            new, normed = api.all_reduce_add_rmsnorm(xc[i], res[i], w, 1e-5, "tp", backend=ls)
            return tuple(o.at[i].set(v) for o, v in zip(out, (a, s, new, normed), strict=True))

        init = (jnp.zeros_like(xa), jnp.zeros_like(xs), jnp.zeros_like(xc), jnp.zeros_like(xc))
        return jax.lax.fori_loop(0, steps, body, init)

    ya, ys, new, normed = (np.asarray(a) for a in _sharded(mesh, loop, 5, 4)(xa, xs, xc, res, w))
    for i in range(steps):
        _assert_sum_close(ya[:, i], xa[:, i], jnp.bfloat16)
        _assert_sum_close(ys[:, i], xs[:, i], jnp.bfloat16)
        _assert_fused_close(new[0, i], normed[0, i], *_np_add_rmsnorm(xc[:, i], res[0, i], w[0], 1e-5))
    _assert_ranks_identical(new, normed)


@pytest.mark.gpu
@pytest.mark.skipif(N_GPUS < 1, reason="needs a GPU")
@pytest.mark.parametrize("attnres", ["two_pass", "online", "batched"])
@pytest.mark.parametrize("b, prefix, n_blocks", [(1, True, 8), (64, True, 4), (8, False, 1)])
def test_mix_norm_one_device_on_gpu(rng, attnres, b, prefix, n_blocks):
    """The boundary kernel without its exchange (one device: TP1 and the rank slice's stub) at K3's hidden width,
    each AttnRes form (the collectives tuning's mix_norm_attnres), against the float64 oracle."""
    x, p, blocks, (rn, rp, w) = _mix_inputs(rng, 1, b, 7168, n_blocks, prefix)
    table = dict(XLA.table("collectives"), mix_norm_single_device=True, mix_norm_attnres=attnres)
    policy = SPECIALIZED.replace(tuning=Tuning.from_files(collectives=table))
    log = DispatchLog()
    with recording(log):
        new, normed = jax.jit(
            lambda *a: api.all_reduce_mix_norm(a[0], a[1], tuple(a[2]), *a[3:], 1e-5, None, policy=policy)
        )(x[0], p, blocks, rn, rp, w)
    assert log.ops["all_reduce_mix_norm"]["impl"] == "pallas", log.ops
    ref_new, ref_normed = _np_mix_norm(x, p, blocks, rn, rp, w, 1e-5)
    _assert_mix_close(np.asarray(new), np.asarray(normed), ref_new, ref_normed)


@gpu2
@pytest.mark.gpu2
@pytest.mark.parametrize(
    "b, d, prefix, n_blocks",
    [(1, 7168, True, 8), (64, 7168, True, 3), (8, 7168, False, 1), (1, 3584, False, 0), (64, 3584, False, 0)],
)
def test_pallas_mix_norm(rng, b, d, prefix, n_blocks):
    """The layer-boundary kernel at K3 shapes (hidden with AttnRes; latent + routed_expert_norm) against the
    float64 oracle, ranks bit-identical, and the api really ran the kernel (no psum left)."""
    x, p, blocks, (rn, rp, w) = _mix_inputs(rng, 2, b, d, n_blocks, prefix)
    f, operands = _mix_call(_mesh(2), x, p, blocks, (rn, rp, w), "latency_specialized")
    text = f.lower(*operands).as_text()
    assert "mosaic_gpu" in text and "stablehlo.all_reduce" not in text
    new, normed = (np.asarray(a) for a in f(*operands))
    ref_new, ref_normed = _np_mix_norm(x, p, blocks, rn, rp, w, 1e-5)
    _assert_mix_close(new[0], normed[0], ref_new, ref_normed)
    _assert_ranks_identical(new, normed)


@gpu2
@pytest.mark.gpu2
def test_pallas_mix_norm_back_to_back(rng):
    """300 loop steps, each a layer-boundary call and a latent call back to back on fresh data, all checked."""
    mesh, steps, b, d = _mesh(2), 300, 2, 7168
    x, p, blocks, (rn, rp, w) = _mix_inputs(rng, 2, steps * b, d, 3, True)
    xl = rng.standard_normal((2, steps, b, 3584)).astype(BF16)
    wl = (1 + 0.3 * rng.standard_normal(3584)).astype(BF16)
    stepped = lambda a: np.ascontiguousarray(a.reshape(*a.shape[:-2], steps, b, d))  # noqa: E731
    x, p, blocks = stepped(x), stepped(p), np.ascontiguousarray(np.moveaxis(stepped(blocks), -3, 0))
    rep = lambda a: np.ascontiguousarray(np.broadcast_to(a, (2, *a.shape)))  # noqa: E731

    def loop(x, p, blocks, rn, rp, w, xl, wl):
        def body(i, out):
            new, normed = api.all_reduce_mix_norm(
                x[i], p[i], tuple(blocks[i]), rn, rp, w, 1e-5, "tp", policy=SPECIALIZED
            )
            lat = api.all_reduce_mix_norm(xl[i], None, None, wl, wl, wl, 1e-5, "tp", policy=SPECIALIZED)
            return tuple(o.at[i].set(v) for o, v in zip(out, (new, normed, *lat), strict=True))

        init = (jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros_like(xl), jnp.zeros_like(xl))
        return jax.lax.fori_loop(0, steps, body, init)

    f = _sharded(mesh, loop, 8, 4)
    outs = [np.asarray(a) for a in f(x, rep(p), rep(blocks), rep(rn), rep(rp), rep(w), xl, rep(wl))]
    new, normed, lat_sum, lat_normed = outs
    for i in range(steps):
        _assert_mix_close(new[0, i], normed[0, i], *_np_mix_norm(x[:, i], p[i], blocks[i], rn, rp, w, 1e-5))
        _assert_mix_close(lat_sum[0, i], lat_normed[0, i], *_np_mix_norm(xl[:, i], None, None, wl, wl, wl, 1e-5))
    _assert_ranks_identical(*outs)
