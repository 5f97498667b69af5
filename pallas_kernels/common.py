"""Small helpers shared by the Pallas kernels and their references: which GPU we are on, logging a fallback
once, the model's GEMM rule (so a reference computes a projection exactly as the model's XLA path does), its
RMSNorm, a rounding XLA:GPU keeps (round_to), SiTU-GLU (docs/model.md §3; the routed experts' GLU between their two
kernels), a cluster's barrier with its fences (cluster_sync), a persistent launch's grid-wide one (grid_barrier)
and partial sums added in order (sum_in_order)."""

import functools
import logging

import jax
import jax.numpy as jnp
from jax._src.pallas.mosaic_gpu.helpers import inline_ptx  # jax's own; not exported in 0.11.2
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

logger = logging.getLogger("k3jax.backends")

# device_kind substrings -> compute capability, for abstract devices (interpret mode, AOT lowering on CPU),
# which carry a kind but no compute_capability.
_KIND_TO_ARCH = (
    ("B200", (10, 0)),
    ("B300", (10, 3)),
    ("GB200", (10, 0)),
    ("GB300", (10, 3)),
    ("H100", (9, 0)),
    ("H200", (9, 0)),
    ("H800", (9, 0)),
    ("H20", (9, 0)),
)


def gpu_arch() -> tuple[int, int] | None:
    """(major, minor) of the GPU we compile for, or None when there is none (CPU).

    An abstract device pinned with jax.sharding.use_abstract_mesh wins over the real one, so interpret-mode
    tests on CPU can pick the Hopper or the Blackwell body.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform == "gpu":
        cc = getattr(device, "compute_capability", None)
        if cc:
            return tuple(int(x) for x in cc.split("."))[:2]
        for name, arch in _KIND_TO_ARCH:
            if name in device.device_kind:
                return arch
        return None
    device = jax.devices()[0]
    if device.platform != "gpu" or not hasattr(device, "compute_capability"):
        return None
    return tuple(int(x) for x in device.compute_capability.split("."))[:2]


@functools.cache
def log_once(op: str, reason: str) -> None:
    """Log one fallback reason per (op, reason): decode steps are traced many times, the log stays short."""
    logger.warning("%s: Pallas kernel not used, falling back to the XLA reference: %s", op, reason)


def dot(spec: str, a, b):
    """einsum of two compute-dtype operands with fp32 accumulation and an fp32 result (the bf16 GEMM rule).

    XLA:CPU cannot run a bf16 x bf16 -> f32 dot, so on CPU the operands are widened first: bf16 products are
    exact in fp32, so the result is the same up to summation order."""
    if a.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def rms_norm(x, w, eps):
    """HF RMSNorm: fp32 statistics, normalised value rounded to x's dtype, then times the weight."""
    xf = x.astype(jnp.float32)
    n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return n * w.astype(x.dtype)


def round_to(x_f32, dtype):
    """x rounded to dtype, and kept rounded: XLA GPU's excess-precision pass drops a convert pair
    f32 -> bf16 -> f32, so a rounding that later fp32 maths reads goes through reduce_precision, which it keeps."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x_f32, info.nexp, info.nmant).astype(dtype)


def situ_glu(g, u, beta1: float, beta2: float | None):
    """SiTU(g) * cap(u) in fp32, rounded once to g's dtype (docs/model.md §3). sigmoid takes the UNCAPPED g."""
    gf, uf = g.astype(jnp.float32), u.astype(jnp.float32)
    situ = beta1 * jnp.tanh(gf / beta1) * jax.nn.sigmoid(gf)
    cap = uf if beta2 is None else beta2 * jnp.tanh(uf / beta2)
    return (situ * cap).astype(g.dtype)


def cluster_sync(bar, fences):
    """Every CTA's writes before this (GMEM, or peer SMEM) are visible to every CTA of the cluster after it.

    The ClusterBarrier arrives (one thread per warpgroup) on every peer's mbarrier, which orders at CTA scope
    only; so all threads sync first (bar.sync inside commit_smem), then fence at cluster scope, and fence
    again after the wait before reading. Every CTA waits, not only the reader: a CTA must not exit while a
    peer's arrive may still target its SMEM barrier. Interpret mode (fences=False) has no caches to order and
    cannot run inline PTX."""
    plgpu.commit_smem()
    if fences:
        inline_ptx("fence.acq_rel.cluster;")
    plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    if fences:
        inline_ptx("fence.acq_rel.cluster;")


def grid_barrier(sem, n_ctas, n):
    """The n-th (1, 2, ...; static or traced) grid-wide barrier of a persistent launch: every CTA's writes before
    it are visible to every CTA after it. sem: the launch's global semaphore (pl.get_global(plgpu.SemaphoreType.
    REGULAR), which XLA zeroes before each launch); each CTA adds 1 and waits until the count reaches n x n_ctas,
    so the counter only grows and no reset can race a late reader. Each thread fences its own writes first:
    Pallas's signal is a relaxed red.add from one lane (its fence comes after it). All n_ctas CTAs must be
    resident at once (a grid the SMs hold whole), or the launch deadlocks; one warpgroup a CTA (the signal's and
    the wait's barriers are a warpgroup's). GPU only: interpret mode runs no semaphores."""
    inline_ptx("fence.acq_rel.gpu;")
    plgpu.commit_smem()  # bar.sync: every thread's fence done before the one lane signals
    pl.semaphore_signal(sem, 1)
    plgpu.semaphore_wait(sem, n * n_ctas, decrement=False, memory_scope="gpu")


def sum_in_order(load, n):
    """load(0) + ... + load(n - 1), in that order (a K split's partial sums, as the GEMV glue adds them)."""
    acc = load(0)
    for p in range(1, n):
        acc = acc + load(p)
    return acc
