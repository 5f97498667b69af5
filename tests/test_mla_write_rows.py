"""The MLA layer's new cache rows (pallas_kernels.mla_decode.mla_write_rows): the kernel (interpret mode on CPU
under an abstract H100 and B200, CUDA lowering at real shapes, real shapes on the GPU) against its XLA reference
and both against a float64 NumPy oracle of docs/model.md §5.1 (the kv norm) and k3jax.cache's FP8 row rule."""

import logging
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_testbase import abstract_gpu, cpu_only, gpu_only

from pallas_kernels import common
from pallas_kernels.mla_decode import api, reference, rows_kernel
from pallas_kernels.policy import SPECIALIZED, DecodePolicy, DispatchLog, recording

E = 64  # k_pe
EPS = 1e-6
FP8 = jnp.float8_e4m3fn


def make_case(rng, B, T, S, R, act, cache):
    """Fresh kv rows (k_pe with its own, larger range), a norm weight, a cache entry already holding random rows,
    positions with a repeat-free layout per sequence, and a valid mask with idle tokens and one past the cache."""
    kv = rng.standard_normal((B, T, R + E)).astype(np.float32)
    kv[..., R:] *= 4.0
    w = (1.0 + 0.3 * rng.standard_normal(R)).astype(np.float32)
    old = rng.standard_normal((B, S, R + E)).astype(np.float32)
    entry = {"rows": jnp.asarray(old, cache if cache != "fp8" else FP8)}
    if cache == "fp8":
        entry["scales"] = jnp.asarray(rng.uniform(0.01, 1.0, (B, S, 2)), jnp.float32)
    start = rng.integers(0, S - T + 1, B)
    pos = start[:, None] + np.arange(T)[None]
    valid = rng.random((B, T)) < 0.8
    valid[0, 0] = True
    if B > 1:  # a sequence whose last token lands past the cache: nothing written for it
        pos[1, -1] = S + 3
        valid[1, -1] = True
    return (
        jnp.asarray(kv, act),
        jnp.asarray(w, act),
        entry,
        jnp.asarray(pos, jnp.int32),
        jnp.asarray(valid),
    )


def oracle_rows(kv, w, R):
    """float64 [RMSNorm(c) | k_pe] of §5.1 (no roundings)."""
    x = np.asarray(kv, np.float64)
    c = x[..., :R]
    n = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
    return np.concatenate([n, x[..., R:]], axis=-1)


def dequantized(entry, R):
    return np.asarray(reference.dequantize(entry, R, jnp.float32), np.float64)


def check_against_oracle(got, case, R):
    """Written rows: each element within half an e4m3 step (+ the bf16 roundings of bf16 activations) of the
    float64 row; every other cache row bit-identical to what it was."""
    kv, w, entry, pos, valid = case
    want = oracle_rows(kv, w, R)
    back = dequantized(got, R)
    before = dequantized(entry, R)
    B, T, _ = kv.shape
    S = entry["rows"].shape[1]
    written = np.zeros((B, S), bool)
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            if not (valid[b, t] and 0 <= p < S):
                continue
            written[b, p] = True
            for lo, hi in ((0, R), (R, R + E)):
                ref, val = want[b, t, lo:hi], back[b, p, lo:hi]
                top = np.abs(ref).max()
                if "scales" in entry:  # e4m3: 3 mantissa bits; below 2^-6 (in units of the scale) steps of 2^-9
                    bound = np.maximum(2.0**-4 * np.abs(ref), 2.0**-10 * top / 448.0)
                else:  # bf16 storage: half a bf16 step
                    bound = 2.0**-8 * np.abs(ref)
                if kv.dtype == jnp.bfloat16:  # n rounded to bf16, then times w in bf16: two more steps
                    bound = bound + 2.0**-7 * np.abs(ref)
                assert np.all(np.abs(val - ref) <= bound * 1.0001 + 1e-30), (b, t, np.max(np.abs(val - ref) / bound))
    np.testing.assert_array_equal(back[~written], before[~written])
    if "scales" in entry:
        np.testing.assert_array_equal(np.asarray(got["scales"])[~written], np.asarray(entry["scales"])[~written])


def check_against_reference(got, want, R):
    """Kernel vs XLA reference: the scales to float32 rounding, each code equal or one e4m3 step apart (the
    norm's fp32 sum runs in another order), nearly all equal."""
    if "scales" in want:
        np.testing.assert_allclose(np.asarray(got["scales"]), np.asarray(want["scales"]), rtol=2e-6, atol=0)
        a = np.asarray(got["rows"]).view(np.uint8).astype(np.int16)
        b = np.asarray(want["rows"]).view(np.uint8).astype(np.int16)
        assert np.all((np.abs(a - b) <= 1) & ((a ^ b) < 128)), "codes more than one step apart, or a sign flip"
        assert np.mean(a != b) < 0.01
    else:
        a, b = np.asarray(got["rows"], np.float64), np.asarray(want["rows"], np.float64)
        step = np.abs(b) * 2.0 ** (-7 if want["rows"].dtype == jnp.bfloat16 else -22)
        assert np.all(np.abs(a - b) <= step), np.max(np.abs(a - b))


def interpret():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True)


# ---- the reference ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["fp8", jnp.bfloat16])
@pytest.mark.parametrize("act", [jnp.float32, jnp.bfloat16])
def test_reference_matches_the_oracle(rng, cache, act):
    case = make_case(rng, 3, 4, 24, 128, act, cache)
    check_against_oracle(reference.mla_write_rows(*case, eps=EPS), case, 128)


# ---- the kernel in interpret mode ---------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize(
    "B, T, cache, act",
    [(3, 1, "fp8", jnp.float32), (2, 5, "fp8", jnp.bfloat16), (3, 2, jnp.bfloat16, jnp.bfloat16)],
)
def test_kernel_interpret_matches_reference_and_oracle(rng, arch, B, T, cache, act):
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    R = 256
    case = make_case(rng, B, T, 32, R, act, cache)
    with abstract_gpu(arch):
        got = rows_kernel.write_rows(*case, eps=EPS, interpret=interpret())
    assert not get_races().races_found
    check_against_reference(got, reference.mla_write_rows(*case, eps=EPS), R)
    check_against_oracle(got, case, R)


@cpu_only
def test_kernel_writes_nothing_for_idle_tokens(rng):
    """Every token idle: the cache comes back bit for bit (the kernel's guard, not the reference's drop)."""
    kv, w, entry, pos, _ = make_case(rng, 2, 3, 16, 128, jnp.float32, "fp8")
    with abstract_gpu("sm90"):
        got = rows_kernel.write_rows(kv, w, entry, pos, jnp.zeros(pos.shape, bool), eps=EPS, interpret=interpret())
    for k in entry:
        np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), np.asarray(entry[k]).view(np.uint8))


# ---- lowering at real shapes: one launch, the cache written in place -----------------------------------------
@cpu_only
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("B, T, cache", [(1, 1, "fp8"), (64, 8, "fp8"), (8, 1, jnp.bfloat16)])
def test_kernel_lowers_for_cuda_writing_the_cache_in_place(rng, arch, B, T, cache):
    case = make_case(rng, B, T, 256, 512, jnp.bfloat16, cache)
    with abstract_gpu(arch):
        text = (
            jax.jit(lambda *a: rows_kernel.write_rows(*a, eps=EPS))
            .trace(*case)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert text.count("mosaic_gpu") >= 1
    aliased = sorted(int(i) for i in re.findall(r"output_operand_alias<[^>]*operand_index = (\d+)", text))
    assert aliased == ([4, 5] if cache == "fp8" else [4])  # rows (and scales): no copy of the cache


# ---- the api ------------------------------------------------------------------------------------------------
def test_api_falls_back_off_gpu_and_says_why(rng, caplog):
    case = make_case(rng, 2, 2, 16, 128, jnp.float32, "fp8")
    log = DispatchLog()
    common.log_once.cache_clear()
    with recording(log), caplog.at_level(logging.WARNING, logger="k3jax.backends"):
        got = api.mla_write_rows(*case, eps=EPS, policy=SPECIALIZED)
    want = reference.mla_write_rows(*case, eps=EPS)
    if jax.default_backend() == "cpu":
        assert log.ops[api.ROWS_OP]["impl"] == "xla" and "no GPU" in log.ops[api.ROWS_OP]["reason"]
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), np.asarray(want[k]).view(np.uint8))


def policy_with_rows(on: bool) -> DecodePolicy:
    """latency_specialized with the tuning's write_rows switch set (both bodies)."""
    table = SPECIALIZED.table("mla_decode")
    entries = {arch: dict(table[arch], write_rows=on) for arch in ("sm90", "sm100")}
    return DecodePolicy(backend="latency_specialized", tuning=SPECIALIZED.tuning.with_entries("mla_decode", **entries))


@cpu_only
@pytest.mark.parametrize("on", [True, False])
def test_api_runs_the_kernel_where_the_tuning_switches_it_on(rng, monkeypatch, on):
    """Under an abstract H100 the api serves the kernel (run here in interpret mode) where tuning.json's
    write_rows is true, else the reference, saying why; it records which ran."""
    import functools

    monkeypatch.setattr(rows_kernel, "write_rows", functools.partial(rows_kernel.write_rows, interpret=interpret()))
    case = make_case(rng, 2, 1, 16, 128, jnp.float32, "fp8")
    log = DispatchLog()
    with recording(log), abstract_gpu("sm90"):
        got = api.mla_write_rows(*case, eps=EPS, policy=policy_with_rows(on))
    if on:
        assert log.ops[api.ROWS_OP] == {"impl": "pallas", "reason": None}
    else:
        assert log.ops[api.ROWS_OP]["impl"] == "xla" and "write_rows" in log.ops[api.ROWS_OP]["reason"]
    check_against_reference(got, reference.mla_write_rows(*case, eps=EPS), 128)


@pytest.mark.parametrize("bad", ["pos", "valid", "rows", "entry"])
def test_api_refuses_malformed_inputs(rng, bad):
    kv, w, entry, pos, valid = make_case(rng, 2, 2, 16, 128, jnp.float32, "fp8")
    if bad == "pos":
        pos = pos[:, :1]
    elif bad == "valid":
        valid = valid[:1]
    elif bad == "rows":
        entry = dict(entry, rows=entry["rows"][..., :-8])
    else:
        entry = entry["rows"]
    with pytest.raises(ValueError, match="must"):
        api.mla_write_rows(kv, w, entry, pos, valid, eps=EPS, policy=SPECIALIZED)


# ---- on the GPU at real shapes ------------------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("B, T, cache", [(1, 1, "fp8"), (64, 1, "fp8"), (4, 8, "fp8"), (8, 1, jnp.bfloat16)])
@pytest.mark.parametrize("act", [jnp.bfloat16, jnp.float32])
def test_kernel_on_gpu_matches_reference_and_oracle(rng, B, T, cache, act):
    R = 512
    case = make_case(rng, B, T, 1024, R, act, cache)
    got = jax.jit(lambda *a: rows_kernel.write_rows(*a, eps=EPS))(*case)
    check_against_reference(got, reference.mla_write_rows(*case, eps=EPS), R)
    check_against_oracle(got, case, R)


def test_ml_dtypes_e4m3_is_the_cache_type():
    """The oracle's bounds assume e4m3fn (3 mantissa bits, max 448)."""
    assert jnp.dtype(FP8) == np.dtype(ml_dtypes.float8_e4m3fn)
    assert float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) == reference.FP8_MAX
