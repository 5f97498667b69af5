"""The decode GEMV (pallas_kernels.gemv): kernel in interpret mode and its reference against float64 NumPy,
CUDA lowering at one TP16 rank's real shapes, the api's fallback and refusals; real shapes on the GPU. Weights
of rows that are not whole 64-row blocks (the MoE in-projections at TP16 / TP8) included. The Blackwell body
(kernel_sm100) on an abstract B200: interpret mode and CUDA lowering only (its section at the end)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.config import K3Config
from pallas_kernels.gemv import api, kernel, kernel_sm100, reference
from pallas_kernels.policy import SPECIALIZED, XLA, DecodePolicy, Tuning
from tests.kernel_testbase import abstract_gpu, cpu_only, gpu_only, rng

STREAMED = dict(block_k=128, split_k=2, steps=6, x_stream="M")  # tokens on M: a 64-row x tile
STREAMED_N = dict(STREAMED, x_stream="N")  # tokens on N: the batch padded to 8s, no 64-row tile past B
BODIES = {"sm90": kernel, "sm100": kernel_sm100}  # the body each abstract GPU runs (api.body)


def _inputs(r, B, D, rows):
    x = jnp.asarray(r.standard_normal((B, D)), jnp.bfloat16)
    ws = tuple(jnp.asarray(r.standard_normal((n, D)) * D**-0.5, jnp.bfloat16) for n in rows)
    return x, ws


def _check(got, x, ws):
    """Each output within a few bf16 ulps of the float64 product (one rounding of an exact-ish fp32 sum)."""
    for g, w in zip(got, ws, strict=True):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        assert g.shape == want.shape and g.dtype == jnp.bfloat16
        err = np.abs(np.asarray(g, np.float64) - want)
        assert np.all(err <= 2**-8 * np.abs(want) + 1e-3 * np.max(np.abs(want))), float(err.max())


@cpu_only
@pytest.mark.parametrize(
    "B, split_k, steps, x_stream",
    [
        (3, 2, 3, "M"),
        (20, 1, 2, "M"),
        (64, 2, 4, "M"),
        (13, 2, 3, "N"),
        (8, 4, 4, "N"),
        (20, 4, 2, "N"),
        (32, 1, 2, "N"),
        (1, 2, 3, "N"),
        (6, 2, 2, "N"),
        (1, 1, 2, "N"),
        (5, 1, 3, "N"),
    ],
)
def test_kernel_interpret_matches_numpy(B, split_k, steps, x_stream):
    """x streamed beside the weights, the tokens on WGMMA's M or N, race-free; with one split the kernel writes
    the rounded output itself (on N a row per token, through SMEM)."""
    x, ws = _inputs(rng(), B, 1024, (128, 64))
    _check(_interpret(x, ws, split_k, steps, x_stream), x, ws)


def _interpret(x, ws, split_k, steps, x_stream, out_dtypes=None, arch="sm90"):
    """The kernel in interpret mode on an abstract H100 (arch "sm100": the Blackwell body on a B200), race-checked."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    with abstract_gpu(arch):
        got = BODIES[arch].gemv(
            x,
            ws,
            block_k=128,
            split_k=split_k,
            steps=steps,
            x_stream=x_stream,
            out_dtypes=out_dtypes,
            interpret=plgpu.InterpretGPUParams(detect_races=True),
        )
    assert not get_races().races_found
    return got


def _check_mixed(got, x, ws, out_dtypes):
    """bf16 outputs as _check; fp32 outputs unrounded: within a few fp32 ulps of the summed magnitudes (a bf16
    rounding would be ~2^-9 of the output, far past it)."""
    for g, w, dtype in zip(got, ws, out_dtypes, strict=True):
        if dtype == jnp.bfloat16:
            _check((g,), x, (w,))
            continue
        x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        want = x64 @ w64.T
        assert g.shape == want.shape and g.dtype == jnp.float32
        err = np.abs(np.asarray(g, np.float64) - want)
        assert np.all(err <= 2**-18 * (np.abs(x64) @ np.abs(w64).T)), float(err.max())


MIXED = (jnp.float32, jnp.bfloat16, jnp.float32)  # the MoE's router logits beside bf16 projections
MOE_DTYPES = (jnp.float32,) + (jnp.bfloat16,) * 3  # layers/moe.py in_projections: router logits in fp32


def _moe_in_rows(tp):
    """One rank's rows of the router [E, D], latent_down [Dl, D], shared gate and up [S, D], each split by tp
    (params.py): at TP16 56 / 224 / 384 / 384, none of the first two whole 64-row blocks."""
    cfg = K3Config()
    E, Dl, S = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.shared_intermediate
    return (E // tp, Dl // tp, S // tp, S // tp)


@cpu_only
@pytest.mark.parametrize(
    "B, split_k, steps, x_stream",
    [(3, 2, 3, "M"), (20, 1, 2, "M"), (13, 2, 3, "N"), (5, 1, 3, "N"), (1, 1, 2, "N"), (8, 4, 2, "N")],
)
def test_kernel_interpret_fp32_outputs_match_numpy(B, split_k, steps, x_stream):
    """out_dtypes: fp32 outputs (the fp32 sum: split partials summed unrounded, or with one split the kernel's
    own fp32 write) beside bf16 ones in the same launch, race-free."""
    x, ws = _inputs(rng(), B, 1024, (64, 128, 64))
    _check_mixed(_interpret(x, ws, split_k, steps, x_stream, MIXED), x, ws, MIXED)


# (rows, out_dtypes): one TP16 rank's MoE in-projections scaled down (the router's 56 rows, fp32, a short first and
# only block; latent_down's 224, 3.5 blocks; shared gate / up cut to 72, a block and 8 rows), and short weights beside
# a whole one (8 rows, the least; 64; 136)
SHORT = [((56, 224, 72, 72), MOE_DTYPES), ((8, 64, 136), (jnp.bfloat16, jnp.float32, jnp.bfloat16))]


@cpu_only
@pytest.mark.parametrize("rows, out_dtypes", SHORT)
@pytest.mark.parametrize(
    "B, split_k, steps, x_stream",
    [(1, 1, 2, "N"), (5, 2, 3, "N"), (13, 1, 3, "N"), (8, 4, 2, "N"), (3, 1, 2, "M"), (20, 2, 2, "M"), (64, 1, 2, "M")],
)
def test_kernel_interpret_short_row_blocks_match_numpy(rows, out_dtypes, B, split_k, steps, x_stream):
    """Rows that are not whole 64-row blocks, several weights in one launch, fp32 outputs among them: the last
    block's weight tile past N is the TMA's zeros, the partials' padding is sliced off, and a bf16 output written
    by the kernel (one split) is exactly [B, N] (its TMA store drops the rows past N; a register store there would
    be an out-of-bounds write, which interpret mode raises on); race-free."""
    x, ws = _inputs(rng(), B, 1024, rows)
    _check_mixed(_interpret(x, ws, split_k, steps, x_stream, out_dtypes), x, ws, out_dtypes)


@cpu_only
@pytest.mark.parametrize("B, x_stream", [(5, "N"), (13, "M")])
def test_partials_of_short_row_blocks_are_padded_with_zeros(B, x_stream):
    """partials() of weights of 56 and 200 rows: [S, N_pad, T] ("M": [S, 64, N_pad]) with N_pad the whole blocks
    (64, 256); the rows past N are exact zeros (the weight TMA's fill), the first N summed are the product."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x, ws = _inputs(rng(), B, 512, (56, 200))
    with abstract_gpu("sm90"):
        parts = kernel.partials(
            x, ws, block_k=128, split_k=2, steps=2, x_stream=x_stream, interpret=plgpu.InterpretGPUParams()
        )
    for p, w in zip(parts, ws, strict=True):
        N, N_pad = w.shape[0], -(-w.shape[0] // kernel.ROWS) * kernel.ROWS
        p = np.asarray(p, np.float64)
        p = p if x_stream == "N" else p.transpose(0, 2, 1)  # -> [S, N_pad, T]
        assert p.shape == (2, N_pad, kernel.tokens(B, x_stream))
        assert np.all(p[:, N:] == 0) and np.any(p[:, :N] != 0)
        _check_mixed((p.sum(0)[:N, :B].T.astype(np.float32),), x, (w,), (jnp.float32,))


def test_reference_matches_numpy():
    x, ws = _inputs(rng(), 5, 512, (192, 64))
    _check(reference.gemv(x, ws), x, ws)


def test_reference_fp32_output_is_the_routers_maths():
    """An fp32 output is exactly the router logits' rule (an fp32 HIGHEST einsum of the widened bf16 values,
    exact products), a bf16 one exactly the default's; both against float64."""
    x, ws = _inputs(rng(), 7, 512, (96, 64, 32))
    got = reference.gemv(x, ws, MIXED)
    _check_mixed(got, x, ws, MIXED)
    for g, w, dtype in zip(got, ws, MIXED, strict=True):
        if dtype == jnp.float32:
            f32 = jnp.float32
            want = jnp.einsum("td,ed->te", x.astype(f32), w.astype(f32), precision=jax.lax.Precision.HIGHEST)
        else:
            want = reference.gemv(x, (w,))[0]
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("out_dtypes", [(jnp.float16, jnp.bfloat16), (jnp.float32,)])
def test_out_dtypes_refuses_what_it_cannot_give(out_dtypes):
    """x's dtype or fp32, one per weight: anything else is the caller's error under every policy, not a
    fallback."""
    x, ws = _inputs(rng(), 2, 256, (64, 64))
    for policy in (XLA, SPECIALIZED):
        with pytest.raises(ValueError, match="out_dtypes"):
            api.gemv(x, ws, out_dtypes=out_dtypes, policy=policy)


@cpu_only
@pytest.mark.parametrize(
    "B, launch",
    [
        (1, None),
        (64, None),
        (64, dict(STREAMED, split_k=4, steps=4)),
        (64, STREAMED_N),
        (32, STREAMED_N),
        (12, STREAMED),
        (12, STREAMED_N),
        (37, STREAMED_N),
        (1, STREAMED_N),
        (5, STREAMED_N),
    ],
)
def test_kernel_lowers_for_cuda_at_tp16_shapes(B, launch):
    """One TP16 rank's q/k/v/g (3072 rows) and f_a (128 rows) over D = 7168, with tuning.json's launch (B = 1,
    64) or others (4 splits; tokens on N at 64), and at batches that are not whole 8s (Mosaic's TMA
    refuses an x of 12 rows: the wrapper pads it to 16)."""
    launch = launch or api.pick_launch(B, 7168)
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)  # shapes only: lowering reads no values
    ws = (jax.ShapeDtypeStruct((3072, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((128, 7168), jnp.bfloat16))
    with abstract_gpu("sm90"):
        kernel.check_supported(x, ws, **launch)
        lowered = jax.jit(lambda x, ws: kernel.gemv(x, ws, **launch)).trace(x, ws).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@cpu_only
@pytest.mark.parametrize("B, x_stream", [(1, "N"), (13, "N"), (32, "N"), (40, "M")])
def test_o_proj_launch_lowers_for_cuda(B, x_stream):
    """o_proj at TP16 (D = 768, 7168 rows) with one split, the kernel writing the output itself: on N a row per
    token from the SMEM accumulator (its row layout), on M the token-major accumulator."""
    launch = dict(block_k=128, split_k=1, steps=6, x_stream=x_stream)
    x = jax.ShapeDtypeStruct((B, 768), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct((7168, 768), jnp.bfloat16),)
    with abstract_gpu("sm90"):
        kernel.check_supported(x, ws, **launch)
        lowered = jax.jit(lambda x, ws: kernel.gemv(x, ws, **launch)).trace(x, ws).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text() and lowered.out_info[0].shape == (B, 7168)


@pytest.mark.parametrize("bad", ["batch", "dtype", "rows", "split", "smem", "x_stream"])
def test_kernel_refuses_what_it_cannot_run(bad):
    B, D = {"batch": 65, "smem": 64}.get(bad, 2), 7168 if bad == "smem" else 1024
    x = jnp.ones((B, D), jnp.float32 if bad == "dtype" else jnp.bfloat16)
    launch = dict(
        block_k=128,
        split_k=3 if bad == "split" else 2,
        steps=2,
        x_stream=False if bad == "x_stream" else "M",
    )  # False: the resident-x form, removed
    if bad == "smem":  # 8 stages of a 64 x 256 weight tile and a 64 x 256 x tile: 524 KB
        launch.update(block_k=256, steps=8)
    with pytest.raises(NotImplementedError):
        kernel.check_supported(x, (jnp.ones((100 if bad == "rows" else 128, D), jnp.bfloat16),), **launch)


def test_launches_cover_the_batches_they_claim():
    """tuning.json's launches fit every batch they cover (every batch the kernel takes) and the api refuses (so
    runs XLA) past the last one."""
    ws = (jax.ShapeDtypeStruct((3072, 7168), jnp.bfloat16),)
    served = XLA.table("gemv")["sm90"]["launch"][-1]["max_batch"]
    assert served == kernel.MAX_TOKENS
    for B in range(1, served + 1):
        kernel.check_supported(jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16), ws, **api.pick_launch(B, 7168))
    with pytest.raises(NotImplementedError, match=f"batch {served + 1}"):
        api.pick_launch(served + 1, 7168)


def test_o_proj_launches_cover_what_they_claim():
    """o_proj's launches (its short D: 768 at TP16, 1536 at TP8) fit every batch they cover and write the output
    themselves (split 1, x streamed); outside them the api refuses, so the model's o_proj runs XLA."""
    table = XLA.table("gemv")["sm90"]["o_proj_launch"]
    for D in (768, 1536):
        for B in range(1, kernel.MAX_TOKENS + 1):
            if any(e.get("min_batch", 1) <= B <= e["max_batch"] for e in table):
                launch = api.pick_launch(B, D, table="o_proj_launch")
                kernel.check_supported(
                    jax.ShapeDtypeStruct((B, D), jnp.bfloat16),
                    (jax.ShapeDtypeStruct((7168, D), jnp.bfloat16),),
                    **launch,
                )
            else:
                with pytest.raises(NotImplementedError, match=f"batch {B}: no GEMV o_proj_launch"):
                    api.pick_launch(B, D, table="o_proj_launch")


@pytest.mark.parametrize("tp", [16, 8, 2])
def test_moe_in_launches_cover_what_they_claim(tp):
    """The MoE's router + latent_down + shared gate/up launch (one rank's rows: at TP16 and TP8 the router and
    latent_down are not whole 64-row blocks) fits every batch its table covers (today 1-64), fp32 logits
    included; the rest the api refuses, so the model runs XLA."""
    rows = _moe_in_rows(tp)
    table = XLA.table("gemv")["sm90"]["moe_in_launch"]
    assert api.MAX_BATCH == kernel.MAX_TOKENS
    for B in range(1, api.MAX_BATCH + 1):
        if any(e.get("min_batch", 1) <= B <= e["max_batch"] for e in table):
            launch = api.pick_launch(B, 7168, table="moe_in_launch")
            kernel.check_supported(
                jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16),
                tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in rows),
                **launch,
            )
        else:
            with pytest.raises(NotImplementedError, match=f"batch {B}: no GEMV moe_in_launch"):
                api.pick_launch(B, 7168, table="moe_in_launch")


MLA_IN_ROWS = {16: (1536, 576, 768), 8: (1536, 576, 1536)}  # one rank's q_a, kv_a and g (6 / 12 heads x 128)


def test_mla_in_launches_cover_what_they_claim():
    """The MLA's q_a + kv_a + g launch (one TP16 / TP8 rank's rows, whole 64-row blocks) fits every batch its
    table covers (today 1-64); the rest the api refuses, so the model runs XLA."""
    table = XLA.table("gemv")["sm90"]["mla_in_launch"]
    for rows in MLA_IN_ROWS.values():
        ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in rows)
        for B in range(1, api.MAX_BATCH + 1):
            if any(e.get("min_batch", 1) <= B <= e["max_batch"] for e in table):
                launch = api.pick_launch(B, 7168, table="mla_in_launch")
                kernel.check_supported(jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16), ws, **launch)
            else:
                with pytest.raises(NotImplementedError, match=f"batch {B}: no GEMV mla_in_launch"):
                    api.pick_launch(B, 7168, table="mla_in_launch")


@cpu_only
@pytest.mark.parametrize("tp, B, x_stream", [(16, 1, "N"), (16, 64, "M"), (8, 8, "N"), (8, 40, "M")])
def test_mla_in_launch_lowers_for_cuda(tp, B, x_stream):
    """One rank's q_a, kv_a and g over D = 7168 in one launch, at the MLA's real row counts."""
    launch = dict(block_k=128, split_k=2, steps=6, x_stream=x_stream)
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)
    ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in MLA_IN_ROWS[tp])
    with abstract_gpu("sm90"):
        kernel.check_supported(x, ws, **launch)
        lowered = jax.jit(lambda x, ws: kernel.gemv(x, ws, **launch)).trace(x, ws).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert [o.shape for o in lowered.out_info] == [(B, n) for n in MLA_IN_ROWS[tp]]


@cpu_only
@pytest.mark.parametrize("tp", [16, 8, 2])
@pytest.mark.parametrize(
    "B, split_k, x_stream", [(1, 2, "N"), (5, 1, "N"), (13, 1, "N"), (8, 7, "N"), (40, 2, "M"), (64, 1, "M")]
)
def test_moe_in_launch_lowers_for_cuda_with_fp32_logits(tp, B, split_k, x_stream):
    """One rank's router (fp32 logits), latent_down and shared gate/up over D = 7168 in one launch, exactly
    [B, N] each: at TP16 (56 / 224 / 384 rows) and TP8 (112 / 448 / 768) short last blocks, at TP2 whole ones."""
    launch = dict(block_k=128, split_k=split_k, steps=6, x_stream=x_stream)
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)
    rows = _moe_in_rows(tp)
    ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in rows)
    with abstract_gpu("sm90"):
        kernel.check_supported(x, ws, **launch)
        f = jax.jit(lambda x, ws: kernel.gemv(x, ws, out_dtypes=MOE_DTYPES, **launch))
        lowered = f.trace(x, ws).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    want = [((B, n), jnp.dtype(d)) for n, d in zip(rows, MOE_DTYPES, strict=True)]
    assert [(o.shape, o.dtype) for o in lowered.out_info] == want


def _policy_with(table, arch="sm90", **launch):
    """The decode policy with one gemv table of the body `arch` holding `launch` for every batch (none: the table
    emptied, so the api refuses every batch and the reference runs)."""
    files = XLA.table("gemv")  # the parsed file, shared: copied, never changed
    entries = [dict(max_batch=kernel.MAX_TOKENS, **launch)] if launch else []
    gemv = {**files, arch: {**files[arch], table: entries}}
    return DecodePolicy("latency_specialized", tuning=Tuning.from_files(gemv=gemv))


@cpu_only
@pytest.mark.parametrize("B, split_k, x_stream", [(1, 1, "N"), (24, 2, "M")])
def test_moe_in_api_takes_the_kernel_once_its_table_has_an_entry(B, split_k, x_stream):
    """The MoE's call (layers/moe.py in_projections: table moe_in_launch, fp32 logits) with one TP16 rank's
    weights, lowered for CUDA on an abstract H100: with an entry the api launches the kernel (no XLA dot in the
    program); with an empty table it runs the reference."""
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)
    ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in _moe_in_rows(16))
    filled = _policy_with("moe_in_launch", block_k=128, split_k=split_k, steps=6, x_stream=x_stream)
    for policy, kernel_runs in ((filled, True), (_policy_with("moe_in_launch"), False)):
        with abstract_gpu("sm90"):
            f = jax.jit(lambda x, ws, p=policy: api.gemv(x, ws, out_dtypes=MOE_DTYPES, policy=p, table="moe_in_launch"))
            text = f.trace(x, ws).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mosaic_gpu" in text, "dot_general" in text) == (kernel_runs, not kernel_runs)


def test_api_falls_back_to_the_reference_off_hopper(caplog):
    x, ws = _inputs(rng(), 2, 256, (64,))
    got = api.gemv(x, ws, policy=SPECIALIZED)  # CPU: no sm90, the reference runs
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(reference.gemv(x, ws)[0], np.float32))
    x, ws = _inputs(rng(), 3, 256, (64, 128, 64))
    got = api.gemv(x, ws, out_dtypes=MIXED, policy=SPECIALIZED)
    assert [g.dtype for g in got] == [jnp.dtype(d) for d in MIXED]
    for g, want in zip(got, reference.gemv(x, ws, MIXED), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError):
        api.gemv(x, ws, policy=DecodePolicy("fast"))


@gpu_only
@pytest.mark.parametrize("B", [1, 8, 12, 24, 64])
@pytest.mark.parametrize("rows", [(3072, 128), (6144, 128), (7168,)])
def test_api_on_gpu_matches_numpy(B, rows):
    """One TP16 / TP8 rank's q/k/v/g + f_a, and o_proj's shape, through the api (the kernel on sm90)."""
    D = 768 if rows == (7168,) else 7168
    x, ws = _inputs(rng(), B, D, rows)
    _check(api.run_kernel(x, ws), x, ws)  # the kernel itself: raises rather than falling back


@gpu_only
@pytest.mark.parametrize("B, D", [(64, 768), (64, 1536), (24, 768), (37, 768), (1, 1536), (8, 1536)])
def test_o_proj_on_gpu_matches_numpy(B, D):
    """o_proj's launch through the api at TP16 / TP8 widths (on M the kernel writes the rounded output itself)."""
    x, ws = _inputs(rng(), B, D, (7168,))
    _check(api.run_kernel(x, ws, "o_proj_launch"), x, ws)


@gpu_only
@pytest.mark.parametrize("launch", ["M", "N"])
@pytest.mark.parametrize("rows", [(3072, 128), (6144, 128)])
def test_kernel_on_gpu_at_batch_64_matches_numpy(rows, launch):
    """64 tokens at TP16 / TP8 widths: the tokens on M or on N."""
    x, ws = _inputs(rng(), 64, 7168, rows)
    launch = {"M": STREAMED, "N": STREAMED_N}[launch]
    _check(kernel.gemv(x, ws, **launch), x, ws)


@gpu_only
@pytest.mark.parametrize("B", [1, 5, 12, 32])
@pytest.mark.parametrize("rows", [(3072, 128), (7168,)])
def test_streamed_tokens_on_n_on_gpu_matches_numpy(B, rows):
    """x streamed with the tokens on WGMMA's N (a [round8(B), block_k] tile, x unpadded) at TP16 widths: q/k/v/g
    + f_a over D = 7168 (split 2) and o_proj's over D = 768 (split 1, partials summed by the wrapper)."""
    D = 768 if rows == (7168,) else 7168
    x, ws = _inputs(rng(), B, D, rows)
    _check(kernel.gemv(x, ws, **dict(STREAMED_N, split_k=1 if D == 768 else 2)), x, ws)


@gpu_only
@pytest.mark.parametrize("B", [1, 5, 8, 64])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("split_k, x_stream", [(1, "N"), (2, "N"), (1, "M"), (2, "M"), (7, "N")])
def test_moe_in_on_gpu_matches_numpy(B, tp, split_k, x_stream):
    """One TP16 / TP8 rank's MoE in-projections (router fp32 logits; latent_down and shared gate/up bf16) in one
    launch through the api with a moe_in_launch entry: short last row blocks (56 and 224 rows at TP16, 112 and
    448 at TP8), split 1 (the kernel writes the outputs, a short weight's through its TMA store) or partials."""
    x, ws = _inputs(rng(), B, 7168, _moe_in_rows(tp))
    policy = _policy_with("moe_in_launch", block_k=128, split_k=split_k, steps=6, x_stream=x_stream)
    got = api.run_kernel(x, ws, "moe_in_launch", policy, MOE_DTYPES)  # the kernel itself: raises, never falls back
    _check_mixed(got, x, ws, MOE_DTYPES)


# ---- the pairs' GEMV: Σ_j x_j @ w_jᵀ into one output (the MoE's finish: latent_up + shared_down) --------------
def _moe_out_ks(tp):
    """One rank's K of latent_up [D, Dl] and shared_down [D, S], split by their inputs (params.py): TP16 224 and
    384 (224 not a whole 64-column swizzle row), TP8 448 and 768."""
    cfg = K3Config()
    return cfg.routed_expert_hidden_size // tp, cfg.shared_intermediate // tp


def _pairs(r, B, N, Ks, dtype=jnp.bfloat16, integers=False):
    """Fresh x_j [B, K_j] and w_j [N, K_j]; integers: small whole numbers, whose fp32 sums are exact (any order)."""
    if integers:
        xs = tuple(jnp.asarray(r.integers(-15, 16, (B, K)), dtype) for K in Ks)
        return xs, tuple(jnp.asarray(r.integers(-15, 16, (N, K)), dtype) for K in Ks)
    xs = tuple(jnp.asarray(r.standard_normal((B, K)), dtype) for K in Ks)
    return xs, tuple(jnp.asarray(r.standard_normal((N, K)) * K**-0.5, dtype) for K in Ks)


def _rounded(a, dtype):
    return np.asarray(jnp.asarray(np.asarray(a, np.float32), dtype), np.float64)


def _sum_model(xs, ws, dtype):
    """The model's sum of products from the maths, in float64 (docs/model.md §6 step 5): each product exact,
    rounded to the activation dtype (a GEMM's one rounding), then the rounded products added in order, each add
    rounded. -> (the sum, each product exact)."""
    products = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for x, w in zip(xs, ws, strict=True)]
    y = _rounded(products[0], dtype)
    for p in products[1:]:
        y = _rounded(y + _rounded(p, dtype), dtype)
    return y, products


def _check_sum(got, xs, ws, dtype=jnp.bfloat16):
    """got against the float64 model: the fp32 sums' order may move each product's rounding by one ulp, so
    within an ulp of every product and of the sum (2^-8 relative in bf16, 2^-23 in fp32), and a wrong pair, a
    missed block or garbage past K_j is far past that."""
    want, products = _sum_model(xs, ws, dtype)
    ulp = 2.0 ** -(jnp.finfo(dtype).nmant)
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
    err = np.abs(np.asarray(got, np.float64) - want)
    bound = ulp * (sum(np.abs(p) for p in products) + np.abs(want)) + 1e-6 * np.max(np.abs(want))
    assert np.all(err <= bound), float((err / bound).max())


def _interpret_sum(xs, ws, arch="sm90", **launch):
    """The pairs' kernel in interpret mode on an abstract H100 (arch "sm100": the Blackwell body on a B200),
    race-checked."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    with abstract_gpu(arch):
        BODIES[arch].check_sum_supported(xs, ws, **launch)
        got = BODIES[arch].gemv_sum(xs, ws, interpret=plgpu.InterpretGPUParams(detect_races=True), **launch)
    assert not get_races().races_found
    return got


@cpu_only
@pytest.mark.parametrize(
    "B, N, Ks, block_k, steps, x_stream",
    [
        (1, 128, (224, 384), 128, 3, "N"),  # TP16's K: 3 lockstep steps of 96 (64-byte swizzle) + 128 columns
        (5, 64, (224, 384), 192, 2, "N"),  # 2 steps of 128 + 192: latent_up's last 32 columns the TMA's zeros
        (12, 128, (224, 384), 256, 2, "N"),  # 12 tokens: x padded to 16 rows
        (13, 64, (224, 96), 128, 2, "M"),
        (64, 64, (224, 384), 192, 2, "M"),
        (20, 128, (96, 160, 64), 128, 2, "M"),  # three pairs: the adds chained in order
        (3, 64, (80, 144), 64, 3, "N"),  # 32-byte swizzles (80, 144: 16-column rows), 32 + 48 columns a step
        (37, 64, (448, 128), 256, 2, "N"),  # TP8's latent_up K: 2 steps of 256 + 64
    ],
)
def test_sum_kernel_interpret_matches_numpy(B, N, Ks, block_k, steps, x_stream):
    """Σ_j x_j @ w_jᵀ in one launch against the float64 model, K_j not multiples of the block (nor of 128),
    batches not whole 8s, the tokens on N or M, race-free."""
    xs, ws = _pairs(rng(), B, N, Ks)
    _check_sum(_interpret_sum(xs, ws, block_k=block_k, steps=steps, x_stream=x_stream), xs, ws)


@cpu_only
@pytest.mark.parametrize("rank", [0, 5, 15])
@pytest.mark.parametrize("B, block_k, x_stream", [(1, 192, "N"), (6, 128, "N"), (13, 192, "M")])
def test_sum_kernel_reads_a_window_of_x_in_place(rank, B, block_k, x_stream):
    """latent_up's x as one rank's 224 columns of the replicated [B, 16 x 224] latent (the MoE's finish under
    TP, x_starts): the same result as the sliced x, bit for bit, though the window's last block reads its
    neighbour's columns (w's zeros there) or, for the last rank, past x's end; a traced start."""
    g = rng()
    xs, ws = _pairs(g, B, 128, (224, 384))
    wide = (
        jnp.asarray(g.standard_normal((B, 16 * 224)) * 4, jnp.bfloat16).at[:, rank * 224 : (rank + 1) * 224].set(xs[0])
    )
    launch = dict(block_k=block_k, steps=2, x_stream=x_stream)
    with abstract_gpu("sm90"):
        kernel.check_sum_supported(xs, ws, **launch)
        interp = plgpu.InterpretGPUParams(detect_races=True)
        f = jax.jit(
            lambda wide, x1, ws, r: kernel.gemv_sum(
                (wide, x1), ws, x_starts=(r * 224, None), interpret=interp, **launch
            )
        )
        got = f(wide, xs[1], ws, jnp.int32(rank))
        want = kernel.gemv_sum(xs, ws, interpret=interp, **launch)
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    assert not get_races().races_found
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(
        np.asarray(reference.gemv_sum((wide, xs[1]), ws, x_starts=(rank * 224, None)), np.float32),
        np.asarray(reference.gemv_sum(xs, ws), np.float32),
    )


@cpu_only
@pytest.mark.parametrize("x_stream", ["N", "M"])
def test_sum_kernel_rounds_each_product_then_their_sum(x_stream):
    """Whole-number inputs, whose fp32 sums are exact in any order: the kernel equals the model's two roundings
    (each product to bf16, then the bf16 add) bit for bit, and so does the reference; one rounding of the fp32
    sum differs in many places (so this test tells the two apart)."""
    xs, ws = _pairs(rng(), 6, 128, (224, 384), integers=True)
    want, products = _sum_model(xs, ws, jnp.bfloat16)
    got = _interpret_sum(xs, ws, block_k=192, steps=2, x_stream=x_stream)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    np.testing.assert_array_equal(np.asarray(reference.gemv_sum(xs, ws), np.float64), want)
    assert np.mean(_rounded(products[0] + products[1], jnp.bfloat16) != want) > 0.05


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sum_reference_matches_numpy(dtype):
    """The reference (the model's XLA path) in the serving dtype and in fp32 (verification: the roundings are
    fp32's), against the float64 model."""
    xs, ws = _pairs(rng(), 7, 192, (224, 384), dtype)
    _check_sum(reference.gemv_sum(xs, ws), xs, ws, dtype)


def test_sum_api_falls_back_to_the_reference_off_hopper_and_in_fp32():
    """On CPU (no sm90), and for fp32 activations under any device (the kernel is bf16 only), the api runs the
    reference: equal to it bit for bit, the choice recorded."""
    from pallas_kernels import policy as policy_lib

    for dtype in (jnp.bfloat16, jnp.float32):
        xs, ws = _pairs(rng(), 3, 128, (224, 384), dtype)
        with policy_lib.recording(policy_lib.DispatchLog()) as log:
            got = api.gemv_sum(xs, ws, policy=SPECIALIZED)
        assert log.ops["gemv_sum moe_out_launch"]["impl"] == "xla"
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference.gemv_sum(xs, ws)))
        _check_sum(got, xs, ws, dtype)


@pytest.mark.parametrize("tp", [16, 8, 4, 2])
def test_moe_out_launches_cover_what_they_claim(tp):
    """The MoE finish's launch (one rank's latent_up and shared_down: K 224 + 384 at TP16, 448 + 768 at TP8, N =
    7168) fits every batch its table covers (today 1-64); the rest the api refuses, so the model runs XLA."""
    table = XLA.table("gemv")["sm90"]["moe_out_launch"]
    Ks = _moe_out_ks(tp)
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    for B in range(1, api.MAX_BATCH + 1):
        xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
        if any(e.get("min_batch", 1) <= B <= e["max_batch"] for e in table):
            kernel.check_sum_supported(xs, ws, **api.pick_launch(B, max(Ks), table="moe_out_launch"))
        else:
            with pytest.raises(NotImplementedError, match=f"batch {B}: no GEMV moe_out_launch"):
                api.pick_launch(B, max(Ks), table="moe_out_launch")


def test_pair_blocks_cover_each_k_in_lockstep():
    """Every pair gets the same steps, a block width that is a multiple of a swizzle row dividing its K, and
    no empty last block; where no width does, a refusal (the api then runs XLA)."""
    assert kernel.pair_blocks((224, 384), 192) == (2, (128, 192), (64, 128))
    assert kernel.pair_blocks((224, 384), 128) == (3, (96, 128), (64, 128))
    assert kernel.pair_blocks((448, 768), 192) == (4, (128, 192), (128, 128))
    assert kernel.pair_blocks((448, 768), 128) == (6, (80, 128), (32, 128))  # 448 in 6: 16-column rows
    for Ks in [(224, 384), (448, 768), (896, 1536), (80, 144), (96, 160, 64)]:
        for block_k in (64, 128, 192, 256):
            try:
                n, bks, sws = kernel.pair_blocks(Ks, block_k)
            except NotImplementedError:
                continue
            for K, bk, sw in zip(Ks, bks, sws, strict=True):
                assert bk <= block_k and bk % (sw // 2) == 0 and K % (sw // 2) == 0 and (n - 1) * bk < K <= n * bk
    with pytest.raises(NotImplementedError, match="empty last block"):
        kernel.pair_blocks((448, 768), 64)  # 12 steps: 448 in 12 blocks of 48 leaves the last empty
    with pytest.raises(NotImplementedError, match="multiple of"):
        kernel.pair_blocks((224, 384), 96)


@pytest.mark.parametrize("bad", ["dtype", "batch", "n", "rows", "k", "split", "smem", "pairs", "x_stream"])
def test_sum_kernel_refuses_what_it_cannot_run(bad):
    B = 65 if bad == "batch" else 64 if bad == "smem" else 2
    Ks = (224, 136) if bad == "k" else (224, 384)
    dtype = jnp.float32 if bad == "dtype" else jnp.bfloat16
    xs = tuple(jax.ShapeDtypeStruct((B, K), dtype) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((7168 + (100 if bad == "rows" else 0), K), jnp.bfloat16) for K in Ks)
    if bad == "n":  # the pairs' N differ
        ws = (ws[0], jax.ShapeDtypeStruct((7104, Ks[1]), jnp.bfloat16))
    if bad == "pairs":
        xs = xs[:1]
    launch = dict(block_k=192, split_k=2 if bad == "split" else 1, steps=2, x_stream="Q" if bad == "x_stream" else "M")
    if bad == "smem":  # 4 steps of TP8-like blocks at 64 tokens: 2 x (64 + 64) x (256 + 384) x 2 > 227 KB
        xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in (512, 768))
        ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in (512, 768))
        launch.update(block_k=384, steps=2)
    with pytest.raises(NotImplementedError):
        kernel.check_sum_supported(xs, ws, **launch)


@cpu_only
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize(
    "B, block_k, steps, x_stream",
    [(1, 192, 4, "N"), (8, 192, 4, "N"), (9, 192, 2, "M"), (64, 192, 2, "M")]  # the predicted table (tuning _doc)
    + [(1, 128, 6, "N"), (13, 256, 2, "N"), (33, 192, 2, "N"), (64, 192, 2, "N"), (40, 128, 2, "M")],
)
def test_sum_kernel_lowers_for_cuda_at_moe_out_shapes(tp, B, block_k, steps, x_stream):
    """One TP16 / TP8 rank's latent_up + shared_down (N = 7168, K 224 + 384 / 448 + 768) in one launch, with
    the launches tuning.json's moe_out_launch _doc predicts and others, exactly [B, 7168] bf16."""
    Ks = _moe_out_ks(tp)
    launch = dict(block_k=block_k, split_k=1, steps=steps, x_stream=x_stream)
    xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    with abstract_gpu("sm90"):
        kernel.check_sum_supported(xs, ws, **launch)
        f = jax.jit(lambda xs, ws: kernel.gemv_sum(xs, ws, **launch))
        lowered = f.trace(xs, ws).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert (lowered.out_info.shape, lowered.out_info.dtype) == ((B, 7168), jnp.bfloat16)


@cpu_only
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("B, x_stream", [(1, "N"), (64, "M")])
def test_sum_kernel_lowers_for_cuda_reading_a_rank_window(tp, B, x_stream):
    """The MoE finish under tp: latent_up's x a traced window of the whole [B, 3584] latent (x_starts)."""
    Ks = _moe_out_ks(tp)
    launch = dict(block_k=192, split_k=1, steps=2, x_stream=x_stream)
    xs = (jax.ShapeDtypeStruct((B, 3584), jnp.bfloat16), jax.ShapeDtypeStruct((B, Ks[1]), jnp.bfloat16))
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    with abstract_gpu("sm90"):
        f = jax.jit(lambda xs, ws, r: kernel.gemv_sum(xs, ws, x_starts=(r * Ks[0], None), **launch))
        lowered = f.trace(xs, ws, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert (lowered.out_info.shape, lowered.out_info.dtype) == ((B, 7168), jnp.bfloat16)


@cpu_only
@pytest.mark.parametrize("B", [1, 24])
def test_moe_out_api_takes_the_kernel_once_its_table_has_an_entry(B):
    """The MoE finish's call (layers/moe.py finish: table moe_out_launch) with one TP16 rank's weights, lowered
    for CUDA on an abstract H100: with an entry the api launches the kernel (no XLA dot in the program); with an
    empty table it runs the reference (two dots and the add)."""
    Ks = _moe_out_ks(16)
    xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    filled = _policy_with("moe_out_launch", block_k=192, split_k=1, steps=2, x_stream="N" if B == 1 else "M")
    for policy, kernel_runs in ((filled, True), (_policy_with("moe_out_launch"), False)):
        with abstract_gpu("sm90"):
            f = jax.jit(lambda xs, ws, p=policy: api.gemv_sum(xs, ws, policy=p, table="moe_out_launch"))
            text = f.trace(xs, ws).lower(lowering_platforms=("cuda",)).as_text()
        assert ("mosaic_gpu" in text, "dot_general" in text) == (kernel_runs, not kernel_runs)


@gpu_only
@pytest.mark.parametrize("B", [1, 5, 8, 9, 13, 64])
@pytest.mark.parametrize("tp", [16, 8])
@pytest.mark.parametrize("launch", ["k192 s4 N", "k192 s2 M", "k128 s6 N", "k256 s2 N"])
def test_moe_out_on_gpu_matches_numpy(B, tp, launch):
    """One TP16 / TP8 rank's latent_up + shared_down in one launch (the kernel itself: raises, never falls back;
    the first two the table tuning.json's _doc predicts) against the float64 model, and against XLA's reference
    on the same GPU (the same roundings: up to the fp32 sums' order, an ulp)."""
    Ks = _moe_out_ks(tp)
    xs, ws = _pairs(rng(), B, 7168, Ks)
    bk, st, stream = launch.split()
    params = dict(block_k=int(bk[1:]), split_k=1, steps=int(st[1:]), x_stream=stream)
    try:
        kernel.check_sum_supported(xs, ws, **params)
    except NotImplementedError as e:
        pytest.skip(str(e))  # e.g. block_k 128 at TP8 (an empty last block), or too much SMEM
    got = kernel.gemv_sum(xs, ws, **params)
    _check_sum(got, xs, ws)
    xla = np.asarray(jax.jit(reference.gemv_sum)(xs, ws), np.float64)
    _, products = _sum_model(xs, ws, jnp.bfloat16)
    bound = 2**-8 * (sum(np.abs(p) for p in products) + np.abs(xla)) + 1e-6 * np.max(np.abs(xla))
    assert np.all(np.abs(np.asarray(got, np.float64) - xla) <= bound)


# ---- the Blackwell body (kernel_sm100: tcgen05, accumulators in TMEM), on CPU under an abstract B200 ----------
# No Blackwell GPU here: interpret mode and CUDA lowering only. Its partials pad to 128-row blocks and 16 tokens.
SM100_TABLES = ("launch", "o_proj_launch", "moe_in_launch", "mla_in_launch", "moe_out_launch")


@cpu_only
@pytest.mark.parametrize(
    "rows, out_dtypes",
    [((128, 56), (jnp.bfloat16, jnp.float32)), ((56, 224, 136, 72), MOE_DTYPES), ((256,), (jnp.bfloat16,))],
)
@pytest.mark.parametrize("B, split_k, steps", [(1, 1, 2), (5, 2, 3), (16, 1, 2), (13, 4, 2), (37, 2, 2), (64, 1, 3)])
def test_sm100_kernel_interpret_matches_numpy(rows, out_dtypes, B, split_k, steps):
    """Several weights in one launch, short last 128-row blocks among them (56: a short first and only block; 224,
    136, 72), fp32 outputs beside bf16 ones, one split (the kernel writes a bf16 output itself, exactly [B, N]) or
    several (fp32 partials), batches of 1 to 64 not whole 16s: tcgen05 and TMEM simulated, race-free."""
    x, ws = _inputs(rng(), B, 1024, rows)
    _check_mixed(_interpret(x, ws, split_k, steps, "N", out_dtypes, arch="sm100"), x, ws, out_dtypes)


@cpu_only
@pytest.mark.parametrize("B", [3, 20])
def test_sm100_partials_of_short_row_blocks_are_padded_with_zeros(B):
    """partials() of weights of 56 and 200 rows: [S, N_pad, T] with N_pad whole 128-row blocks (128, 256) and T the
    batch in 16s; the rows past N are exact zeros (the weight TMA's fill), the first N summed are the product."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x, ws = _inputs(rng(), B, 512, (56, 200))
    with abstract_gpu("sm100"):
        parts = kernel_sm100.partials(x, ws, block_k=128, split_k=2, steps=2, interpret=plgpu.InterpretGPUParams())
    for p, w in zip(parts, ws, strict=True):
        N, N_pad = w.shape[0], -(-w.shape[0] // kernel_sm100.ROWS) * kernel_sm100.ROWS
        p = np.asarray(p, np.float64)
        assert p.shape == (2, N_pad, kernel_sm100.tokens(B)) and kernel_sm100.tokens(B) % 16 == 0
        assert np.all(p[:, N:] == 0) and np.any(p[:, :N] != 0)
        _check_mixed((p.sum(0)[:N, :B].T.astype(np.float32),), x, (w,), (jnp.float32,))


@cpu_only
@pytest.mark.parametrize(
    "B, N, Ks, block_k, steps",
    [
        (1, 128, (224, 384), 192, 2),  # TP16's K: 2 lockstep steps of 128 (64-byte swizzle) + 192 columns
        (5, 256, (224, 384), 128, 3),  # 3 steps of 96 + 128
        (16, 128, (448, 128), 256, 2),  # TP8's latent_up K: 2 steps of 256 + 64
        (20, 128, (96, 160, 64), 128, 2),  # three pairs: the adds chained in order
        (64, 128, (80, 144), 64, 3),  # 32-byte swizzles (16-column rows), 32 + 48 columns a step
    ],
)
def test_sm100_sum_kernel_interpret_matches_numpy(B, N, Ks, block_k, steps):
    """The pairs' sum on the Blackwell body against the float64 model: each pair's accumulator in its own TMEM
    columns, K_j not multiples of the block, batches not whole 16s, race-free."""
    xs, ws = _pairs(rng(), B, N, Ks)
    _check_sum(_interpret_sum(xs, ws, arch="sm100", block_k=block_k, steps=steps), xs, ws)


@cpu_only
def test_sm100_sum_kernel_rounds_each_product_then_their_sum():
    """Whole-number inputs (fp32 sums exact in any order): the Blackwell kernel equals the model's two roundings
    bit for bit, which one rounding of the fp32 sum would not."""
    xs, ws = _pairs(rng(), 6, 128, (224, 384), integers=True)
    want, products = _sum_model(xs, ws, jnp.bfloat16)
    got = _interpret_sum(xs, ws, arch="sm100", block_k=192, steps=2)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    assert np.mean(_rounded(products[0] + products[1], jnp.bfloat16) != want) > 0.05


def _lower_sm100(f, *args):
    with abstract_gpu("sm100"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@cpu_only
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize(
    "table, rows, out_dtypes",
    [
        ("launch", (3072, 128), None),  # one TP16 rank's KDA q/k/v/g and f_a
        ("moe_in_launch", (56, 224, 384, 384), MOE_DTYPES),  # its MoE router (fp32 logits), latent_down, shared gate/up
        ("mla_in_launch", MLA_IN_ROWS[16], None),  # its MLA q_a, kv_a and g
    ],
)
@pytest.mark.parametrize("split_k", [None, 1])
def test_sm100_kernel_lowers_for_cuda_at_tp16_shapes(B, table, rows, out_dtypes, split_k):
    """One TP16 rank's projections over D = 7168 with tuning.json's sm100 launch (or it with one split and the
    stages that fit: the kernel writes the outputs by TMA stores, a short weight's too) lower for a B200, exactly
    [B, N_i] each."""
    launch = api.pick_launch(B, 7168, table=table, arch="sm100")
    if split_k:  # one split: the output tiles take SMEM, so as many of the table's stages as still fit
        fits = [s for s in range(2, launch["steps"] + 1) if kernel_sm100.smem_bytes(B, 7168, 128, 1, s) <= 227 * 1024]
        launch.update(split_k=split_k, steps=fits[-1])
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)  # shapes only: lowering reads no values
    ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in rows)
    kernel_sm100.check_supported(x, ws, **launch)
    lowered = _lower_sm100(lambda x, ws: kernel_sm100.gemv(x, ws, out_dtypes=out_dtypes, **launch), x, ws)
    assert "mosaic_gpu" in lowered.as_text()
    dtypes = out_dtypes or (jnp.bfloat16,) * len(rows)
    assert [(o.shape, o.dtype) for o in lowered.out_info] == [
        ((B, n), jnp.dtype(d)) for n, d in zip(rows, dtypes, strict=True)
    ]


@cpu_only
@pytest.mark.parametrize("B", [1, 8, 64])
def test_sm100_o_proj_and_moe_out_lower_for_cuda_at_tp16_shapes(B):
    """o_proj (D = 768, 7168 rows, one split) and the MoE finish (latent_up + shared_down, K 224 + 384, N = 7168)
    with tuning.json's sm100 launches lower for a B200, exactly [B, 7168] bf16."""
    launch = api.pick_launch(B, 768, table="o_proj_launch", arch="sm100")
    x, ws = jax.ShapeDtypeStruct((B, 768), jnp.bfloat16), (jax.ShapeDtypeStruct((7168, 768), jnp.bfloat16),)
    kernel_sm100.check_supported(x, ws, **launch)
    lowered = _lower_sm100(lambda x, ws: kernel_sm100.gemv(x, ws, **launch), x, ws)
    assert "mosaic_gpu" in lowered.as_text() and lowered.out_info[0].shape == (B, 7168)
    Ks = _moe_out_ks(16)
    launch = api.pick_launch(B, max(Ks), table="moe_out_launch", arch="sm100")
    xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    kernel_sm100.check_sum_supported(xs, ws, **launch)
    lowered = _lower_sm100(lambda xs, ws: kernel_sm100.gemv_sum(xs, ws, **launch), xs, ws)
    assert "mosaic_gpu" in lowered.as_text()
    assert (lowered.out_info.shape, lowered.out_info.dtype) == ((B, 7168), jnp.bfloat16)


@pytest.mark.parametrize("tp", [16, 8])
def test_sm100_launches_cover_what_they_claim(tp):
    """tuning.json's sm100 tables (first defaults, not measured) fit every batch they cover at one TP16 / TP8
    rank's shapes, tokens on N throughout; past them the api refuses, so XLA runs."""
    cases = {  # D and the rows: q/k/v/g + f_a, o_proj (its short D), the MoE's and MLA's in-projections
        "launch": (7168, (3072 * 16 // tp, 128)),
        "o_proj_launch": (768 * 16 // tp, (7168,)),
        "moe_in_launch": (7168, _moe_in_rows(tp)),
        "mla_in_launch": (7168, MLA_IN_ROWS[tp]),
    }
    for table in SM100_TABLES:
        entries = XLA.table("gemv")["sm100"][table]
        assert all(e["x_stream"] == "N" for e in entries)
        assert entries[-1]["max_batch"] == kernel_sm100.MAX_TOKENS
        for B in range(1, kernel_sm100.MAX_TOKENS + 1):
            if table == "moe_out_launch":
                Ks = _moe_out_ks(tp)
                launch = api.pick_launch(B, max(Ks), table=table, arch="sm100")
                kernel_sm100.check_sum_supported(
                    tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks),
                    tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks),
                    **launch,
                )
                continue
            D, rows = cases[table]
            launch = api.pick_launch(B, D, table=table, arch="sm100")
            kernel_sm100.check_supported(
                jax.ShapeDtypeStruct((B, D), jnp.bfloat16),
                tuple(jax.ShapeDtypeStruct((n, D), jnp.bfloat16) for n in rows),
                **launch,
            )
        with pytest.raises(NotImplementedError, match=f"batch {kernel_sm100.MAX_TOKENS + 1}"):
            api.pick_launch(kernel_sm100.MAX_TOKENS + 1, 7168, table=table, arch="sm100")


@pytest.mark.parametrize("bad", ["x_stream", "steps", "batch", "rows", "smem"])
def test_sm100_kernel_refuses_what_it_cannot_run(bad):
    """The tokens on M (not in the sm100 body), a single stage, the checks shared with kernel.py, SMEM."""
    B, D = {"batch": 65, "smem": 64}.get(bad, 2), 7168 if bad == "smem" else 1024
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct((100 if bad == "rows" else 128, D), jnp.bfloat16),)
    launch = dict(block_k=128, split_k=2, steps=1 if bad == "steps" else 2, x_stream="M" if bad == "x_stream" else "N")
    if bad == "smem":  # 6 stages of (128 + 64) x 128 bf16: 288 KB
        launch.update(steps=6)
    with pytest.raises(
        NotImplementedError,
        match={
            "x_stream": "tokens on N only",
            "steps": "steps 1",
            "batch": "batch 65",
            "rows": "multiple of 8",
            "smem": "SMEM",
        }[bad],
    ):
        kernel_sm100.check_supported(x, ws, **launch)


@pytest.mark.parametrize("bad", ["x_stream", "n", "tmem", "smem"])
def test_sm100_sum_kernel_refuses_what_it_cannot_run(bad):
    """The tokens on M, N not whole 128-row blocks (7104 is whole 64s: sm90 takes it), more accumulators than
    TMEM's 512 columns (9 pairs of 64 tokens), SMEM."""
    B = 64 if bad in ("tmem", "smem") else 2
    Ks = (128,) * 9 if bad == "tmem" else (224, 384)  # tmem: two steps of 64 columns a pair
    N = 7104 if bad == "n" else 7168
    xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((N, K), jnp.bfloat16) for K in Ks)
    # smem: block_k 192's two stages at 64 tokens, 2 x (128 + 64) x (128 + 192) x 2 bytes, and the output tiles
    launch = dict(block_k=64 if bad == "tmem" else 192, steps=2, x_stream="M" if bad == "x_stream" else "N")
    with pytest.raises(
        NotImplementedError,
        match={"x_stream": "tokens on N only", "n": "whole 128-row", "tmem": "TMEM", "smem": "SMEM"}[bad],
    ):
        kernel_sm100.check_sum_supported(xs, ws, **launch)


def test_api_picks_the_body_by_compute_capability():
    """9.x: kernel.py (sm90's tables), 10.x (B200's 10.0, GB300's 10.3): kernel_sm100 (sm100's); anything else a
    one-line refusal, so XLA runs. Under an abstract B200 the api's body is the Blackwell one."""
    assert api.body((9, 0)) == ("sm90", kernel)
    assert api.body((10, 0)) == api.body((10, 3)) == ("sm100", kernel_sm100)
    for arch in ((8, 0), (12, 0)):
        with pytest.raises(NotImplementedError, match="sm90 .* or sm100"):
            api.body(arch)
    with abstract_gpu("sm100"):
        assert api.body() == ("sm100", kernel_sm100)
    with abstract_gpu("sm90"):
        assert api.body() == ("sm90", kernel)
    assert api.pick_launch(64, 7168) == dict(block_k=128, split_k=2, steps=6, x_stream="M")  # sm90 by default
    assert api.pick_launch(64, 7168, arch="sm100")["x_stream"] == "N"


@cpu_only
@pytest.mark.parametrize("B", [1, 24])
def test_sm100_api_takes_the_kernel_on_a_b200(B):
    """The MoE's in-projections (fp32 logits) and finish through the api with the default tables, lowered for
    CUDA on an abstract B200: the Blackwell kernel runs (no XLA dot in the program); with a launch asking for the
    tokens on M (not in the sm100 body) or an emptied table, the reference runs."""
    x = jax.ShapeDtypeStruct((B, 7168), jnp.bfloat16)
    ws = tuple(jax.ShapeDtypeStruct((n, 7168), jnp.bfloat16) for n in _moe_in_rows(16))
    on_m = _policy_with("moe_in_launch", arch="sm100", block_k=128, split_k=2, steps=4, x_stream="M")
    for policy, kernel_runs in ((SPECIALIZED, True), (on_m, False), (_policy_with("moe_in_launch", "sm100"), False)):
        f = lambda x, ws, p=policy: api.gemv(x, ws, out_dtypes=MOE_DTYPES, policy=p, table="moe_in_launch")  # noqa: E731
        text = _lower_sm100(f, x, ws).as_text()
        assert ("mosaic_gpu" in text, "dot_general" in text) == (kernel_runs, not kernel_runs)
    Ks = _moe_out_ks(16)
    xs = tuple(jax.ShapeDtypeStruct((B, K), jnp.bfloat16) for K in Ks)
    ws = tuple(jax.ShapeDtypeStruct((7168, K), jnp.bfloat16) for K in Ks)
    for policy, kernel_runs in ((SPECIALIZED, True), (_policy_with("moe_out_launch", "sm100"), False)):
        f = lambda xs, ws, p=policy: api.gemv_sum(xs, ws, policy=p)  # noqa: E731
        text = _lower_sm100(f, xs, ws).as_text()
        assert ("mosaic_gpu" in text, "dot_general" in text) == (kernel_runs, not kernel_runs)
