"""Multi-process (multi-host) start-up: one process per host, all hosts' devices in one global "tp" mesh.

K3 at TP16 spans 4 hosts x 4 GPUs. Each host runs the same program; `initialize` joins them through
jax.distributed (a coordinator at process 0's address) before anything touches a device. After it,
`jax.devices()` lists every process's devices and `sharding.make_mesh(tp)` builds the global mesh.

Where the settings come from, first hit wins:
  1. explicit arguments (the CLI flags --coordinator --num-processes --process-id);
  2. JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (JAX_LOCAL_DEVICE_IDS is read by jax);
  3. jax's own cluster auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU), used when a launcher set
     its variables and nothing above was given.
With none of these, or a single process, it does nothing (one host needs no coordinator).
CPU processes talk through gloo (jax's default CPU collectives), which the localhost test uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

_LAUNCHER_VARS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> bool:
    """Join the multi-process job if there is one. Returns True when jax.distributed was initialised."""
    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    explicit = (coordinator, num_processes, process_id)
    if num_processes == 1:
        return False
    if all(v is None for v in explicit) and not any(v in os.environ for v in _LAUNCHER_VARS):
        return False  # single process: nothing to join
    launched = any(v in os.environ for v in _LAUNCHER_VARS[:3])  # a launcher that jax can read the rest from
    if coordinator is None and not launched:  # else jax's own error: "coordinator_address should be defined."
        raise ValueError(
            "multi-process start needs --coordinator HOST:PORT (process 0's address; or "
            "JAX_COORDINATOR_ADDRESS) with --num-processes and --process-id"
        )
    if None not in (num_processes, process_id) and not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id must be in 0..{num_processes - 1} (--num-processes {num_processes}), got {process_id}"
        )
    if coordinator is not None and None in (num_processes, process_id) and not launched:
        raise ValueError(
            "multi-process start needs --num-processes and --process-id (or JAX_NUM_PROCESSES and "
            f"JAX_PROCESS_ID) with --coordinator {coordinator}"
        )
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    return True
