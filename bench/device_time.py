"""Device time of a jitted call, from CUPTI (Mosaic GPU's profiler): what the kernel benches here report.

Not wall time: `profiler.measure` sums the kernels one call launches, so host dispatch and Python stay out.
"""

import statistics

import jax
from jax.experimental.mosaic.gpu import profiler

ITERS = 30  # runs per timing: the median is what a row reports


def device_us(f, *args, iters=ITERS):
    """Median over `iters` runs of the summed CUPTI kernel time of one call f(*args), in microseconds (the
    first call, which compiles, is not timed)."""
    jax.block_until_ready(f(*args))
    _, times = profiler.measure(f, iterations=iters)(*args)
    return 1e3 * statistics.median(times)


def kernel_names(f, *args):
    """The kernels one call f(*args) launches, in order."""
    _, per_kernel = profiler.measure(f, aggregate=False)(*args)
    return [name for name, _ in per_kernel]


def per_kernel_us(f, *args, iters=20):
    """[(kernel name, median us over `iters` runs)] of one call f(*args), in launch order."""
    jax.block_until_ready(f(*args))
    runs = [profiler.measure(f, aggregate=False)(*args)[1] for _ in range(iters)]
    return [(name, 1e3 * statistics.median(r[i][1] for r in runs)) for i, (name, _) in enumerate(runs[0])]
