"""All-reduce entry points, called inside `jax.shard_map` (with check_vma=False for the Pallas backend).

backend="xla": jax.lax.psum (NCCL). backend="latency_specialized": Pallas Mosaic GPU one-shot (plain stores or TMA)
kernel chosen by message size; it falls back to the XLA reference (logged once per reason) on CPU, for
an axis of size 1, or for a shape/dtype the kernels do not take. Mesh device order must be row-major
(`jax.make_mesh`), as Mosaic GPU collectives require.

Fused entry points: all_reduce_mix_norm (a layer boundary: all-reduce + AttnRes prefix update + AttnRes mix +
RMSNorm; what the model uses, through k3jax/layers/boundary.py), all_reduce_add_rmsnorm (residual add +
RMSNorm) and proj_all_reduce (the row-parallel GEMM before the all-reduce; opt-in, see its plan).
"""

import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.collectives import reference

log = logging.getLogger(__name__)

LANES = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
BLOCK_BYTES = 16 * 1024  # per-CTA block: keeps the FP32 sum in registers (64 values per thread in BF16)
# Choices from bench/results/collectives.md (2 x H200, bf16 messages, steady state), by axis size:
# - psum (NCCL) below PSUM_BELOW_BYTES: there XLA's device barrier and semaphore memset before a Pallas call cost
#   more than the kernel saves. Axis sizes not listed (not measured) use Pallas.
# - the plain-store one-shot up to ST_MAX_BYTES, the TMA one-shot above; 16 KB blocks (4 KB gained nothing).
PSUM_BELOW_BYTES = {2: 256 * 1024}
ST_MAX_BYTES = 128 * 1024
ALGORITHMS = ("one_shot", "one_shot_st")  # kernels.KERNELS
MAX_FUSED_LANE_ROWS = 256  # a token row is one (D/128, 128) TMA box; box dims are <= 256


@dataclasses.dataclass(frozen=True)
class Plan:
    algorithm: str  # "one_shot" | "one_shot_st" | "one_shot_add_rmsnorm" | "mix_norm" | "xla"
    block_rows: int = 0
    reason: str = ""


@functools.cache
def _log_fallback_once(reason):
    log.warning("pallas all-reduce falls back to psum: %s", reason)


def _largest_divisor_at_most(m, cap):
    return max(d for d in range(1, min(m, cap) + 1) if m % d == 0)


def _common_reason(dtype, n, platform):
    if platform != "gpu":
        return f"platform {platform}"
    if n < 2:
        return "axis size 1"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {dtype}"
    return ""


def plan_all_reduce(shape, dtype, n, platform, algorithm=None, block_bytes=None):
    """Which kernel (and block size) all_reduce uses for a per-rank array; pure, so it is tested on CPU."""
    size = math.prod(shape)
    reason = _common_reason(dtype, n, platform)
    if not reason and (size == 0 or size % LANES):
        reason = f"size {size} not a multiple of {LANES}"
    if reason:
        return Plan("xla", reason=reason)
    m = size // LANES
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = size * itemsize
    cap_rows = max(1, (block_bytes or BLOCK_BYTES) // (LANES * itemsize))
    if algorithm is None:
        if nbytes < PSUM_BELOW_BYTES.get(n, 0):
            return Plan("xla", reason=f"psum measured faster below {PSUM_BELOW_BYTES[n] // 1024} KB at {n} ranks")
        algorithm = "one_shot_st" if nbytes <= ST_MAX_BYTES else "one_shot"
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


def all_reduce(x, axis_name="tp", *, backend="xla", algorithm=None, block_bytes=None):
    """Sum of x over `axis_name`, same shape and dtype on every rank.

    algorithm ("one_shot" | "one_shot_st") and block_bytes override the plan, for benchmarks and tests.
    """
    if backend == "xla":
        return reference.all_reduce(x, axis_name)
    if backend != "latency_specialized":
        raise ValueError(f"unknown backend {backend}")
    n = lax.axis_size(axis_name)
    plan = plan_all_reduce(x.shape, x.dtype, n, current_platform(), algorithm, block_bytes)
    if plan.algorithm == "xla":
        _log_fallback_once(plan.reason)
        return reference.all_reduce(x, axis_name)
    from pallas_kernels.collectives import kernels  # GPU-only imports stay off the CPU path

    y = kernels.KERNELS[plan.algorithm](x.reshape(-1, LANES), axis_name=axis_name, n=n, block_rows=plan.block_rows)
    return y.reshape(x.shape)


def all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name="tp", *, backend="xla"):
    """(new_residual, normed): new_residual = residual + allreduce(x_partial) rounded to residual's dtype,
    normed = RMSNorm(new_residual) * norm_w (K3_SPEC rounding order), over the last axis."""
    if backend == "xla":
        return reference.all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name)
    if backend != "latency_specialized":
        raise ValueError(f"unknown backend {backend}")
    n = lax.axis_size(axis_name)
    plan = plan_add_rmsnorm(
        x_partial.shape, x_partial.dtype, residual.shape, residual.dtype, norm_w.shape, n, current_platform()
    )
    if plan.algorithm == "xla":
        _log_fallback_once(plan.reason)
        return reference.all_reduce_add_rmsnorm(x_partial, residual, norm_w, eps, axis_name)
    from pallas_kernels.collectives import kernels

    q = plan.block_rows
    shape = x_partial.shape
    new, normed = kernels.one_shot_add_rmsnorm(
        x_partial.reshape(-1, q, LANES),
        residual.reshape(-1, q, LANES),
        norm_w.reshape(q, LANES),
        eps,
        axis_name=axis_name,
        n=n,
    )
    return new.reshape(shape), normed.reshape(shape)


# --------------------------------------------------------- layer boundary: all-reduce + AttnRes + RMSNorm
MAX_MIX_LANE_ROWS = 64  # D <= 8192: a token row is 64 fp32 values per thread for each live vector
MIX_SMEM_BUDGET = 200 * 1024  # of the 227 KB per CTA: bf16 K3 (8 blocks + prefix) stages 172 KB


def plan_mix_norm(x_shape, x_dtype, prefix_shape, block_shapes, n, platform):
    """Whether the layer-boundary kernel (mix_norm.py) takes these per-rank operands (block_shapes: one shape
    per stored block); pure, tested on CPU."""
    reason = _common_reason(x_dtype, n, platform)
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
        smem = mix_norm.smem_bytes(d // LANES, LANES, n_blocks, prefix_shape is not None, jnp.dtype(x_dtype).itemsize)
        if smem > MIX_SMEM_BUDGET:
            reason = f"{n_blocks} blocks of {d} x {jnp.dtype(x_dtype).name} need {smem} B of SMEM per CTA"
    if reason:
        return Plan("xla", reason=reason)
    return Plan("mix_norm", d // LANES)


def all_reduce_mix_norm(
    x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, axis_name="tp", *, backend="xla"
):
    """A layer boundary in one launch: (P', normed) with a = allreduce(x_partial), P' = a or round(prefix + a),
    normed = RMSNorm(AttnRes(blocks + [P'])) * norm_w (reference.mix_norm has the exact maths). prefix None:
    a block boundary; blocks: the stored blocks, a sequence of arrays shaped like x_partial (each its own kernel
    operand: no stacked copy per boundary); empty or None: no AttnRes (res_norm_w / res_proj_w unused), e.g.
    routed_expert_norm."""
    if backend not in ("xla", "latency_specialized"):
        raise ValueError(f"unknown backend {backend}")
    blocks = tuple(blocks or ())
    plan = Plan("xla", reason="backend xla")
    if backend == "latency_specialized":
        plan = plan_mix_norm(
            x_partial.shape,
            x_partial.dtype,
            None if prefix is None else prefix.shape,
            [b.shape for b in blocks],
            lax.axis_size(axis_name),
            current_platform(),
        )
        if plan.algorithm == "xla":
            _log_fallback_once(plan.reason)
    if plan.algorithm == "xla":
        return reference.all_reduce_mix_norm(x_partial, prefix, blocks, res_norm_w, res_proj_w, norm_w, eps, axis_name)
    from pallas_kernels.collectives import mix_norm

    q, shape, dtype = plan.block_rows, x_partial.shape, x_partial.dtype
    tile = lambda a: None if a is None else a.reshape(*a.shape[: a.ndim - len(shape)], -1, q, LANES)  # noqa: E731
    mix_q = (
        res_norm_w.astype(jnp.float32) * res_proj_w.astype(jnp.float32) if blocks else jnp.ones(shape[-1], jnp.float32)
    )
    new, normed = mix_norm.mix_norm(
        tile(x_partial),
        tile(prefix),
        [tile(b) for b in blocks],
        mix_q.reshape(q, LANES),
        norm_w.astype(dtype).reshape(q, LANES),
        eps,
        axis_name=axis_name,
        n=lax.axis_size(axis_name),
    )
    return new.reshape(shape), normed.reshape(shape)


# ------------------------------------------------------------------ projection fused with its all-reduce
PROJ_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
PROJ_MAX_TOKENS = 64  # one WGMMA M tile of tokens
PROJ_SMEM_BUDGET = 200 * 1024  # of the 227 KB per CTA; the rest for barriers and Mosaic's own scratch
# The fused kernel is opt-in because it is slower: on 2 H200s it is right (real and random shapes, 300 back-to-
# back stress steps; the "back-to-back bug" of the second session was the stress oracle, bench/NOTES.md), but
# it measured 12.5 vs 11.2 us against XLA's dot + psum at B = 1 (K 768, D 7168) and 16.7 vs 15.9 at B = 64;
# it won only at K 1536, B 64 (19.2 vs 22.5). The model's row-parallel sublayers hand their partials to the
# layer-boundary kernel instead (all_reduce_mix_norm).
FUSED_PROJECTION_ENV = "K3JAX_FUSED_PROJECTION"
H100_SMS = 132


def fused_projection_enabled() -> bool:
    return os.environ.get(FUSED_PROJECTION_ENV, "0") == "1"


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


def proj_all_reduce(x_BK, w_KD, residual_BD=None, axis_name="tp", *, backend="xla", tile_d=None, max_stages=None):
    """sum over `axis_name` of x_BK @ w_KD (FP32 accumulation and sum) + residual_BD, rounded once.

    Row-parallel projection: x_BK is this rank's slice of the activation (..., K), w_KD this rank's rows of
    the weight (K, D); the result (..., D) is the same on every rank, in residual_BD's dtype (x's without
    one). backend="latency_specialized" runs the fused Pallas kernel (fused_projection.py) when eligible and
    the XLA reference (dot + psum + add) otherwise, logging the reason once.
    """
    if backend == "xla":
        return reference.proj_all_reduce(x_BK, w_KD, residual_BD, axis_name)
    if backend != "latency_specialized":
        raise ValueError(f"unknown backend {backend}")
    from pallas_kernels import common

    n = lax.axis_size(axis_name)
    plan = plan_proj_all_reduce(
        x_BK.shape,
        x_BK.dtype,
        w_KD.shape,
        w_KD.dtype,
        None if residual_BD is None else residual_BD.shape,
        None if residual_BD is None else residual_BD.dtype,
        n,
        current_platform(),
        common.gpu_arch(),
        num_sms(),
        tile_d,
        max_stages,
    )
    if plan.algorithm != "xla" and not fused_projection_enabled():
        plan = ProjPlan(
            "xla",
            reason=f"fused projection is opt-in ({FUSED_PROJECTION_ENV}=1): measured slower "
            "than XLA's dot + psum on H200, see bench/NOTES.md",
        )
    if plan.algorithm == "xla":
        common.log_once("proj_all_reduce", plan.reason)
        return reference.proj_all_reduce(x_BK, w_KD, residual_BD, axis_name)
    from pallas_kernels.collectives import fused_projection as fp

    lead, (K, D) = x_BK.shape[:-1], w_KD.shape
    res = None if residual_BD is None else residual_BD.reshape(-1, D)
    y = fp.proj_all_reduce(
        x_BK.reshape(-1, K),
        w_KD,
        res,
        axis_name=axis_name,
        n=n,
        tile_d=plan.tile_d,
        max_stages=plan.stages,
    )
    return y.reshape(*lead, D)


def num_sms():
    return getattr(jax.devices()[0], "core_count", None) or H100_SMS
