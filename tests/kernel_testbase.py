"""Shared pieces for kernel tests: fresh random inputs, tolerances per dtype, device markers.

Every kernel test module draws its inputs here (a fresh seed per call) and compares against a float64
NumPy implementation written from docs/model.md, or a body against its XLA reference.
"""

import contextlib
import fcntl
import os
import tempfile

import jax
import numpy as np
import pytest

ON_GPU = jax.devices()[0].platform == "gpu"


def gpu_only(test):
    """Marks a one-GPU test `gpu` (the device machine runs `pytest -m "gpu and not gpu2"`) and skips it on CPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU (runs on the device machine)")(test))


cpu_only = pytest.mark.skipif(ON_GPU, reason="interpret-mode test, CPU only")


@pytest.fixture
def one_heavy_gpu_test_at_a_time():
    """Holds a file lock for the test: the GPU suite's xdist workers share one GPU, and tests that hold one rank's
    whole expert set (1-2 GB) plus its XLA references (several GB more) ran it out of memory side by side (the
    suite runs with XLA_PYTHON_CLIENT_ALLOCATOR=platform, so a finished test's memory goes back to the GPU)."""
    with open(os.path.join(tempfile.gettempdir(), "k3jax_heavy_gpu_test.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


DEVICE_KINDS = {"sm90": "NVIDIA H100 80GB HBM3", "sm100": "NVIDIA B200"}


def rng():
    """A fresh generator per test; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@contextlib.contextmanager
def abstract_gpu(arch):
    """Pin an abstract H100 (sm90) or B200 (sm100) so interpret mode and lowering pick that body on CPU."""
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[arch], platform="gpu", num_cores=8)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def assert_close(actual, expected, *, atol, rtol, what=""):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    assert np.all(np.isfinite(a)), f"{what}: non-finite values"
    np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=what)
