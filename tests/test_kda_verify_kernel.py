"""KDA speculative verify + commit kernels (pallas_kernels/kda_decode/verify_kernel.py): interpret mode on CPU
against the XLA reference and against T' sequential float64 decode steps (docs/model.md §4.2-4.6), the real CUDA
lowering at a real shape, and real shapes on the GPU."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testbase import abstract_gpu, assert_close, cpu_only, gpu_only, rng
from test_kda_decode import DTYPES, TOL, args_of, make_inputs, numpy_decode

from pallas_kernels.kda_decode import api, reference
from pallas_kernels.policy import SPECIALIZED, DecodePolicy

COMMIT_KEYS = ("kn_BTHK", "decay_BTHK", "beta_BTH", "delta_BTHV", "new_inputs_BT3HK")


def _layout(arch):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import sm90, sm100

    return getattr(plgpu.Layout, {"sm90": sm90, "sm100": sm100}[arch].TUNING["layout"])


def _kernels(arch, tma, interpret=None, v_split=1, gather="gmem"):
    """(verify, commit) with a body's layout; v_split / gather / tma: verify's cluster split of V and staging
    (tma="rows": its rows path); the commit has one CTA per tile and ld/st.global."""
    from pallas_kernels.kda_decode import verify_kernel

    kw = dict(tile_layout=_layout(arch), v_chunk=32, interpret=interpret)
    return (
        functools.partial(verify_kernel.verify, eps=1e-5, v_split=v_split, gather=gather, tma=tma, **kw),
        functools.partial(verify_kernel.commit, **kw),
    )


def numpy_steps(x, T):
    """T sequential float64 decode steps -> (y per step, state and conv window after 0..T steps)."""
    ys, states, convs = [], [x["state"]], [x["conv"]]
    for t in range(T):
        tok = {n: x[n][:, t] for n in ("qkv", "f", "beta", "gate")}
        y, S, conv = numpy_decode(dict(x, **tok, state=states[-1], conv=convs[-1]))
        ys.append(y)
        states.append(S)
        convs.append(conv)
    return ys, states, convs


def assert_commit_data_close(got, want, dtype):
    assert set(got) == set(want) == set(COMMIT_KEYS)
    for name in COMMIT_KEYS:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert_close(got[name], want[name], **TOL[dtype], what=name)


# (arch, staging, dtype, v_split): each body with both staging paths, each dtype twice, one CTA per tile; then
# verify on a cluster of 4 / 2 CTAs per tile (o gathered through GMEM for CTA 0's gated norms).
VARIANTS = [
    ("sm90", False, "f32", 1),
    ("sm90", True, "bf16", 1),
    ("sm100", False, "bf16", 1),
    ("sm100", True, "f32", 1),
    ("sm90", False, "f32", 4),
    ("sm100", True, "bf16", 2),
    ("sm90", "rows", "f32", 1),
    ("sm100", "rows", "bf16", 1),
]


@cpu_only
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("arch,tma,dtype,v_split", VARIANTS)
def test_verify_then_commit_interpret_equals_sequential_decode(arch, tma, dtype, v_split, T):
    """verify kernel == XLA verify; commit kernel of the kernel's commit data == T' float64 decode steps, for
    T' = 0 and T and random T' per sequence."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    r = rng()
    x = make_inputs(r, 2, 2, 128, DTYPES[dtype], T=T)
    verify, commit = _kernels(arch, tma, plgpu.InterpretGPUParams(detect_races=True), v_split=v_split)
    with abstract_gpu(arch):
        y, data = verify(*args_of(x))
    assert not get_races().races_found
    y_want, data_want = reference.kda_verify(*args_of(x))
    assert y.dtype == y_want.dtype and y.shape == y_want.shape
    assert_close(y, y_want, **TOL[dtype], what="y vs XLA")
    assert_commit_data_close(data, data_want, dtype)

    ys, states, convs = numpy_steps(x, T)
    assert_close(y, np.stack(ys, axis=1), **TOL[dtype], what="y vs float64 decode steps")
    for accepted in (np.array([0, T]), r.integers(0, T + 1, 2)):
        with abstract_gpu(arch):
            state, conv = commit(x["state"], x["conv"], data, jnp.asarray(accepted, jnp.int32))
        assert not get_races().races_found
        assert state.dtype == jnp.float32 and conv.dtype == x["conv"].dtype
        for b, a in enumerate(accepted):
            assert_close(state[b], states[a][b], **TOL[dtype], what=f"state b={b} accepted={a}")
            assert_close(conv[b], convs[a][b], atol=0, rtol=0, what=f"conv b={b} accepted={a}")


@cpu_only
def test_commit_interpret_every_prefix():
    """Commit kernel == XLA commit for every accepted count 0..T at once (sequence b accepts b tokens)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    T = 8
    x = make_inputs(rng(), T + 1, 1, 128, jnp.bfloat16, T=T)
    _, data = reference.kda_verify(*args_of(x))
    accepted = jnp.arange(T + 1, dtype=jnp.int32)
    _, commit = _kernels("sm90", False, plgpu.InterpretGPUParams(detect_races=True))
    with abstract_gpu("sm90"):
        got = commit(x["state"], x["conv"], data, accepted)
    assert not get_races().races_found
    for name, a, b in zip(
        ("state", "conv"), got, reference.kda_commit(x["state"], x["conv"], data, accepted), strict=True
    ):
        assert_close(a, b, atol=1e-6, rtol=1e-6, what=name)


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_bodies_run_their_tuning(arch):
    """sm90.py / sm100.py entry points (launch from tuning.json) in interpret mode."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import sm90, sm100

    body = {"sm90": sm90, "sm100": sm100}[arch]
    r = rng()
    x = make_inputs(r, 1, 2, 128, jnp.float32, T=3)
    accepted = jnp.asarray(r.integers(0, 4, 1), jnp.int32)
    commit = functools.partial(body.kda_commit, interpret=plgpu.InterpretGPUParams())
    with abstract_gpu(arch):
        y, data = body.kda_verify(*args_of(x), interpret=plgpu.InterpretGPUParams())
    y_want, data_want = reference.kda_verify(*args_of(x))
    assert_close(y, y_want, **TOL["f32"], what="y")
    assert_commit_data_close(data, data_want, "f32")
    if body.TUNING.get("commit") == "xla":  # the body refuses; the api then runs the XLA commit
        with abstract_gpu(arch), pytest.raises(NotImplementedError, match="tuning.json"):
            commit(x["state"], x["conv"], data, accepted)
        return
    with abstract_gpu(arch):
        got = commit(x["state"], x["conv"], data, accepted)
    for a, b in zip(got, reference.kda_commit(x["state"], x["conv"], data_want, accepted), strict=True):
        assert_close(a, b, **TOL["f32"])


@cpu_only
def test_body_verify_takes_rows_from_its_tuning(monkeypatch):
    """From tuning's verify_rows_min_tiles B*H tiles on (here 2), the sm90 body's verify runs the rows path."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.kda_decode import bodies, sm90, verify_kernel

    ran = []
    steps_rows = verify_kernel.steps_rows
    monkeypatch.setattr(verify_kernel, "steps_rows", lambda *a: ran.append(1) or steps_rows(*a))
    x = make_inputs(rng(), 1, 2, 128, jnp.float32, T=2)  # T = 2: no other test's trace to reuse
    ops = bodies.entry_points(dict(sm90.TUNING, verify_rows_min_tiles=2))
    with abstract_gpu("sm90"):
        y, data = ops.kda_verify(*args_of(x), interpret=plgpu.InterpretGPUParams())
    assert ran
    y_want, data_want = reference.kda_verify(*args_of(x))
    assert_close(y, y_want, **TOL["f32"], what="y")
    assert_commit_data_close(data, data_want, "f32")


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize(
    "tma, v_split, gather",
    [(tma, v, g) for tma in (False, True) for v, g in ((1, "gmem"), (4, "gmem"), (4, "dsmem"))] + [("rows", 1, "gmem")],
)
def test_kernels_lower_for_cuda(arch, tma, v_split, gather):
    """Lower (not run) both real Mosaic GPU kernels at a real shape: catches layout/lowering errors on CPU
    (the only CPU check of verify's peer-SMEM gather)."""
    r = rng()
    x = make_inputs(r, 8, 12, 128, jnp.bfloat16, T=8)
    _, data = reference.kda_verify(*args_of(x))
    accepted = jnp.asarray(r.integers(0, 9, 8), jnp.int32)
    verify, commit = _kernels(arch, tma, v_split=v_split, gather=gather)
    with abstract_gpu(arch):
        texts = [
            jax.jit(verify).trace(*args_of(x)).lower(lowering_platforms=("cuda",)).as_text(),
            jax.jit(commit).trace(x["state"], x["conv"], data, accepted).lower(lowering_platforms=("cuda",)).as_text(),
        ]
    assert all("mosaic_gpu" in t for t in texts)


def test_kernels_refuse_unsupported_shapes():
    from pallas_kernels.kda_decode import sm90

    for B, H, K, T in [(1, 2, 16, 2), (1, 2, 128, 9)]:
        x = make_inputs(rng(), B, H, K, jnp.float32, T=T)
        with abstract_gpu("sm90"), pytest.raises(NotImplementedError):
            sm90.kda_verify(*args_of(x))


@cpu_only
def test_api_commit_follows_the_tuning(caplog):
    """sm90's tuning.json says commit = xla (XLA's fused commit measured faster): the api runs the reference
    and says why, without touching the kernel."""
    from pallas_kernels import common
    from pallas_kernels.kda_decode import sm90

    assert sm90.TUNING.get("commit") == "xla"
    common.log_once.cache_clear()
    r = rng()
    x = make_inputs(r, 2, 2, 128, jnp.float32, T=3)
    _, data = reference.kda_verify(*args_of(x))
    accepted = jnp.asarray(r.integers(0, 4, 2), jnp.int32)
    with caplog.at_level(logging.WARNING, logger="k3jax.backends"), abstract_gpu("sm90"):
        got = api.kda_commit(x["state"], x["conv"], data, accepted, policy=SPECIALIZED)
    for a, b in zip(got, reference.kda_commit(x["state"], x["conv"], data, accepted), strict=True):
        assert_close(a, b, atol=0, rtol=0)
    assert any("kda_commit" in m and "tuning.json" in m for m in caplog.messages), caplog.messages


def test_api_falls_back_once_and_rejects_unknown_backend(caplog):
    from pallas_kernels import common

    common.log_once.cache_clear()
    r = rng()
    x = make_inputs(r, 2, 2, 16, jnp.float32, T=3)  # K=16: the kernels refuse it on a GPU too
    accepted = jnp.asarray(r.integers(0, 4, 2), jnp.int32)
    y_want, data_want = reference.kda_verify(*args_of(x))
    with caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        for _ in range(2):
            y, data = api.kda_verify(*args_of(x), policy=SPECIALIZED)
            got = api.kda_commit(x["state"], x["conv"], data, accepted, policy=SPECIALIZED)
    assert_close(y, y_want, atol=0, rtol=0)
    for name in COMMIT_KEYS:
        assert_close(data[name], data_want[name], atol=0, rtol=0, what=name)
    for a, b in zip(got, reference.kda_commit(x["state"], x["conv"], data_want, accepted), strict=True):
        assert_close(a, b, atol=0, rtol=0)
    for op in ("kda_verify", "kda_commit"):  # the kernels refuse K=16 on a GPU too, with another reason
        assert sum(m.startswith(op) for m in caplog.messages) == 1, caplog.messages
    for f, args in ((api.kda_verify, args_of(x)), (api.kda_commit, (x["state"], x["conv"], data, accepted))):
        with pytest.raises(ValueError):
            f(*args, policy=DecodePolicy("cuda"))


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T", [1, 8])  # T = 4 dropped: 36 compiles did not fit one device call (26 ran)
@pytest.mark.parametrize("H", [6, 12])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_kernels_on_gpu_match_reference(B, H, T, dtype):
    r = rng()
    x = make_inputs(r, B, H, 128, DTYPES[dtype], T=T)
    accepted = r.integers(0, T + 1, B)
    accepted[:2] = [T, 0][:B]  # all and none accepted, the rest at random
    accepted = jnp.asarray(accepted, jnp.int32)
    y_want, data_want = jax.jit(reference.kda_verify)(*args_of(x))
    y, data = jax.jit(lambda *a: api.kda_verify(*a, policy=SPECIALIZED))(*args_of(x))
    assert_close(y, y_want, **TOL[dtype], what="y")
    assert_commit_data_close(data, data_want, dtype)
    want = jax.jit(reference.kda_commit)(x["state"], x["conv"], data_want, accepted)
    got = jax.jit(lambda *a: api.kda_commit(*a, policy=SPECIALIZED))(x["state"], x["conv"], data, accepted)
    for name, a, b in zip(("state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL[dtype], what=name)
    # the commit kernel itself, with sm90's launch (its body refuses the commit: tuning.json "commit")
    from pallas_kernels.kda_decode import sm90, verify_kernel

    launch = verify_kernel.pick_launch(sm90.TUNING, x["qkv"], split=False)
    got = jax.jit(functools.partial(verify_kernel.commit, **launch))(x["state"], x["conv"], data, accepted)
    for name, a, b in zip(("state", "conv"), got, want, strict=True):
        assert_close(a, b, **TOL[dtype], what=f"commit kernel {name}")


@gpu_only
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("B, H, T", [(1, 6, 4), (8, 12, 8), (64, 6, 4), (64, 12, 8)])
def test_rows_verify_on_gpu_matches_reference(B, H, T, dtype):
    """verify's rows path (the tile in registers, a column per thread, for all T steps) at real shapes."""
    x = make_inputs(rng(), B, H, 128, DTYPES[dtype], T=T)
    y_want, data_want = jax.jit(reference.kda_verify)(*args_of(x))
    verify, _ = _kernels("sm90", "rows")
    y, data = jax.jit(verify)(*args_of(x))
    assert_close(y, y_want, **TOL[dtype], what="y")
    assert_commit_data_close(data, data_want, dtype)


@gpu_only
@pytest.mark.parametrize("gather", ["gmem", "dsmem"])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("B, H, T", [(1, 6, 4), (8, 12, 8)])
def test_split_verify_on_gpu_matches_reference(B, H, T, tma, gather):
    """verify on a 4-CTA cluster per tile at real shapes, bf16, both gathers, against the XLA verify."""
    x = make_inputs(rng(), B, H, 128, jnp.bfloat16, T=T)
    y_want, data_want = jax.jit(reference.kda_verify)(*args_of(x))
    verify, _ = _kernels("sm90", tma, v_split=4, gather=gather)
    y, data = jax.jit(verify)(*args_of(x))
    assert_close(y, y_want, **TOL["bf16"], what="y")
    assert_commit_data_close(data, data_want, "bf16")
