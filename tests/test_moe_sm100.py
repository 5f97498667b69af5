"""The Blackwell (sm100) routed-experts kernels (pallas_kernels.moe.sm100), on CPU under an abstract B200: the decode
in the natural K order, both kernels in interpret mode against float64 NumPy and the XLA reference (fresh random
MXFP4 experts with the extreme codes, shared and unchosen experts, T not a multiple of 8, a group larger than a
token tile, the gate/up K split, the down kernel's K steps and multi-block CTAs), CUDA lowering at one TP16 / TP8 /
TP1 rank's real shapes, the refusals, tuning.json's launches and the api's choice of body. (No Blackwell GPU here:
nothing runs on one yet.)"""

import json

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from kernel_testbase import abstract_gpu, cpu_only, rng
from moe_testbase import (
    BETA1,
    BETA2,
    abstract_experts,
    check_against_reference_and_numpy,
    check_fused_glu,
    check_sums,
    inputs,
    interpret_params,
    make_experts,
    make_routing,
    races_found,
)

from pallas_kernels import policy as policy_lib
from pallas_kernels.moe import api, grouping, reference, sm90, sm100

BETA = dict(situ_beta=BETA1, situ_linear_beta=BETA2)
TUNING = {"sm100": {"launch": [{"max_tokens": 512, "tokens_per_tile": 16, "up_steps": 2, "down_steps": 2}]}}
E_REAL, L_REAL, K_REAL = 896, 3584, 16  # one rank's experts, the latent width, experts per token


# ------------------------------------------------------------------------------------------------ the decode
@cpu_only
def test_decode_interpret_is_exact_in_the_natural_k_order():
    """Every code byte under scale bytes 2..252 (both nibbles, -0 kept): the decoded A tile bit for bit the float64
    oracle's W, its columns in W's own order (element 2b the low nibble of byte b), no permutation."""
    scale_bytes = np.arange(2, 253, 10)
    codes = np.tile(np.arange(256, dtype=np.uint8), len(scale_bytes)).reshape(-1, 32)  # 8 rows a scale byte
    scales = np.repeat(scale_bytes.astype(np.uint8), 16).reshape(-1, 2)  # each row's two groups: its scale byte
    perm = rng().permutation(len(codes))  # the rows in a fresh order
    codes, scales = codes[perm], scales[perm]
    pad = -len(codes) % sm100.HALF
    codes, scales = np.pad(codes, ((0, pad), (0, 0))), np.pad(scales, ((0, pad), (0, 0)), constant_values=127)
    with abstract_gpu("sm100"):
        got = sm100.decode_tiles(jnp.asarray(codes), jnp.asarray(scales), interpret=interpret_params())
    got = np.asarray(got, np.float64)
    want = ref.mxfp4_dequant(codes, scales)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@cpu_only
@pytest.mark.parametrize("isa", [0, sm100.NATIVE_CVT_PTX])
def test_decode_lowers_for_cuda_both_ways(isa, monkeypatch):
    """The inline GPU decode lowers for a B200 with the native e2m1x2 -> bf16x2 convert (ptxas PTX >= 9.2) and with
    sm90's integer construction (older ptxas; CPU reports none). Run on a Blackwell: neither yet."""
    monkeypatch.setattr(sm100, "ptxas_isa_version", lambda: isa)
    sds = jax.ShapeDtypeStruct
    with abstract_gpu("sm100"):
        lowered = (
            jax.jit(lambda c, s: sm100.decode_tiles(c, s))  # a fresh function: traced again, not from jit's cache
            .trace(sds((256, 32), jnp.uint8), sds((256, 2), jnp.uint8))
            .lower(lowering_platforms=("cuda",))
        )
    assert lowered.as_text().count("mosaic_gpu") >= 1 and lowered.out_info.shape == (256, 64)


# --------------------------------------------------------------------------------- the kernels, interpret mode
@cpu_only
@pytest.mark.parametrize("T, E, I, L", [(1, 8, 64, 512), (5, 12, 192, 1024), (18, 10, 128, 512)])
def test_kernel_interpret_bf16_matches_the_reference_and_numpy(T, E, I, L):
    """bf16 through both kernels (tcgen05 + TMEM simulated, race-checked) against the XLA reference (the same
    rounding points: a few bf16 ulps of the element's scale sum_k w |W2| |h|) and float64 NumPy (no less accurate
    than the reference). T = 5 / 18: groups off a multiple of 8; T = 18 with one expert every token chose: a group
    of 18 in tiles of 16; 3 experts nobody chose."""
    r = rng()
    np_ex, ex, z, sel, w = inputs(r, T, E, I, L)
    with abstract_gpu("sm100"):
        got = sm100.routed_experts(
            ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA, tuning=TUNING, interpret=interpret_params()
        )
    assert not races_found()
    assert got.dtype == jnp.bfloat16 and got.shape == (T, L)
    want = reference.routed_experts(ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA)
    check_against_reference_and_numpy(got, want, np_ex, z, sel, w)


@cpu_only
def test_kernel_interpret_direct_pairs_match_the_reference_and_numpy():
    """The direct form (launch `direct`: every pair its own slot, the tile every token, column p // k kept):
    T = 5 with an expert every token chose, in bf16 against the reference and float64 NumPy, and each pair's fp32
    sums at row p (h's padding rows zeros)."""
    r = rng()
    T, E, I, L, k = 5, 12, 128, 1024, 4
    np_ex, ex, z, sel, w = inputs(r, T, E, I, L, k)
    tuning = {"sm100": {"launch": [{**TUNING["sm100"]["launch"][0], "direct": True}]}}
    with abstract_gpu("sm100"):
        got = sm100.routed_experts(
            ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA, tuning=tuning, interpret=interpret_params()
        )
        launch = sm100.Launch(tokens_per_tile=16, up_steps=2, down_steps=2, up_splits=2, direct=True)
        groups, part, h, y = sm100.grouped(
            ex, z, jnp.asarray(sel), **BETA, launch=launch, interpret=interpret_params(), out_dtype=jnp.float32
        )
    assert not races_found()
    want = reference.routed_experts(ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA)
    check_against_reference_and_numpy(got, want, np_ex, z, sel, w)
    assert part.shape == (2, T * k, 2 * I) and y.shape == (T * k, L) and h.shape == (-(-(T * k + 15) // 8) * 8, I)
    assert not np.any(np.asarray(h[T * k :], np.float32))  # the padding the last pairs' h tiles read
    check_sums(np_ex, z, sel, groups, *sm100.gate_up_sums(part), h, y, k)


@cpu_only
def test_kernel_interpret_fp32_sums_match_numpy():
    """Each pair's W1 z and W3 z (the gate/up partials of a K split over 2 CTAs, summed), h = SiTU-GLU of their
    bf16 roundings and W2 h (the down kernel's fp32 out: K = 576 in 3 steps, 2 row blocks a CTA) against float64,
    the GEMMs within 1e-5 of the element's scale sum |W| |x|."""
    r = rng()
    T, E, I, L, k = 17, 7, 576, 1024, 4
    assert sm100.down_k_bytes(I) < I // 2  # the down kernel streams K
    np_ex, ex, z, sel, _ = inputs(r, T, E, I, L, k)
    launch = sm100.Launch(tokens_per_tile=16, up_steps=2, down_steps=2, up_splits=2, down_row_blocks=2)
    with abstract_gpu("sm100"):
        groups, part, h, y = sm100.grouped(
            ex, z, jnp.asarray(sel), **BETA, launch=launch, interpret=interpret_params(), out_dtype=jnp.float32
        )
    assert not races_found()
    assert part.shape == (2, grouping.num_rows(T, k, E), 2 * I)
    check_sums(np_ex, z, sel, groups, *sm100.gate_up_sums(part), h, y, k)


@cpu_only
@pytest.mark.parametrize("T, direct", [(17, False), (5, True)])
def test_kernel_interpret_fused_glu_matches_numpy(T, direct):
    """fused_glu (SiTU-GLU in the gate/up kernel's epilogue, h written by it) against the same launch without it:
    the unfused run's fp32 sums W1 z / W3 z, the fused run's h from them and its down sums against float64, and
    the bf16 path through the api's entry against the reference and NumPy; grouped (a group of 17 in tiles of 16)
    and direct."""
    r = rng()
    E, I, L, k = 7, 128, 1024, 4
    np_ex, ex, z, sel, w = inputs(r, T, E, I, L, k)
    launch = sm100.Launch(tokens_per_tile=16, up_steps=2, down_steps=2, direct=direct)
    tuning = {"sm100": {"launch": [{**TUNING["sm100"]["launch"][0], "direct": direct, "fused_glu": True}]}}

    def grouped(lc):
        return sm100.grouped(
            ex, z, jnp.asarray(sel), **BETA, launch=lc, interpret=interpret_params(), out_dtype=jnp.float32
        )

    def check(groups, part, h, y):
        check_sums(np_ex, z, sel, groups, *sm100.gate_up_sums(part), h, y, k)

    with abstract_gpu("sm100"):
        check_fused_glu(grouped, launch, check)
        got = sm100.routed_experts(
            ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA, tuning=tuning, interpret=interpret_params()
        )
    assert not races_found()
    want = reference.routed_experts(ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA)
    check_against_reference_and_numpy(got, want, np_ex, z, sel, w)


# ------------------------------------------------------------------------------------ lowering at real shapes
@cpu_only
@pytest.mark.parametrize("I", [192, 384, 3072])
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_kernels_lower_for_cuda_at_real_shapes(T, I, monkeypatch):
    """One rank's experts (E = 896, L = 3584, k = 16; I = 192 / 384 / 3072 at TP16 / TP8 / TP1) with tuning.json's
    sm100 launch for T: both Mosaic GPU kernels lower for a B200, the inline decode and the tcgen05 MMAs with them
    (the native-convert decode at T = 64, the integer one elsewhere; fused_glu flipped at TP8 where one CTA sums a
    row's K)."""
    monkeypatch.setattr(sm100, "ptxas_isa_version", lambda: sm100.NATIVE_CVT_PTX if T == 64 else 0)
    sds = jax.ShapeDtypeStruct
    tuning = json.loads(json.dumps(policy_lib.default_tuning().get("moe")))  # a copy: parsed tables are shared
    for entry in tuning["sm100"]["launch"] if I == 384 else ():
        if entry.get("up_splits", 1) == 1:
            entry["fused_glu"] = not entry.get("fused_glu", False)

    def f(ex, z, sel, w):
        return sm100.routed_experts(ex, z, sel, w, **BETA, tuning=tuning)

    args = (
        abstract_experts(E_REAL, I, L_REAL),
        sds((T, L_REAL), jnp.bfloat16),
        sds((T, K_REAL), jnp.int32),
        sds((T, K_REAL), jnp.float32),
    )
    with abstract_gpu("sm100"):
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2 and lowered.out_info.shape == (T, L_REAL)


# ---------------------------------------------------------------------------------- refusals, launches, the api
@pytest.mark.parametrize(
    "bad", ["dense", "fp32", "tokens", "latent", "intermediate", "tile", "rows", "smem", "splits", "fused_glu"]
)
def test_kernel_refuses_what_it_cannot_run(bad):
    E, I, L, T = 8, 64, 512, 3
    ex = abstract_experts(E, I, L)
    z = jax.ShapeDtypeStruct((T, L), jnp.float32 if bad == "fp32" else jnp.bfloat16)
    sel = jax.ShapeDtypeStruct((T, 4), jnp.int32)
    launch = sm100.Launch(16, 2, 2)
    if bad == "dense":
        ex = {n: jax.ShapeDtypeStruct((E, 1, 1), jnp.bfloat16) for n in ("w1", "w3", "w2")}
    elif bad == "latent":
        ex, z = abstract_experts(E, I, 768), jax.ShapeDtypeStruct((T, 768), jnp.bfloat16)
    elif bad == "intermediate":
        ex = abstract_experts(E, 48, L)
    elif bad == "tile":  # tcgen05 at M = 128 takes N % 16 == 0
        launch = sm100.Launch(8, 2, 2)
    elif bad == "rows":  # L = 512: 4 blocks of 128 W2 rows, not 3 a CTA
        launch = sm100.Launch(16, 2, 2, down_row_blocks=3)
    elif bad == "splits":  # L = 512: one K step of W1 / W3, not split in 2
        launch = sm100.Launch(16, 2, 2, up_splits=2)
    elif bad == "fused_glu":  # the GLU in the gate/up kernel needs each row's whole K sum in one CTA
        ex, z = abstract_experts(E, I, 1024), jax.ShapeDtypeStruct((T, 1024), jnp.bfloat16)
        launch = sm100.Launch(16, 2, 2, up_splits=2, fused_glu=True)
    elif bad == "smem":  # 7 stages of two [64, 256] code tiles, their scales, a [64, 512] bf16 x tile: 702 KB
        ex, z = abstract_experts(E, I, 3584), jax.ShapeDtypeStruct((T, 3584), jnp.bfloat16)
        launch = sm100.Launch(64, 8, 2)
    with pytest.raises(NotImplementedError):
        if bad == "tokens":
            sm100.pick_launch(TUNING, 513)
        sm100.check_supported(ex, z, sel, launch)


def test_launches_cover_the_tokens_they_claim():
    """tuning.json's sm100 launches fit (SMEM, tiles, row blocks) at TP16 / TP8 / TP1 widths for every T they serve."""
    tuning = policy_lib.default_tuning().get("moe")
    served = tuning["sm100"]["launch"][-1]["max_tokens"]
    for I in (192, 384, 3072):
        ex = abstract_experts(E_REAL, I, L_REAL)
        for T in range(1, served + 1):
            z, sel = jax.ShapeDtypeStruct((T, L_REAL), jnp.bfloat16), jax.ShapeDtypeStruct((T, K_REAL), jnp.int32)
            sm100.check_supported(ex, z, sel, sm100.pick_launch(tuning, T))
    with pytest.raises(NotImplementedError, match=f"T = {served + 1}"):
        sm100.pick_launch(tuning, served + 1)


@pytest.mark.parametrize(
    "kind, body", [("NVIDIA B200", sm100), ("NVIDIA GB300", sm100), ("NVIDIA H100 80GB HBM3", sm90)]
)
def test_api_picks_the_body_by_compute_capability(kind, body):
    """10.x (B200 10.0, GB300 10.3) -> sm100, 9.x -> sm90; each launches by its own tuning.json section."""
    device = jax.sharding.AbstractDevice(device_kind=kind, platform="gpu", num_cores=8)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        assert api._body() is body
    assert body.ARCH in policy_lib.default_tuning().get("moe")


@cpu_only
def test_api_on_blackwell_serves_the_kernel_only_from_the_tuned_step_size():
    """On an abstract B200, below the sm100 section's serve_min_tokens the api runs XLA's packed path and records
    why (the tuning's reason, not a missing body's)."""
    r = rng()
    moe = json.loads(json.dumps(policy_lib.default_tuning().get("moe")))  # a copy: parsed tables are shared
    least = moe["sm100"]["serve_min_tokens"] = int(r.integers(2, 5))  # the shipped table serves from T = 1
    policy = policy_lib.DecodePolicy("latency_specialized", tuning=policy_lib.Tuning.from_files(moe=moe))
    T = int(r.integers(1, least))
    _, ex = make_experts(r, 8, 64, 512)
    sel, w = make_routing(r, T, 2, 8, unchosen=2)
    z = jnp.asarray(r.standard_normal((T, 512)), jnp.bfloat16)
    log = policy_lib.DispatchLog()
    with abstract_gpu("sm100"), policy_lib.recording(log):
        got = api.routed_experts(ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA, policy=policy)
    want = reference.routed_experts(ex, z, jnp.asarray(sel), jnp.asarray(w), **BETA, impl="packed")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert log.ops["moe_routed_experts"]["impl"] == "xla"
    assert f"served from {least}" in log.ops["moe_routed_experts"]["reason"]
