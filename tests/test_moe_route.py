"""The MoE routing step (pallas_kernels.moe_route, docs/model.md §6 after the sigmoid): the Mosaic GPU top-k kernel in
interpret mode and the XLA reference against a NumPy oracle (exact sel, w within 1e-6), ties, token counts
that are not whole 4s; CUDA lowering at the real shapes; the api's dispatch and refusals; the real shapes on the
GPU. (The grouping by expert is pallas_kernels/moe/grouping.py, tested in tests/test_moe_kernel.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import policy as policy_lib
from pallas_kernels.moe_route import api, kernel, reference
from tests.kernel_testbase import ON_GPU, abstract_gpu, cpu_only, gpu_only, rng

F32 = jnp.float32


def make_scores(r, T, E, *, ties=False):
    """Sigmoid scores of fresh logits and a selection bias of the router's size; with ties, both on a 1/16 grid
    so many biased scores are equal (and the bias alone decides nothing)."""
    s = 1 / (1 + np.exp(-r.standard_normal((T, E)) * 2))
    bias = r.standard_normal(E) * 0.3
    if ties:
        s, bias = np.clip(np.round(s * 16) / 16, 1 / 16, 1), np.round(bias * 16) / 16
    return jnp.asarray(s, F32), jnp.asarray(bias, F32)


def oracle_route(scores, biased, k, renormalize, scaling):
    """docs/model.md §6 in NumPy: the k largest biased scores (equal ones by lower index: a stable sort), weights
    from the unbiased scores in float64."""
    b = np.asarray(biased)
    sel = np.argsort(-b, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(np.asarray(scores, np.float64), sel, axis=-1)
    if renormalize and k > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return sel, w * scaling


def check_route(got, want):
    (sel, w), (sel_want, w_want) = got, want
    assert sel.dtype == jnp.int32 and w.dtype == F32
    np.testing.assert_array_equal(np.asarray(sel), sel_want)
    np.testing.assert_allclose(np.asarray(w, np.float64), w_want, atol=1e-6, rtol=0)


def interpret():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True)


def assert_no_races():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    assert not get_races().races_found


# ------------------------------------------------------------------------------------------------ the kernel
@cpu_only
@pytest.mark.parametrize(
    "T, E, k, ties, bias_form",
    [
        (1, 16, 2, False, "biased"),
        (5, 48, 4, True, "bias"),
        (12, 64, 3, True, "biased"),
        (64, 32, 4, False, "bias"),
        (2, 128, 4, True, "bias"),
        (3, 256, 8, False, "biased"),
        (7, 896, 16, True, "biased"),
        (5, 896, 16, False, "bias"),
        (64, 896, 16, True, "bias"),
    ],
)
def test_kernel_interpret_matches_numpy(T, E, k, ties, bias_form):
    """A warp per token, rows in 4s with 2- and 1-row tails (T = 1, 2, 3, 5, 7, 12, 64), E padded to 128s or not,
    the bias added by the caller or in the kernel; race-free."""
    r = rng()
    s, bias = make_scores(r, T, E, ties=ties)
    biased = s + bias
    extra = dict(biased_TE=biased) if bias_form == "biased" else dict(bias_E=bias)
    with abstract_gpu("sm90"):
        got = kernel.route(s, **extra, k=k, scaling=2.5, interpret=interpret())
    assert_no_races()
    check_route(got, oracle_route(s, biased, k, True, 2.5))


@cpu_only
@pytest.mark.parametrize("k, renormalize", [(1, True), (4, False)])
def test_kernel_interpret_without_renormalisation(k, renormalize):
    """k = 1 (never renormalised, as the spec) and renormalize off: the raw unbiased scores times scaling."""
    r = rng()
    s, bias = make_scores(r, 6, 64)
    with abstract_gpu("sm90"):
        got = kernel.route(s, bias_E=bias, k=k, renormalize=renormalize, scaling=0.5, interpret=interpret())
    check_route(got, oracle_route(s, s + bias, k, renormalize, 0.5))


@cpu_only
def test_kernel_interpret_breaks_ties_by_lower_index_everywhere():
    """Every biased score equal within each token: sel must be 0..k-1 in order, like lax.top_k."""
    T, E, k = 5, 128, 8
    s = jnp.asarray(rng().uniform(0.1, 0.9, (T, E)), F32)
    biased = jnp.full((T, E), 0.25, F32)
    with abstract_gpu("sm90"):
        sel, w = kernel.route(s, biased, k=k, interpret=interpret())
    np.testing.assert_array_equal(np.asarray(sel), np.tile(np.arange(k), (T, 1)))
    check_route((sel, w), oracle_route(s, biased, k, True, 1.0))


@cpu_only
def test_kernel_interpret_orders_signed_zeros_like_cpu_top_k():
    """+0 above -0 (IEEE total order, the kernel's int32 keys), as XLA's top_k on CPU: the reference here."""
    T, E, k = 3, 128, 16
    b = np.full((T, E), -1.0, np.float32)
    b[:, ::3], b[:, 1::3] = 0.0, -0.0
    s, b = jnp.asarray(rng().uniform(0.1, 0.9, (T, E)), F32), jnp.asarray(b)
    with abstract_gpu("sm90"):
        sel, w = kernel.route(s, b, k=k, interpret=interpret())
    want = reference.route(s, b, k=k)
    assert np.all(np.asarray(want[0]) % 3 == 0)  # CPU top_k: every +0 before any -0
    np.testing.assert_array_equal(np.asarray(sel), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want[1]), atol=1e-6, rtol=0)


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("T", [1, 5, 8, 64, 512])
def test_kernel_lowers_for_cuda_at_real_shapes(arch, T):
    """E = 896, k = 16, every tail form; both bias forms lower (shapes only, no values)."""
    s = jax.ShapeDtypeStruct((T, 896), F32)
    bias = jax.ShapeDtypeStruct((896,), F32)
    with abstract_gpu(arch):
        for f, args in (
            (lambda s, b: kernel.route(s, b, k=16), (s, s)),
            (lambda s, b: kernel.route(s, bias_E=b, k=16), (s, bias)),
        ):
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()
            assert [o.shape for o in lowered.out_info] == [(T, 16), (T, 16)]


@pytest.mark.parametrize("bad", ["dtype", "k"])
def test_kernel_refuses_what_it_cannot_run(bad):
    s = jnp.ones((4, 64), jnp.bfloat16 if bad == "dtype" else F32)
    with pytest.raises(NotImplementedError):
        kernel.check_supported(s, s, None, 40 if bad == "k" else 4)


def make_block(r, T, ranks, e_local, width, *, ties=False):
    """The ranks' all-gathered routing block [T, ranks x width] (each piece: E_l scores, E_l biased scores, then
    other numbers, as layers/moe.py's gather) -> (block, scores [T, E], biased [T, E])."""
    s, bias = make_scores(r, T, ranks * e_local, ties=ties)
    biased = s + bias
    pieces = r.standard_normal((T, ranks, width)).astype(np.float32)
    pieces[..., :e_local] = np.asarray(s).reshape(T, ranks, e_local)
    pieces[..., e_local : 2 * e_local] = np.asarray(biased).reshape(T, ranks, e_local)
    return jnp.asarray(pieces.reshape(T, ranks * width)), s, biased


@cpu_only
@pytest.mark.parametrize(
    "T, ranks, e_local, width, k, ties",
    [(1, 4, 32, 96, 8, False), (7, 8, 16, 40, 4, True), (6, 2, 64, 192, 16, False), (13, 4, 32, 64, 3, True)],
)
def test_gathered_kernel_interpret_matches_numpy(T, ranks, e_local, width, k, ties):
    """The gathered form reads each rank's scores and biased scores out of the block (TMA boxes of [rows,
    ranks, E_l]): sel exactly the oracle's over the experts in rank order, tails of 2 and 1 rows, race-free."""
    block, s, biased = make_block(rng(), T, ranks, e_local, width, ties=ties)
    with abstract_gpu("sm90"):
        got = kernel.route_gathered(block, ranks=ranks, e_local=e_local, k=k, scaling=2.5, interpret=interpret())
    assert_no_races()
    check_route(got, oracle_route(s, biased, k, True, 2.5))


@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("tp", [4, 8, 16])
@pytest.mark.parametrize("T", [1, 5, 64, 512])
def test_gathered_kernel_lowers_for_cuda_at_real_shapes(arch, tp, T):
    """E = 896 over tp ranks, each piece [E_l | E_l | L_l = 3584 / tp] as the model gathers it."""
    e_local, l_local = 896 // tp, 3584 // tp
    block = jax.ShapeDtypeStruct((T, tp * (2 * e_local + l_local)), F32)
    with abstract_gpu(arch):
        f = jax.jit(lambda b: kernel.route_gathered(b, ranks=tp, e_local=e_local, k=16))
        lowered = f.trace(block).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert [o.shape for o in lowered.out_info] == [(T, 16), (T, 16)]


@pytest.mark.parametrize("bad", ["tp2", "not_128s", "dtype"])
def test_gathered_kernel_refuses_what_its_tma_cannot_read(bad):
    """TP2's 448 experts a rank exceed a TMA box side; E not a whole number of 128-wide spans; bf16."""
    ranks, e_local = {"tp2": (2, 448), "not_128s": (3, 32), "dtype": (4, 32)}[bad]
    block = jnp.ones((3, ranks * 3 * e_local), jnp.bfloat16 if bad == "dtype" else F32)
    with pytest.raises(NotImplementedError):
        kernel.check_gathered(block, ranks, e_local, 4)


@cpu_only
@pytest.mark.parametrize("tp, gathered", [(16, True), (2, False)])
def test_api_routes_the_gathered_block_through_a_kernel(tp, gathered):
    """Under an abstract H100 the specialized policy lowers a Mosaic GPU kernel for the gathered block: the
    gathered form where its TMA reads the block (TP16), the plain kernel on XLA's slices where it cannot (TP2);
    the default policy lowers plain XLA."""
    e_local, l_local = 896 // tp, 3584 // tp
    block = jax.ShapeDtypeStruct((4, tp * (2 * e_local + l_local)), F32)
    for pol, want in ((policy_lib.SPECIALIZED, "pallas"), (policy_lib.XLA, "xla")):
        log = policy_lib.DispatchLog()
        with abstract_gpu("sm90"), policy_lib.recording(log):
            f = jax.jit(lambda b: api.route_gathered(b, ranks=tp, e_local=e_local, k=16, policy=pol))  # noqa: B023
            text = f.trace(block).lower(lowering_platforms=("cuda",)).as_text()
        assert log.ops["moe_route"]["impl"] == want
        assert ("mosaic_gpu" in text) == (want == "pallas")
        if want == "pallas":  # the plain kernel's operands are slices XLA makes; the gathered form takes the block
            assert ("stablehlo.slice" in text) == (not gathered)


def test_api_gathered_matches_numpy_and_rejects_a_malformed_block():
    """On CPU the api runs the reference on split_block's slices: the oracle's routing over the ranks' experts."""
    block, s, biased = make_block(rng(), 5, 4, 16, 50)
    check_route(api.route_gathered(block, ranks=4, e_local=16, k=6), oracle_route(s, biased, 6, True, 1.0))
    with pytest.raises(ValueError):
        api.route_gathered(block, ranks=3, e_local=16, k=6)  # 200 columns are not 3 pieces
    with pytest.raises(ValueError):
        api.route_gathered(block, ranks=4, e_local=32, k=6)  # a piece of 50 holds no 2 x 32


# --------------------------------------------------------------------------------------- reference and api
@pytest.mark.parametrize("T, E, k, ties", [(1, 896, 16, False), (12, 64, 4, True), (37, 896, 16, True)])
def test_reference_matches_numpy(T, E, k, ties):
    r = rng()
    s, bias = make_scores(r, T, E, ties=ties)
    check_route(reference.route(s, s + bias, k=k, scaling=2.5), oracle_route(s, s + bias, k, True, 2.5))


def test_api_falls_back_to_the_reference_without_a_gpu(caplog):
    """Asked for kernels on CPU, the api runs the reference (same numbers), records why and logs it once."""
    if ON_GPU:
        pytest.skip("the fallback is what runs without a GPU")
    r = rng()
    s, bias = make_scores(r, 5, 64)
    log = policy_lib.DispatchLog()
    with policy_lib.recording(log):
        got = api.route(s, bias_E=bias, k=4, policy=policy_lib.SPECIALIZED)
    assert log.ops["moe_route"]["impl"] == "xla" and "GPU" in log.ops["moe_route"]["reason"]
    check_route(got, oracle_route(s, s + bias, 4, True, 1.0))
    with policy_lib.recording(log):
        api.route(s, s + bias, k=4)  # the default policy: XLA, never the kernel
    assert log.ops["moe_route"] == {"impl": "xla", "reason": "decode backend auto"}


@cpu_only
def test_api_runs_the_kernel_on_a_gpu():
    """Under an abstract H100 the specialized policy lowers the Mosaic GPU kernel (and records it); the default
    policy lowers plain XLA."""
    s = jax.ShapeDtypeStruct((8, 896), F32)
    for pol, want in ((policy_lib.SPECIALIZED, "pallas"), (policy_lib.XLA, "xla")):
        log = policy_lib.DispatchLog()
        with abstract_gpu("sm90"), policy_lib.recording(log):
            f = jax.jit(lambda s, b: api.route(s, b, k=16, policy=pol))  # noqa: B023
            text = f.trace(s, s).lower(lowering_platforms=("cuda",)).as_text()
        assert log.ops["moe_route"]["impl"] == want
        assert ("mosaic_gpu" in text) == (want == "pallas")


@pytest.mark.parametrize("bad", ["rank", "both", "neither", "biased_shape", "bias_shape", "k"])
def test_api_rejects_malformed_inputs(bad):
    s = jnp.ones((3, 16), F32)
    kw = dict(biased_TE=s, k=4)
    if bad == "rank":
        s = jnp.ones((3, 4, 16), F32)
    elif bad == "both":
        kw["bias_E"] = jnp.ones(16, F32)
    elif bad == "neither":
        kw.pop("biased_TE")
    elif bad == "biased_shape":
        kw["biased_TE"] = jnp.ones((3, 17), F32)
    elif bad == "bias_shape":
        kw = dict(bias_E=jnp.ones(15, F32), k=4)
    else:
        kw["k"] = 17
    with pytest.raises(ValueError):
        api.route(s, **kw)


# ------------------------------------------------------------------------------------------------- the GPU
@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_kernel_on_gpu_matches_xla_top_k(T, ties):
    """E = 896, k = 16 on the GPU: the kernel's sel equals XLA's lax.top_k exactly (same order), w within 1e-6,
    both bias forms; and the oracle agrees."""
    r = rng()
    s, bias = make_scores(r, T, 896, ties=ties)
    want = jax.jit(lambda s, b: reference.route(s, s + b, k=16))(s, bias)
    for got in (
        jax.jit(lambda s, b: kernel.route(s, s + b, k=16))(s, bias),
        jax.jit(lambda s, b: kernel.route(s, bias_E=b, k=16))(s, bias),
        jax.jit(lambda s, b: api.route(s, bias_E=b, k=16, policy=policy_lib.SPECIALIZED))(s, bias),
    ):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6, rtol=0)
    check_route(want, oracle_route(s, s + bias, 16, True, 1.0))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("T", [1, 5, 64, 512])
def test_gathered_kernel_on_gpu_matches_xla_top_k(T, tp):
    """The gathered form on the GPU at the model's block (E = 896 over tp ranks, L_l = 3584 / tp): sel equals
    XLA's lax.top_k on the sliced scores exactly, w within 1e-6; through the api too."""
    e_local = 896 // tp
    block, s, biased = make_block(rng(), T, tp, e_local, 2 * e_local + 3584 // tp, ties=T == 5)
    want = jax.jit(lambda s, b: reference.route(s, b, k=16))(s, biased)
    for got in (
        jax.jit(lambda b: kernel.route_gathered(b, ranks=tp, e_local=e_local, k=16))(block),
        jax.jit(lambda b: api.route_gathered(b, ranks=tp, e_local=e_local, k=16, policy=policy_lib.SPECIALIZED))(block),
    ):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6, rtol=0)
    check_route(want, oracle_route(s, biased, 16, True, 1.0))
