"""All-reduce entry points, called inside `jax.shard_map` (with check_vma=False for the Pallas backend).

Decode backend auto: jax.lax.psum (NCCL). latency_specialized: Pallas Mosaic GPU one-shot kernel (plain
stores or TMA) chosen by message size (the policy's collectives tuning); the XLA reference on CPU, for an axis
of size 1, or for a shape/dtype the kernels do not take. Mesh device order must be row-major
(`jax.make_mesh`), as Mosaic GPU collectives require.

Fused entry points: all_reduce_mix_norm (a layer boundary: all-reduce + AttnRes prefix update + AttnRes mix +
RMSNorm; what the model uses, through k3jax/layers/boundary.py; with axis_name None the same launch minus the
exchange, where the tuning's mix_norm_single_device allows it), all_reduce_add_rmsnorm (residual add + RMSNorm)
and proj_all_reduce (the row-parallel GEMM before the all-reduce; opt-in, see its plan).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import policy as policy_lib
from pallas_kernels.collectives import reference
from pallas_kernels.policy import XLA, DecodePolicy

LANES = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# The all-reduce kernel choice by message size is data: the policy's "collectives" tuning (tuning.json, from
# bench/results/collectives.md on 2 x H200): psum (NCCL) below ~256 KB at 2 ranks (5.5-6.6 us up to 224 KB
# against the best Pallas one-shot's 6.8-8.5, of which XLA's cross-device barrier + semaphore memset alone are
# ~4.2 us), the plain-store one-shot up to 128 KB, the TMA one-shot above (16 KB blocks).
ALGORITHMS = ("one_shot", "one_shot_st")  # kernels.KERNELS
MAX_FUSED_LANE_ROWS = 256  # a token row is one (D/128, 128) TMA box; box dims are <= 256


@dataclasses.dataclass(frozen=True)
class Plan:
    algorithm: str  # "one_shot" | "one_shot_st" | "one_shot_add_rmsnorm" | "mix_norm" | "xla"
    block_rows: int = 0
    reason: str = ""


def _largest_divisor_at_most(m, cap):
    return max(d for d in range(1, min(m, cap) + 1) if m % d == 0)


def _common_reason(dtype, n, platform, min_n=2):
    if platform != "gpu":
        return f"platform {platform}"
    if n < min_n:
        return "axis size 1"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {dtype}"
    return ""


def plan_all_reduce(shape, dtype, n, platform, algorithm=None, block_bytes=None, tuning=None):
    """Which kernel (and block size) all_reduce uses for a per-rank array; pure, so it is tested on CPU.
    tuning: the policy's "collectives" table (default: tuning.json)."""
    t = tuning or XLA.table("collectives")
    psum_below = t["psum_below_bytes"].get(str(n), 0)
    size = math.prod(shape)
    reason = _common_reason(dtype, n, platform)
    if not reason and (size == 0 or size % LANES):
        reason = f"size {size} not a multiple of {LANES}"
    if reason:
        return Plan("xla", reason=reason)
    m = size // LANES
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = size * itemsize
    cap_rows = max(1, (block_bytes or t["block_bytes"]) // (LANES * itemsize))
    if algorithm is None:
        if nbytes < psum_below:
            return Plan("xla", reason=f"psum measured faster below {psum_below // 1024} KB at {n} ranks")
        algorithm = "one_shot_st" if nbytes <= t["one_shot_st_max_bytes"] else "one_shot"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS} (or None: chosen by size), got {algorithm!r}")
    return Plan(algorithm, _largest_divisor_at_most(m, cap_rows))


def plan_add_rmsnorm(x_shape, x_dtype, res_shape, res_dtype, w_shape, n, platform):
    """Whether the fused all-reduce + residual add + RMSNorm kernel takes these operands."""
    reason = _common_reason(x_dtype, n, platform) or _common_reason(res_dtype, n, platform)
    d = x_shape[-1] if x_shape else 0
    if not reason and (tuple(x_shape) != tuple(res_shape) or tuple(w_shape) != (d,)):
        reason = f"shapes x{x_shape} residual{res_shape} w{w_shape}"
    if not reason and (d % LANES or d // LANES > MAX_FUSED_LANE_ROWS or math.prod(x_shape) == 0):
        reason = f"feature size {d}"
    if reason:
        return Plan("xla", reason=reason)
    return Plan("one_shot_add_rmsnorm", d // LANES)


def current_platform():
    return jax.default_backend()


def _run(plan, kernel):
    """kernel(plan) for a Pallas plan; a plan of "xla" refuses (the reason is what dispatch logs)."""
    if plan.algorithm == "xla":
        raise NotImplementedError(plan.reason)
    return kernel(plan)


def all_reduce(x, axis_name="tp", *, policy: DecodePolicy = XLA, algorithm=None, block_bytes=None):
    """Sum of x over `axis_name`, same shape and dtype on every rank.

    algorithm ("one_shot" | "one_shot_st") and block_bytes override the plan, for benchmarks and tests.
    """

    def kernel(plan):
        from pallas_kernels.collectives import kernels  # GPU-only imports stay off the CPU path

        y = kernels.KERNELS[plan.algorithm](
            x.reshape(-1, LANES),
            axis_name=axis_name,
            n=lax.axis_size(axis_name),
            block_rows=plan.block_rows,
        )
        return y.reshape(x.shape)

    plan = lambda: plan_all_reduce(  # noqa: E731
        x.shape,
        x.dtype,
        lax.axis_size(axis_name),
        current_platform(),
        algorithm,
        block_bytes,
        policy.table("collectives"),
    )
    return policy_lib.dispatch(
        "all_reduce", policy, lambda: _run(plan(), kernel), lambda: reference.all_reduce(x, axis_name)
    )


def all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name="tp", *, policy: DecodePolicy = XLA):
    """(new_residual, normed): new_residual = residual + allreduce(x_partial) rounded to residual's dtype,
    normed = RMSNorm(new_residual) * norm_w (docs/model.md §1.5 rounding order), over the last axis."""

    def kernel(plan):
        from pallas_kernels.collectives import kernels

        q, shape = plan.block_rows, x_partial.shape
        new, normed = kernels.one_shot_add_rmsnorm(
            x_partial.reshape(-1, q, LANES),
            residual.reshape(-1, q, LANES),
            norm_w.reshape(q, LANES),
            eps,
            axis_name=axis_name,
            n=lax.axis_size(axis_name),
        )
        return new.reshape(shape), normed.reshape(shape)

    plan = lambda: plan_add_rmsnorm(  # noqa: E731
        x_partial.shape,
        x_partial.dtype,
        residual.shape,
        residual.dtype,
        norm_w.shape,
        lax.axis_size(axis_name),
        current_platform(),
    )
    return policy_lib.dispatch(
        "all_reduce_add_rmsnorm",
        policy,
        lambda: _run(plan(), kernel),
        lambda: reference.all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name),
    )


# --------------------------------------------------------- layer boundary: all-reduce + AttnRes + RMSNorm
MAX_MIX_LANE_ROWS = 64  # D <= 8192: a token row is 64 fp32 values per thread for each live vector
MIX_SMEM_BUDGET = 200 * 1024  # of the 227 KB per CTA: bf16 K3 (8 blocks + prefix) stages 172 KB


def plan_mix_norm(x_shape, x_dtype, prefix_shape, block_shapes, n, platform, tuning=None):
    """Whether the layer-boundary kernel (mix_norm.py) takes these per-rank operands (block_shapes: one shape
    per stored block); pure, tested on CPU. n == 1 (no tensor-parallel axis: TP1, the rank slice's stub) is the
    kernel without its exchange, taken only where the policy's "collectives" tuning (default: tuning.json) has
    mix_norm_single_device (on since it was measured against the XLA boundary: tuning.json says where)."""
    t = tuning or XLA.table("collectives")
    reason = _common_reason(x_dtype, n, platform, min_n=1)
    if not reason and n == 1 and not t.get("mix_norm_single_device", False):
        reason = "one device: the boundary kernel without an all-reduce is off in this tuning (mix_norm_single_device)"
    d = x_shape[-1] if x_shape else 0
    if not reason and prefix_shape is not None and tuple(prefix_shape) != tuple(x_shape):
        reason = f"prefix{prefix_shape} is not shaped like x{x_shape}"
    if not reason and any(tuple(s) != tuple(x_shape) for s in block_shapes):
        reason = f"blocks {list(block_shapes)} are not shaped like x{x_shape}"
    if not reason and (d % LANES or d // LANES > MAX_MIX_LANE_ROWS or math.prod(x_shape) == 0):
        reason = f"feature size {d}"
    if not reason:
        from pallas_kernels.collectives import mix_norm

        n_blocks = len(block_shapes)
        size = jnp.dtype(x_dtype).itemsize  # AttnRes's weights taken as the activations' dtype
        smem = mix_norm.smem_bytes(
            d // LANES, LANES, n_blocks, prefix_shape is not None, size, size, t.get("mix_norm_attnres")
        )
        if smem > MIX_SMEM_BUDGET:
            reason = f"{n_blocks} blocks of {d} x {jnp.dtype(x_dtype).name} need {smem} B of SMEM per CTA"
    if reason:
        return Plan("xla", reason=reason)
    return Plan("mix_norm", d // LANES)


def all_reduce_mix_norm(
    x_partial,
    prefix,
    blocks,
    res_norm_w,
    res_proj_w,
    norm_w,
    eps,
    axis_name="tp",
    *,
    policy: DecodePolicy = XLA,
):
    """A layer boundary in one launch: (P', normed) with a = allreduce(x_partial), P' = a or round(prefix + a),
    normed = RMSNorm(AttnRes(blocks + [P'])) * norm_w (reference.mix_norm has the exact maths). prefix None:
    a block boundary; blocks: the stored blocks, a sequence of arrays shaped like x_partial (each its own kernel
    operand: no stacked copy per boundary); empty or None: no AttnRes (res_norm_w / res_proj_w unused), e.g.
    routed_expert_norm. axis_name None: one device, no all-reduce (a = x_partial; the kernel at n == 1, where
    the tuning allows it: plan_mix_norm)."""
    blocks = tuple(blocks or ())
    n = lambda: 1 if axis_name is None else lax.axis_size(axis_name)  # noqa: E731

    def kernel(plan):
        from pallas_kernels.collectives import mix_norm

        shape, dtype = x_partial.shape, x_partial.dtype
        t = mix_norm.tile_shape(shape[-1])  # a token row as (R, G, 128)
        tile = lambda a: None if a is None else a.reshape(*a.shape[: a.ndim - len(shape)], -1, *t)  # noqa: E731
        # a named scope: a profile attributes any XLA kernel of the operands' preparation to the boundary by its
        # label (bench/rank_slice.py; the reshapes are bitcasts, the casts no-ops for a bf16 model's weights)
        with jax.named_scope("mix_norm"):
            # AttnRes's q = res_norm x res_proj is formed in the kernel (no XLA product before each boundary)
            q_dtype = jnp.result_type(res_norm_w, res_proj_w) if blocks else None
            factors = tuple(f.astype(q_dtype).reshape(t) for f in (res_norm_w, res_proj_w)) if blocks else None
            new, normed = mix_norm.mix_norm(
                tile(x_partial),
                tile(prefix),
                [tile(b) for b in blocks],
                factors,
                norm_w.astype(dtype).reshape(t),
                eps,
                axis_name=axis_name,
                n=n(),
                attnres=policy.table("collectives").get("mix_norm_attnres"),
            )
        return new.reshape(shape), normed.reshape(shape)

    plan = lambda: plan_mix_norm(  # noqa: E731
        x_partial.shape,
        x_partial.dtype,
        None if prefix is None else prefix.shape,
        [b.shape for b in blocks],
        n(),
        current_platform(),
        policy.table("collectives"),
    )

    def fallback():
        if axis_name is None:  # what the psum-and-round path gives with one rank: round_to(fp32(x)) is x
            return reference.mix_norm(x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps)
        return reference.all_reduce_mix_norm(x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, axis_name)

    return policy_lib.dispatch("all_reduce_mix_norm", policy, lambda: _run(plan(), kernel), fallback)


# ------------------------------------------------------------------ projection fused with its all-reduce
PROJ_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
PROJ_MAX_TOKENS = 64  # one WGMMA M tile of tokens
PROJ_SMEM_BUDGET = 200 * 1024  # of the 227 KB per CTA; the rest for barriers and Mosaic's own scratch
# The fused kernel is opt-in because it is slower: on 2 H200s it is right (real and random shapes, 300 back-to-
# back stress steps; the "back-to-back bug" of the second session was the stress oracle, bench/NOTES.md), but
# it measured 12.5 vs 11.2 us against XLA's dot + psum at B = 1 (K 768, D 7168) and 16.7 vs 15.9 at B = 64;
# it won only at K 1536, B 64 (19.2 vs 22.5). The model's row-parallel sublayers hand their partials to the
# layer-boundary kernel instead (all_reduce_mix_norm).
H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class ProjPlan:
    algorithm: str  # "fused" | "xla"
    tile_d: int = 0
    stages: int = 0  # weight tiles in flight per CTA
    reason: str = ""


def plan_proj_all_reduce(
    x_shape,
    x_dtype,
    w_shape,
    w_dtype,
    res_shape,
    res_dtype,
    n,
    platform,
    arch,
    num_sms=H100_SMS,
    tile_d=None,
    max_stages=None,
):
    """Whether the fused projection + all-reduce kernel takes these per-rank operands (pure: tested on CPU).

    x_shape (..., K), w_shape (K, D), res_shape (..., D) or None; arch is (major, minor) or None.
    """
    from pallas_kernels.collectives import fused_projection as fp

    def xla(reason):
        return ProjPlan("xla", reason=reason)

    if platform != "gpu":
        return xla(f"platform {platform}")
    if arch is None or arch[0] != 9:
        return xla(f"compute capability {arch}: the kernel is WGMMA (sm90) only")
    if n < 2:
        return xla("axis size 1")
    if jnp.dtype(x_dtype) not in PROJ_DTYPES or jnp.dtype(w_dtype) != jnp.dtype(x_dtype):
        return xla(f"dtypes x {x_dtype} w {w_dtype}")
    if len(w_shape) != 2 or not x_shape or x_shape[-1] != w_shape[0]:
        return xla(f"shapes x{tuple(x_shape)} w{tuple(w_shape)}")
    K, D = w_shape
    B = math.prod(x_shape[:-1])
    if res_shape is not None:
        if tuple(res_shape) != (*x_shape[:-1], D):
            return xla(f"residual shape {tuple(res_shape)} for output {(*x_shape[:-1], D)}")
        if jnp.dtype(res_dtype) not in DTYPES:
            return xla(f"residual dtype {res_dtype}")
    if not 1 <= B <= PROJ_MAX_TOKENS:
        return xla(f"{B} tokens (1..{PROJ_MAX_TOKENS})")
    tk = fp.tile_k_for(K)
    if tk is None or K // tk < 2:
        return xla(f"K = {K} (a multiple of 32, at least 2 tiles)")
    # CTA j waits for CTA j of every peer, so the whole grid must be resident at once (one wave).
    choices = [tile_d] if tile_d else [64, 128, 192, 256]
    tile_d = next((t for t in choices if D % t == 0 and t % tk == 0 and D // t <= num_sms), None)
    if tile_d is None:
        return xla(f"D = {D}: no column tile gives one wave on {num_sms} SMs")
    # As many weight tiles in flight as SMEM takes (bytes in flight are what a GEMV's bandwidth needs).
    res_itemsize = jnp.dtype(res_dtype).itemsize if res_shape is not None else jnp.dtype(x_dtype).itemsize
    smem = lambda s: fp.smem_bytes(K, n, tile_d, s, jnp.dtype(x_dtype).itemsize, res_itemsize)
    stages = next((s for s in range(max_stages or fp.MAX_STAGES, 1, -1) if smem(s) <= PROJ_SMEM_BUDGET), None)
    if stages is None:
        return xla(f"{smem(2)} B of SMEM per CTA (n = {n}, tile_d = {tile_d})")
    return ProjPlan("fused", tile_d, stages)


def proj_all_reduce(
    x_BK,
    w_KD,
    residual_BD=None,
    axis_name="tp",
    *,
    policy: DecodePolicy = XLA,
    tile_d=None,
    max_stages=None,
):
    """sum over `axis_name` of x_BK @ w_KD (FP32 accumulation and sum) + residual_BD, rounded once.

    Row-parallel projection: x_BK is this rank's slice of the activation (..., K), w_KD this rank's rows of
    the weight (K, D); the result (..., D) is the same on every rank, in residual_BD's dtype (x's without
    one). Under a policy asking for kernels and with policy.fused_projection it runs the fused Pallas kernel
    (fused_projection.py) when eligible, the XLA reference (dot + psum + add) otherwise.
    """

    def kernel():
        from pallas_kernels import common
        from pallas_kernels.collectives import fused_projection as fp

        plan = plan_proj_all_reduce(
            x_BK.shape,
            x_BK.dtype,
            w_KD.shape,
            w_KD.dtype,
            None if residual_BD is None else residual_BD.shape,
            None if residual_BD is None else residual_BD.dtype,
            lax.axis_size(axis_name),
            current_platform(),
            common.gpu_arch(),
            num_sms(),
            tile_d,
            max_stages,
        )
        if plan.algorithm == "xla":
            raise NotImplementedError(plan.reason)
        if not policy.fused_projection:
            raise NotImplementedError(
                "the fused projection is opt-in (DecodePolicy(fused_projection=True)): measured slower "
                "than XLA's dot + psum on H200, see bench/NOTES.md"
            )
        lead, (K, D) = x_BK.shape[:-1], w_KD.shape
        res = None if residual_BD is None else residual_BD.reshape(-1, D)
        y = fp.proj_all_reduce(
            x_BK.reshape(-1, K),
            w_KD,
            res,
            axis_name=axis_name,
            n=lax.axis_size(axis_name),
            tile_d=plan.tile_d,
            max_stages=plan.stages,
        )
        return y.reshape(*lead, D)

    return policy_lib.dispatch(
        "proj_all_reduce", policy, kernel, lambda: reference.proj_all_reduce(x_BK, w_KD, residual_BD, axis_name)
    )


def num_sms():
    return getattr(jax.devices()[0], "core_count", None) or H100_SMS
