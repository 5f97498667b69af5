import os
import tempfile

# Tests run on CPU; 16 fake devices let the sharding tests build every TP mesh in one process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Failure logs (k3jax/errors.py) of the tests' deliberate refusals go to a temporary directory, not ~/.cache.
os.environ.setdefault("K3JAX_LOG_DIR", os.path.join(tempfile.gettempdir(), "k3jax-test-logs"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
    """Fresh random inputs every run (the seed is printed so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def seed():
    """A fresh seed per test module for fake checkpoints (printed so a failure can be replayed)."""
    s = int.from_bytes(os.urandom(3), "little")
    print(f"fake checkpoint seed {s}")
    return s
