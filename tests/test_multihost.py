"""Multi-host: 4 processes x 4 CPU devices on localhost (gloo collectives) form one 16-device tp mesh and
greedy-generate the same tokens as one process with 16 devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import multihost_worker as worker
import pytest

ROOT = Path(__file__).resolve().parent.parent
NPROC, LOCAL = 4, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(len(jax.devices()) < NPROC * LOCAL, reason="the reference needs 16 (fake) devices")
def test_four_processes_match_one_process(tmp_path, rng):
    seed = int(rng.integers(1 << 30))
    out = tmp_path / "tokens.json"
    port = _free_port()
    procs = []
    for i in range(NPROC):
        env = dict(
            os.environ,
            XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL}",
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(NPROC),
            JAX_PROCESS_ID=str(i),
            PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "multihost_worker.py"), str(out), str(seed), str(NPROC * LOCAL)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=420)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
    got = json.loads(out.read_text())
    assert (got["processes"], got["devices"], got["local_devices"]) == (NPROC, NPROC * LOCAL, LOCAL)
    want = worker.generate_tokens(seed, NPROC * LOCAL)
    assert got["tokens"] == want


def test_single_process_is_a_no_op(monkeypatch):
    from k3jax import distributed

    for v in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(v, raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False
    with pytest.raises(ValueError, match="--num-processes"):
        distributed.initialize(coordinator="127.0.0.1:1")
