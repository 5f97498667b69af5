"""KDA decode step: reference vs float64 NumPy from docs/model.md §4.2-4.6, verify/commit vs sequential decode,
kernel bodies (interpret mode on CPU, real shapes on the GPU) vs the reference."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_testbase import ON_GPU, abstract_gpu, assert_close, cpu_only, gpu_only, rng

from pallas_kernels.kda_decode import api, reference
from pallas_kernels.policy import SPECIALIZED, DecodePolicy

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# bf16: one bf16 rounding of q/k/v/o may land on the other side in float64 -> allow a few bf16 ulps.
TOL = {"bf16": dict(atol=3e-2, rtol=3e-2), "f32": dict(atol=2e-4, rtol=2e-4)}


def make_inputs(r, B, H, K, dtype, T=None):
    """Fresh random layer inputs; T adds a token axis after B (verify)."""
    tok = (B,) if T is None else (B, T)

    def act(*shape, scale=1.0):
        return jnp.asarray(r.standard_normal(shape) * scale, jnp.float32).astype(dtype)

    return dict(
        qkv=act(*tok, 3, H, K),
        f=act(*tok, H, K),
        beta=act(*tok, H),
        gate=act(*tok, H, K),
        state=jnp.asarray(r.standard_normal((B, H, K, K)) * 0.3, jnp.float32),
        conv=act(B, 3, 3, H, K),
        conv_w=jnp.asarray(r.standard_normal((3, H, K, 4)) * 0.5, jnp.float32),
        A_log=jnp.asarray(r.uniform(-1.0, 1.5, H), jnp.float32),
        dt_bias=jnp.asarray(r.standard_normal((H, K)), jnp.float32),
        o_norm_w=jnp.asarray(1.0 + 0.2 * r.standard_normal(K), jnp.float32),
    )


def args_of(x):
    return (
        x["qkv"],
        x["f"],
        x["beta"],
        x["gate"],
        x["state"],
        x["conv"],
        x["conv_w"],
        x["A_log"],
        x["dt_bias"],
        x["o_norm_w"],
    )


def numpy_decode(x, eps=1e-5):
    """docs/model.md §4.2-4.6 in float64, with its roundings to the compute dtype."""
    dt = np.dtype(ml_dtypes.bfloat16) if x["qkv"].dtype == jnp.bfloat16 else np.dtype(np.float32)
    rnd = lambda a: a.astype(dt).astype(np.float64)  # noqa: E731
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
    qkv, conv, w = f64(x["qkv"]), f64(x["conv"]), f64(x["conv_w"])
    B, _, H, K = qkv.shape
    win = np.concatenate([conv, qkv[:, :, None]], axis=2)  # [B,3,4,H,K]
    y = np.einsum("bijhk,ihkj->bihk", win, w)
    q, k, v = (rnd(y * sig(y))[:, i] for i in range(3))
    g = -5.0 * sig(np.exp(f64(x["A_log"]))[:, None] * (f64(x["f"]) + f64(x["dt_bias"])))
    beta = sig(f64(x["beta"]))
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * K**-0.5
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    S = np.exp(g)[..., None] * f64(x["state"])
    delta = v - np.einsum("bhkv,bhk->bhv", S, kn)
    S = S + beta[..., None, None] * np.einsum("bhk,bhv->bhkv", kn, delta)
    o = rnd(np.einsum("bhkv,bhk->bhv", S, qn))
    n = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * f64(x["o_norm_w"])
    return rnd(n * sig(f64(x["gate"]))), S, win[:, :, 1:]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("B,H,K", [(2, 3, 16), (1, 2, 64)])
def test_reference_matches_numpy(dtype, B, H, K):
    x = make_inputs(rng(), B, H, K, DTYPES[dtype])
    y, S, conv = jax.jit(reference.kda_decode)(*args_of(x))
    y64, S64, conv64 = numpy_decode(x)
    assert y.dtype == DTYPES[dtype] and S.dtype == jnp.float32 and conv.dtype == DTYPES[dtype]
    assert_close(y, y64, **TOL[dtype], what="y")
    assert_close(S, S64, **TOL[dtype], what="state")
    assert_close(conv, conv64, atol=0, rtol=0, what="conv window")


def test_api_falls_back_once_and_rejects_unknown_backend(caplog):
    x = make_inputs(rng(), 1, 2, 16, jnp.float32)
    want = reference.kda_decode(*args_of(x))
    with caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        for _ in range(2):
            got = api.kda_decode(*args_of(x), policy=SPECIALIZED)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, atol=0, rtol=0)
    if not ON_GPU:  # K=16 is refused by the kernel too, so a GPU logs a (different) reason once as well
        assert sum("kda_decode" in r.message for r in caplog.records) <= 1
    with pytest.raises(ValueError):
        api.kda_decode(*args_of(x), policy=DecodePolicy("cuda"))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_commit_of_verify_equals_sequential_decode(dtype):
    r = rng()
    B, T, H, K = 4, 5, 2, 16
    x = make_inputs(r, B, H, K, DTYPES[dtype], T=T)
    y_BT, commit = jax.jit(reference.kda_verify)(*args_of(x))
    step = jax.jit(reference.kda_decode)
    states, convs = [x["state"]], [x["conv"]]
    # y is rounded twice to the compute dtype (o, then the gated norm): in bf16 an fp32 difference of fusion
    # order can flip both roundings, 2 ulps (seen once in CI-like runs). In f32 the two forms sum in different
    # orders over T steps of the state: 2.8e-6 relative seen once (seed 111589295); the project's 1e-5 bar.
    y_tol = dict(atol=1e-6, rtol=2.0**-6) if dtype == "bf16" else dict(atol=1e-6, rtol=1e-5)
    for t in range(T):
        y, s, c = step(
            x["qkv"][:, t],
            x["f"][:, t],
            x["beta"][:, t],
            x["gate"][:, t],
            states[-1],
            convs[-1],
            x["conv_w"],
            x["A_log"],
            x["dt_bias"],
            x["o_norm_w"],
        )
        assert_close(y_BT[:, t], y, **y_tol, what=f"y[{t}]")
        states.append(s)
        convs.append(c)
    for accepted in (np.arange(B) % (T + 1), np.full(B, T), r.integers(0, T + 1, B)):
        s, c = jax.jit(reference.kda_commit)(x["state"], x["conv"], commit, jnp.asarray(accepted))
        for b, a in enumerate(accepted):
            assert_close(s[b], states[a][b], atol=1e-6, rtol=1e-6, what=f"state b={b} accepted={a}")
            assert_close(c[b], convs[a][b], atol=0, rtol=0, what=f"conv b={b} accepted={a}")


# ---- kernel bodies ----------------------------------------------------------------------------------------


def _body(arch):
    from pallas_kernels.kda_decode import sm90, sm100

    return {"sm90": sm90, "sm100": sm100}[arch]


def _variant(arch, tma, v_split=1, gates=False, gather="gmem", warpgroups=1, **launch):
    """A body's kernel with its tuned tile layout and a given staging of the state (direct ld/st.global, one
    TMA per column slice, or per slice of 32 rows with a thread per column), one CTA or a cluster of v_split
    CTAs per tile, with one or several warpgroups."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import kernel

    layout = getattr(plgpu.Layout, _body(arch).TUNING["layout"])
    return functools.partial(
        kernel.decode_gates if gates else kernel.decode,
        eps=1e-5,
        tile_layout=layout,
        v_chunk=32,
        tma=tma,
        v_split=v_split,
        gather=gather,
        warpgroups=warpgroups,
        **launch,
    )


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("tma", [False, "chunked", "rows"])
@pytest.mark.parametrize("in_place", [False, True])
def test_kernel_interpret_matches_reference(arch, dtype, tma, in_place):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    x = make_inputs(rng(), 2, 2, 128, DTYPES[dtype])
    want = reference.kda_decode(*args_of(x))
    with abstract_gpu(arch):
        got = _variant(arch, tma, in_place=in_place)(*args_of(x), interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, **TOL[dtype], what=name)


# (tma, split, dtype): a cluster of v_split CTAs per tile with every staging, or the warpgroups of one CTA
# (which take per-slice or no TMA); one or two 32-column chunks each
SPLITS = (
    [(tma, dict(v_split=4), "f32") for tma in (False, "chunked")]
    + [(tma, dict(v_split=2), "bf16") for tma in (False, "chunked")]
    + [(tma, dict(warpgroups=n), dt) for tma in (False, "chunked") for n, dt in ((4, "f32"), (2, "bf16"))]
)


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("tma, split, dtype", SPLITS + [(t, dict(s, in_place=True), d) for t, s, d in SPLITS[::2]])
def test_split_interpret_matches_reference(arch, tma, split, dtype):
    """V split over a cluster (o gathered through GMEM behind a cluster barrier for the gated norm) or over the
    warpgroups of one CTA (each with its own O(K) vectors, o meeting in WG 0's SMEM behind a CTA barrier) vs
    the reference; B = 3 so the splits of different (b, h) run side by side."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    x = make_inputs(rng(), 3, 1, 128, DTYPES[dtype])
    want = reference.kda_decode(*args_of(x))
    with abstract_gpu(arch):
        got = _variant(arch, tma, **split)(*args_of(x), interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, **TOL[dtype], what=name)


@cpu_only
def test_cluster_split_needs_its_barrier(monkeypatch):
    """The split kernel's gather is load-bearing: without the cluster barrier CTA 0 reads o before its peers
    wrote it (interpret mode then sees uninitialised GMEM or a race)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels import common

    monkeypatch.setattr(common, "cluster_sync", lambda bar, fences: None)
    x = make_inputs(rng(), 1, 2, 128, jnp.float32)
    want = reference.kda_decode(*args_of(x))
    with abstract_gpu("sm90"):
        got = _variant("sm90", "chunked", 4)(
            *args_of(x), interpret=plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        )
    ok = np.all(np.isfinite(np.asarray(got[0], np.float64))) and np.allclose(got[0], want[0], **TOL["f32"])
    assert get_races().races_found or not ok


@cpu_only
def test_warpgroup_split_needs_its_barrier(monkeypatch):
    """The warpgroup split's CTA barrier is load-bearing: without it WG 0 normalises o before the other
    warpgroups wrote their columns (interpret mode then sees a race or uninitialised SMEM)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels.kda_decode import kernel

    # staged by ld.global (tma=False), the CTA barrier is the kernel's only barrier wait
    monkeypatch.setattr(kernel.plgpu, "barrier_wait", lambda *a, **k: None)
    x = make_inputs(rng(), 1, 2, 128, jnp.float32)
    want = reference.kda_decode(*args_of(x))
    with abstract_gpu("sm90"):
        got = _variant("sm90", False, warpgroups=4)(
            *args_of(x), interpret=plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        )
    ok = np.all(np.isfinite(np.asarray(got[0], np.float64))) and np.allclose(got[0], want[0], **TOL["f32"])
    assert get_races().races_found or not ok


def gate_inputs(r, B, H, K, dtype, R=16, D=256):
    """The gate projections' inputs at the scale of the model: f and beta logits come out O(1)."""
    act = lambda *shape, scale=1.0: jnp.asarray(r.standard_normal(shape) * scale, jnp.float32).astype(dtype)  # noqa: E731
    return dict(fa=act(B, R), f_b=act(R, H, K, scale=R**-0.5), x=act(B, D), b=act(H, D, scale=D**-0.5))


def gate_args_of(x, g):
    return (
        x["qkv"],
        g["fa"],
        g["f_b"],
        g["x"],
        g["b"],
        x["gate"],
        x["state"],
        x["conv"],
        x["conv_w"],
        x["A_log"],
        x["dt_bias"],
        x["o_norm_w"],
    )


def x_args_of(x, g, w):
    """kda_decode_x's arguments: the layer's input and projection weights instead of projected q/k/v/g."""
    return (
        g["x"],
        w["qkvg"],
        w["f_a"],
        g["f_b"],
        g["b"],
        x["state"],
        x["conv"],
        x["conv_w"],
        x["A_log"],
        x["dt_bias"],
        x["o_norm_w"],
    )


def projection_weights(r, H, K, R, D, dtype=jnp.bfloat16):
    """Out-major qkvg [4, H, K, D] and f_a [R, D] at the model's scale (outputs O(1))."""
    return dict(
        qkvg=jnp.asarray(r.standard_normal((4, H, K, D)) * D**-0.5, jnp.float32).astype(dtype),
        f_a=jnp.asarray(r.standard_normal((R, D)) * D**-0.5, jnp.float32).astype(dtype),
    )


@cpu_only
@pytest.mark.parametrize(
    "B, gemv, fuse_max, x_stream",
    [
        (1, True, 64, None),
        (3, True, 64, None),
        (9, True, 64, "M"),
        (9, True, 8, "M"),
        (12, True, 64, "N"),
        (12, True, 8, "N"),
        (2, False, 64, None),
        (9, False, 8, None),
    ],
)
def test_decode_x_interpret_matches_reference(monkeypatch, B, gemv, fuse_max, x_stream):
    """The step from x and the projection weights: with tuning gemv_projections the decode GEMV's fp32 partials
    go straight into the decode kernel (which sums and rounds them; B = 9 and 12 run the GEMV's streamed launch
    with the tokens on M (x_stream "M", token-major partials) or N ([S, N, T] partials), read by the kernel, or
    with fuse_gates_max_batch 8 summed by XLA), else the model's
    GEMMs then the kernel (fed the whole qkvg, gates fused at B = 2, XLA's at B = 9); both against the reference
    (the model's GEMMs, then the XLA step). bf16, D = 1024, R = 128. With B > 1 some sequences are idle
    (active_B), as in a serving batch."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels.kda_decode import bodies

    r = rng()
    H, K, R, D = 2, 128, 128, 1024  # R = K, as in K3: the fused f gate's fa broadcast through SMEM
    x, g = make_inputs(r, B, H, K, jnp.bfloat16), gate_inputs(r, B, H, K, jnp.bfloat16, R=R, D=D)
    w = projection_weights(r, H, K, R, D)
    active = idle_mask(r, B) if B > 1 else None
    want = reference.kda_decode_x(*x_args_of(x, g, w), active)
    ops = bodies.entry_points(dict(_body("sm90").TUNING, gemv_projections=gemv, fuse_gates_max_batch=fuse_max))
    if x_stream:  # the tuning's launch with the tokens on x_stream's WGMMA dimension
        from pallas_kernels.gemv import api as gemv_api

        pick = gemv_api.pick_launch
        monkeypatch.setattr(gemv_api, "pick_launch", lambda *a, **k: dict(pick(*a, **k), x_stream=x_stream))
    if gemv:  # the GEMV path must not quietly fall back to the model's GEMMs
        monkeypatch.setattr(reference, "project", lambda *a: pytest.fail("fell back to XLA projections"))
    with abstract_gpu("sm90"):
        got = ops.kda_decode_x(*x_args_of(x, g, w), active, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found
    assert_idle_kept(got, want, x, jnp.ones(B) if active is None else active, TOL["bf16"])


@cpu_only
@pytest.mark.parametrize("B", [1, 64])
def test_decode_from_gemv_lowers_for_cuda_at_tp16_shapes(B):
    """The GEMV's partials and the decode kernel reading them, lowered (not run) at one TP16 rank's shapes:
    B = 1 and 64 with the GEMV's tuning (B = 64: x streamed, token-major partials)."""
    from pallas_kernels.gemv import api as gemv_api
    from pallas_kernels.gemv import kernel as gemv
    from pallas_kernels.kda_decode import kernel

    r = rng()
    H, K, R, D = 6, 128, 128, 7168
    x, g = make_inputs(r, B, H, K, jnp.bfloat16), gate_inputs(r, B, H, K, jnp.bfloat16, R=R, D=D)
    w = projection_weights(r, H, K, R, D)
    launch = kernel.pick_launch(_body("sm90").TUNING, x["qkv"])
    g_launch = gemv_api.pick_launch(B, D)

    def step(x_BD, qkvg, f_a, *rest):
        parts = gemv.partials(x_BD, (qkvg.reshape(-1, D), f_a), **g_launch)
        return kernel.decode_gates(
            parts[0],
            parts[1],
            rest[0],
            x_BD,
            rest[1],
            parts[0],
            *rest[2:],
            eps=1e-5,
            from_gemv="TN" if g_launch["x_stream"] == "M" else "NT",
            **launch,
        )

    args = x_args_of(x, g, w)
    with abstract_gpu("sm90"):
        text = jax.jit(step).trace(*args[:3], *args[3:]).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


def idle_mask(r, B):
    """active_B for B >= 2 sequences: random, with at least one idle (0) and one active (nonzero) slot."""
    active = r.integers(1, 3, B)  # any nonzero marks a sequence active
    active[r.permutation(B)[: r.integers(1, B)]] = 0
    return jnp.asarray(active, jnp.int32)


def assert_idle_kept(got, want, x, active, tol):
    """Idle sequences' state and conv window equal the inputs exactly (atol = rtol = 0); the active sequences'
    y, state and window match want's (an idle sequence's y is not specified)."""
    idle = np.asarray(active) == 0
    for name, a, b, before in zip(("y", "state", "conv"), got, want, (None, x["state"], x["conv"]), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if before is not None:
            assert_close(a[idle], before[idle], atol=0, rtol=0, what=f"idle {name}")
        assert_close(a[~idle], b[~idle], **tol, what=name)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_reference_keeps_idle_sequences(dtype):
    """active_B: idle sequences keep state and window exactly; active ones are the step's."""
    r = rng()
    x = make_inputs(r, 5, 2, 16, DTYPES[dtype])
    active = idle_mask(r, 5)
    got = jax.jit(reference.kda_decode)(*args_of(x), active)
    want = jax.jit(reference.kda_decode)(*args_of(x))
    assert_idle_kept(got, want, x, active, TOL[dtype])
    assert np.all(np.asarray(got[1])[np.asarray(active) != 0] != np.asarray(x["state"])[np.asarray(active) != 0])


@pytest.mark.parametrize("bad", [np.ones(4, np.int32), np.ones((5, 1), np.int32), np.ones(5, np.float32)])
def test_api_refuses_a_malformed_idle_mask(bad):
    """One integer or bool per sequence: anything else is refused with the shape it needs."""
    x = make_inputs(rng(), 5, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        api.kda_decode(*args_of(x), jnp.asarray(bad), policy=SPECIALIZED)


def test_api_refuses_qkv_without_three_streams():
    """The layer's whole qkvg [B, 4, H, K] is for a body's own kernel; through the api it is refused, whichever
    backend would run, with the shape it needs."""
    x = make_inputs(rng(), 2, 2, 16, jnp.float32)
    qkvg = jnp.concatenate([x["qkv"], x["gate"][:, None]], axis=1)
    for backend in ("xla", "latency_specialized"):
        with pytest.raises(ValueError, match=r"\[B, 3, H, K\]"):
            api.kda_decode(qkvg, *args_of(x)[1:], policy=DecodePolicy(backend))


@cpu_only
@pytest.mark.parametrize(
    "tma, split",
    [
        (False, {}),
        ("chunked", {}),
        ("rows", {}),
        ("rows", dict(keep_slices=3)),
        ("rows", dict(keep_slices=2)),
        ("chunked", dict(warpgroups=2)),
        ("chunked", dict(v_split=2)),
        ("rows", dict(keep_slices=3, in_place=True)),
        ("chunked", dict(v_split=2, in_place=True)),
    ],
)
def test_kernel_keeps_idle_sequences(tma, split):
    """The kernel writes an idle sequence's state and window back as read (every staging: SMEM left as loaded,
    or the registers as read; a split's conv writer), in interpret mode; lowered at 64 x 6."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    r = rng()
    x = make_inputs(r, 3, 1, 128, jnp.float32)
    active = idle_mask(r, 3)
    want = reference.kda_decode(*args_of(x), active)
    f = _variant("sm90", tma, **split)
    big = make_inputs(r, 64, 6, 128, jnp.bfloat16)
    with abstract_gpu("sm90"):
        got = f(*args_of(x), active, interpret=plgpu.InterpretGPUParams(detect_races=True))
        lowered = jax.jit(f).trace(*args_of(big), idle_mask(r, 64)).lower(lowering_platforms=("cuda",))
    assert not get_races().races_found
    assert_idle_kept(got, want, x, active, TOL["f32"])
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gates_reference_matches_numpy(dtype):
    r = rng()
    g = gate_inputs(r, 3, 2, 16, DTYPES[dtype])
    f, beta = jax.jit(reference.gates)(g["fa"], g["f_b"], g["x"], g["b"])
    f64 = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in g.items()}
    want_f = np.einsum("br,rhk->bhk", f64["fa"], f64["f_b"])
    want_beta = f64["x"] @ f64["b"].T
    assert f.dtype == beta.dtype == DTYPES[dtype]
    assert_close(f, want_f, **TOL[dtype], what="f")
    assert_close(beta, want_beta, **TOL[dtype], what="beta logits")


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("tma", [False, "chunked", "rows"])
def test_fused_gates_interpret_matches_reference(arch, dtype, tma):
    """The decode kernel with the f_b and b projections inside (issue 6 stretch goal) vs the reference."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels.kda_decode import kernel

    r = rng()
    x, g = make_inputs(r, 2, 2, 128, DTYPES[dtype]), gate_inputs(r, 2, 2, 128, DTYPES[dtype])
    want = reference.kda_decode_gates(*gate_args_of(x, g))
    layout = getattr(plgpu.Layout, _body(arch).TUNING["layout"])
    with abstract_gpu(arch):
        got = kernel.decode_gates(
            *gate_args_of(x, g),
            eps=1e-5,
            tile_layout=layout,
            v_chunk=32,
            tma=tma,
            interpret=plgpu.InterpretGPUParams(detect_races=True),
        )
    assert not get_races().races_found
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, **TOL[dtype], what=name)


@cpu_only
@pytest.mark.parametrize("fuse", [False, True])
def test_body_gates_follow_tuning(monkeypatch, fuse):
    """The body fuses the gate projections or runs them as XLA GEMVs, as its tuning says; same result.
    f32: XLA:CPU has no bf16 x bf16 -> f32 dot (the unfused path's GEMVs; GPUs have it)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import bodies

    r = rng()
    x, g = make_inputs(r, 1, 2, 128, jnp.float32), gate_inputs(r, 1, 2, 128, jnp.float32)
    tuning = dict(_body("sm90").TUNING, fuse_gates_max_batch=64 if fuse else 0)
    decode_gates = bodies.entry_points(tuning).kda_decode_gates
    with abstract_gpu("sm90"):
        got = decode_gates(*gate_args_of(x, g), interpret=plgpu.InterpretGPUParams())
    for a, b in zip(got, reference.kda_decode_gates(*gate_args_of(x, g)), strict=True):
        assert_close(a, b, **TOL["f32"])


@pytest.mark.parametrize("B, H, fused", [(2, 3, True), (3, 3, False), (2, 4, False)])
def test_body_fuses_gates_only_within_its_tuning_limits(monkeypatch, B, H, fused):
    """fuse_gates_max_batch = 2 and fuse_gates_max_heads = 3: the fused kernel runs only within both."""
    from pallas_kernels.kda_decode import bodies, kernel

    called = []
    monkeypatch.setattr(kernel, "decode_gates", lambda *a, **k: called.append("fused"))
    monkeypatch.setattr(kernel, "decode", lambda *a, **k: called.append("unfused"))
    tuning = dict(_body("sm90").TUNING, fuse_gates_max_batch=2, fuse_gates_max_heads=3)
    x, g = make_inputs(rng(), B, H, 128, jnp.float32), gate_inputs(rng(), B, H, 128, jnp.float32)
    with abstract_gpu("sm90"):
        bodies.entry_points(tuning).kda_decode_gates(*gate_args_of(x, g))
    assert called == ["fused" if fused else "unfused"]


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("tma", [False, "chunked", "rows"])
def test_fused_gates_lower_for_cuda(arch, tma):
    """The fused-gates kernel at a TP8 rank's real shape (R = 128, D = 7168), lowered (not run)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import kernel

    r = rng()
    x, g = make_inputs(r, 8, 12, 128, jnp.bfloat16), gate_inputs(r, 8, 12, 128, jnp.bfloat16, R=128, D=7168)
    layout = getattr(plgpu.Layout, _body(arch).TUNING["layout"])
    f = functools.partial(kernel.decode_gates, eps=1e-5, tile_layout=layout, v_chunk=32, tma=tma)
    with abstract_gpu(arch):
        text = jax.jit(f).trace(*gate_args_of(x, g)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize(
    "tma, v_split, gather",
    [(t, 1, "gmem") for t in (False, "chunked", "rows")]
    + [(t, 4, g) for t in (False, "chunked") for g in ("gmem", "dsmem")],
)
@pytest.mark.parametrize("in_place", [False, True])
def test_kernel_lowers_for_cuda(arch, tma, v_split, gather, in_place):
    """Lower (not run) the real Mosaic GPU kernel at a real shape: catches layout/lowering errors on CPU
    (the only CPU check of the peer-SMEM gather, which interpret mode cannot run; the GPU tests run it). In
    place, the call aliases the state and conv window (no copies into a donated cache)."""
    x = make_inputs(rng(), 8, 12, 128, jnp.bfloat16)
    with abstract_gpu(arch):
        f = _variant(arch, tma, v_split, gather=gather, in_place=in_place)
        lowered = jax.jit(f).trace(*args_of(x)).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
    assert "mosaic_gpu" in text
    assert aliased_operands(text) == ([4, 5] if in_place else [])


def aliased_operands(text):
    """The operand indices a lowered Mosaic GPU call writes in place (its output_operand_aliases)."""
    return sorted(int(i) for i in re.findall(r"output_operand_alias<[^>]*operand_index = (\d+)", text))


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("tma", [False, "chunked"])
@pytest.mark.parametrize("warpgroups", [2, 4])
def test_warpgroup_split_lowers_for_cuda(arch, tma, warpgroups):
    """The warpgroup split lowered (not run) at a real shape, with and without the fused gate projections."""
    x = make_inputs(rng(), 8, 12, 128, jnp.bfloat16)
    g = gate_inputs(rng(), 8, 12, 128, jnp.bfloat16, R=128, D=7168)
    with abstract_gpu(arch):
        for gates, args in ((False, args_of(x)), (True, gate_args_of(x, g))):
            f = _variant(arch, tma, gates=gates, warpgroups=warpgroups)
            assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_pick_launch_takes_first_entry_covering_the_tiles():
    from pallas_kernels.kda_decode import kernel, verify_kernel

    tuning = {
        "layout": "WGMMA",
        "launch": [
            {"max_tiles": 4, "v_chunk": 16, "tma": "chunked"},
            {"max_tiles": 64, "v_chunk": 64, "tma": False},
            {"max_tiles": 200, "v_chunk": 32, "tma": "chunked"},
            {"max_tiles": None, "tma": "rows", "k_chunk": 16, "keep_slices": 2},
        ],
    }
    for B, H, want in [(1, 4, (16, "chunked")), (1, 5, (64, False)), (8, 12, (32, "chunked")), (64, 96, (32, "rows"))]:
        got = kernel.pick_launch(tuning, jnp.zeros((B, 3, H, 8)))
        assert (got["v_chunk"], got["tma"]) == want, (B, H, got)
    assert kernel.pick_launch(tuning, jnp.zeros((64, 3, 96, 8)))["k_chunk"] == 16
    # verify stages whole tiles: a decode-only entry comes back as whole-tile TMA, without decode-only keys
    got = verify_kernel.pick_launch(tuning, jnp.zeros((64, 4, 3, 96, 8)))
    assert got["tma"] is True and "k_chunk" not in got and "warpgroups" not in got
    # from "verify_rows_min_tiles" tiles on, verify takes its own rows path (k_chunk 32) whatever decode's entry;
    # commit never does
    tuning["verify_rows_min_tiles"] = 13
    for B, H in [(1, 13), (8, 12), (64, 96)]:
        got = verify_kernel.pick_launch(tuning, jnp.zeros((B, 4, 3, H, 8)))
        assert (got["tma"], got["k_chunk"]) == ("rows", 32) and "keep_slices" not in got, (B, H, got)
        got = verify_kernel.pick_launch(tuning, jnp.zeros((B, 4, 3, H, 8)), split=False)
        assert "tma" not in got and "k_chunk" not in got, (B, H, got)
    assert verify_kernel.pick_launch(tuning, jnp.zeros((1, 4, 3, 12, 8)))["tma"] is False  # 5-64 tiles: ldg


@cpu_only
def test_api_body_runs_its_tuning():
    """The sm90 body with tuning.json's launch for a small shape (interpret mode, so it runs on CPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x = make_inputs(rng(), 1, 2, 128, jnp.float32)
    with abstract_gpu("sm90"):
        got = _body("sm90").kda_decode(*args_of(x), interpret=plgpu.InterpretGPUParams())
    for a, b in zip(got, reference.kda_decode(*args_of(x)), strict=True):
        assert_close(a, b, **TOL["f32"])


@cpu_only
@pytest.mark.parametrize(
    "launch",
    [
        dict(v_split=3),
        dict(v_split=8),
        dict(tma=True),
        dict(v_split=4, gather="dsmem"),
        dict(v_split=4, gather="tmem"),
        dict(tma="rows", v_split=2),
        dict(tma="rows", warpgroups=2),
        dict(tma="rows", k_chunk=48),
        dict(tma="columns"),
    ],
)
def test_kernel_refuses_impossible_launches(launch):
    """Splits that do not tile V into whole chunks, row slices that do not tile K or share a tile between
    warpgroups, unknown stagings (True: the whole-tile TMA, removed), and gathers interpret mode cannot run,
    refuse up front."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import kernel

    x = make_inputs(rng(), 1, 1, 128, jnp.float32)
    kw = dict(eps=1e-5, tile_layout=plgpu.Layout.WGMMA, v_chunk=32, tma="chunked") | launch
    with abstract_gpu("sm90"), pytest.raises(NotImplementedError):
        kernel.decode(*args_of(x), interpret=plgpu.InterpretGPUParams(), **kw)


@cpu_only
def test_body_runs_a_split_launch_entry():
    """A tuning launch entry with v_split reaches decode and verify (the commit keeps one CTA per tile)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import bodies

    tuning = dict(
        _body("sm90").TUNING,
        commit="kernel",
        launch=[{"max_tiles": None, "v_chunk": 32, "tma": "chunked", "v_split": 2, "gather": "gmem"}],
    )
    ops = bodies.entry_points(tuning)
    decode, verify, commit = ops.kda_decode, ops.kda_verify, ops.kda_commit
    r = rng()
    x, xt = make_inputs(r, 1, 2, 128, jnp.float32), make_inputs(r, 1, 2, 128, jnp.float32, T=2)
    interpret = plgpu.InterpretGPUParams()
    with abstract_gpu("sm90"):
        got = decode(*args_of(x), interpret=interpret)
        y, data = verify(*args_of(xt), interpret=interpret)
        state, _ = commit(xt["state"], xt["conv"], data, jnp.asarray([2], jnp.int32), interpret=interpret)
    for a, b in zip(got, reference.kda_decode(*args_of(x)), strict=True):
        assert_close(a, b, **TOL["f32"])
    y_want, data_want = reference.kda_verify(*args_of(xt))
    assert_close(y, y_want, **TOL["f32"], what="verify y")
    want = reference.kda_commit(xt["state"], xt["conv"], data_want, jnp.asarray([2], jnp.int32))[0]
    assert_close(state, want, **TOL["f32"], what="commit state")


def test_kernel_refuses_unsupported_shapes():
    x = make_inputs(rng(), 1, 2, 16, jnp.float32)
    with abstract_gpu("sm90"), pytest.raises(NotImplementedError):
        _body("sm90").kda_decode(*args_of(x))


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("H", [6, 12])
def test_kernel_on_gpu_matches_reference(B, H, dtype):
    x = make_inputs(rng(), B, H, 128, DTYPES[dtype])
    want = jax.jit(reference.kda_decode)(*args_of(x))
    got = jax.jit(lambda *a: api.kda_decode(*a, policy=SPECIALIZED))(*args_of(x))
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL[dtype], what=name)


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("tma", [False, "chunked"])
@pytest.mark.parametrize("B, H", [(1, 6), (64, 12)])
@pytest.mark.parametrize("v_split, gather", [(1, "gmem"), (4, "gmem"), (4, "dsmem")])
def test_stagings_on_gpu_match_reference(B, H, tma, dtype, v_split, gather):
    """Every state staging, one CTA or a 4-CTA cluster per tile (o gathered through GMEM or CTA 0's SMEM), at
    real shapes, whichever the tuning picks."""
    x = make_inputs(rng(), B, H, 128, DTYPES[dtype])
    want = jax.jit(reference.kda_decode)(*args_of(x))
    got = jax.jit(_variant("sm90", tma, v_split, gather=gather))(*args_of(x))
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL[dtype], what=name)


def policy_in_place() -> DecodePolicy:
    """latency_specialized with tuning.json's state_in_place on (both bodies)."""
    table = SPECIALIZED.table("kda_decode")
    entries = {arch: dict(table[arch], state_in_place=True) for arch in ("sm90", "sm100")}
    return DecodePolicy(backend="latency_specialized", tuning=SPECIALIZED.tuning.with_entries("kda_decode", **entries))


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("B, H", [(1, 6), (8, 12), (64, 6)])
def test_in_place_on_gpu_matches_reference(B, H, dtype):
    """The tuned launches (a cluster split, two warpgroups, the rows path) writing the state and window in place
    into donated arrays, idle sequences included: as the reference, the idle ones exactly as they were."""
    r = rng()
    x = make_inputs(r, B, H, 128, DTYPES[dtype])
    active = idle_mask(r, B) if B > 1 else np.ones(1, np.int32)
    want = jax.jit(reference.kda_decode)(*args_of(x), jnp.asarray(active))
    step = jax.jit(lambda *a: api.kda_decode(*a, policy=policy_in_place()), donate_argnums=(4, 5))
    got = step(*(jnp.array(a, copy=True) for a in args_of(x)), jnp.asarray(active))
    assert_idle_kept(got, want, x, active, TOL[dtype])


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("B, H", [(1, 6), (8, 12), (64, 6), (8, 96)])
@pytest.mark.parametrize("k_chunk, keep", [(32, 0), (32, 2), (32, 3)])
def test_rows_staging_on_gpu_matches_reference(B, H, dtype, k_chunk, keep):
    """Row slices with a thread per state column (tma='rows'; keep: slices held in registers between the two
    passes), at real shapes, with idle sequences."""
    from pallas_kernels.kda_decode import kernel

    r = rng()
    x = make_inputs(r, B, H, 128, DTYPES[dtype])
    active = idle_mask(r, B) if B > 1 else None
    want = jax.jit(reference.kda_decode)(*args_of(x), active)
    f = functools.partial(
        kernel.decode,
        eps=1e-5,
        tile_layout=kernel.plgpu.Layout.WGMMA,
        tma="rows",
        k_chunk=k_chunk,
        keep_slices=keep,
    )
    got = jax.jit(f)(*args_of(x), active)
    if active is None:
        for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
            assert_close(a, b, **TOL[dtype], what=name)
    else:
        assert_idle_kept(got, want, x, active, TOL[dtype])


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("B, H", [(8, 6), (8, 12), (8, 96), (64, 6), (64, 96)])
def test_idle_sequences_on_gpu(B, H, dtype):
    """Idle sequences keep state and window exactly through the api's tuned launch at real shapes (split,
    warpgroups, per-slice and whole-tile TMA between them)."""
    r = rng()
    x = make_inputs(r, B, H, 128, DTYPES[dtype])
    active = idle_mask(r, B)
    want = jax.jit(reference.kda_decode)(*args_of(x), active)
    got = jax.jit(lambda *a: api.kda_decode(*a, policy=SPECIALIZED))(*args_of(x), active)
    assert_idle_kept(got, want, x, active, TOL[dtype])


@gpu_only
@pytest.mark.parametrize(
    "B, H, gemv",
    [
        (1, 6, True),
        (8, 6, True),
        (1, 12, True),
        (8, 12, True),
        (12, 6, True),
        (32, 12, True),
        (64, 6, True),
        (64, 12, True),
        (64, 6, False),
        (1, 96, False),
        (8, 96, False),
    ],
)
def test_decode_x_on_gpu_matches_reference(monkeypatch, B, H, gemv):
    """At TP16 / TP8 / TP1 ranks' real shapes, bf16. gemv: the decode GEMV's partials read by the decode kernel
    (B = 64: x streamed, token-major partials; the kernel sums them within the fused-gates batch). Else where
    the GEMV does not run (B = 64, 96 heads): XLA's projections, the kernel fed the whole qkvg (no sliced
    copies), gates fused or XLA's."""
    from pallas_kernels.kda_decode import bodies

    r = rng()
    K, R, D = 128, 128, 7168
    x, g = make_inputs(r, B, H, K, jnp.bfloat16), gate_inputs(r, B, H, K, jnp.bfloat16, R=R, D=D)
    w = projection_weights(r, H, K, R, D)
    active = idle_mask(r, B) if B > 1 else jnp.ones(B, jnp.int32)
    want = jax.jit(reference.kda_decode_x)(*x_args_of(x, g, w), active)
    if gemv:
        monkeypatch.setattr(reference, "project", lambda *a: pytest.fail("fell back to XLA projections"))
    ops = bodies.entry_points(dict(_body("sm90").TUNING, gemv_projections=True))
    got = jax.jit(ops.kda_decode_x)(*x_args_of(x, g, w), active)
    assert_idle_kept(got, want, x, active, TOL["bf16"])


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("tma", [False, "chunked"])
@pytest.mark.parametrize("B, H", [(1, 6), (8, 12), (64, 12)])
@pytest.mark.parametrize("warpgroups", [2, 4])
def test_warpgroup_split_on_gpu_matches_reference(B, H, tma, dtype, warpgroups):
    """The state's columns split over 2 or 4 warpgroups of one CTA, at real shapes."""
    x = make_inputs(rng(), B, H, 128, DTYPES[dtype])
    want = jax.jit(reference.kda_decode)(*args_of(x))
    got = jax.jit(_variant("sm90", tma, warpgroups=warpgroups))(*args_of(x))
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL[dtype], what=name)


@gpu_only
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("B, H", [(1, 6), (8, 12), (64, 6), (8, 96)])
def test_gates_on_gpu_match_reference(monkeypatch, B, H, fuse):
    """Both gate variants at real shapes (R = 128, D = 7168), bf16, against the reference."""
    from pallas_kernels.kda_decode import bodies

    r = rng()
    x, g = make_inputs(r, B, H, 128, jnp.bfloat16), gate_inputs(r, B, H, 128, jnp.bfloat16, R=128, D=7168)
    tuning = dict(_body("sm90").TUNING, fuse_gates_max_batch=64 if fuse else 0, fuse_gates_max_heads=H)
    decode_gates = bodies.entry_points(tuning).kda_decode_gates
    got = jax.jit(decode_gates)(*gate_args_of(x, g))
    want = jax.jit(reference.kda_decode_gates)(*gate_args_of(x, g))
    for name, a, b in zip(("y", "state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL["bf16"], what=name)
