"""Load a converted k3jax checkpoint straight into device arrays: `cfg, params = k3jax.load(CKPT_DIR, mesh)`.

The directory is what `k3jax-convert` writes: `k3jax_meta.json` (config, tensor-table version, experts format,
dtypes) and `params/`, an orbax PyTree checkpoint. Orbax restores every leaf with its target sharding, so each
device reads only the chunks of its own shard. We refuse anything whose tensor table or config does not match
this code before reading a byte of weights, and anything whose files are missing or of the wrong size against
its manifest (`k3jax_manifest.json`, k3jax/manifest.py); `verify=True` also checks every file's checksum.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp

from k3jax import errors
from k3jax import manifest as M
from k3jax import params as P
from k3jax.config import ConfigError, K3Config

META = "k3jax_meta.json"
FORMAT = "k3jax-checkpoint"


class CheckpointError(ValueError):
    """A directory that is not a loadable k3jax checkpoint for this code."""


def read_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such directory (make one with k3jax-convert HF_DIR OUT_DIR)")
    if not os.path.exists(path):
        if os.path.isdir(os.path.join(ckpt_dir, "parts")):  # convert.core's staging directory OUT_DIR.tmp-<hash>
            out = os.path.abspath(ckpt_dir).rsplit(".tmp-", 1)[0]
            raise CheckpointError(
                f"{ckpt_dir} is an unfinished conversion (interrupted k3jax-convert): rerun "
                f"k3jax-convert HF_DIR {out} --resume, then load {out}"
            )
        is_hf = os.path.exists(os.path.join(ckpt_dir, "config.json"))
        hint = " (it looks like an HF checkpoint)" if is_hf else ""
        raise CheckpointError(
            f"{ckpt_dir} is not a converted k3jax checkpoint{hint}: run k3jax-convert HF_DIR {ckpt_dir} first"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; run k3jax-convert first")
    if meta.get("table_version") != P.TABLE_VERSION:
        raise CheckpointError(
            f"{ckpt_dir}: tensor-table version {meta.get('table_version')} but this code "
            f"reads version {P.TABLE_VERSION}; re-run k3jax-convert on the HF checkpoint"
        )
    return meta


def load_config(ckpt_dir: str) -> K3Config:
    return K3Config.from_hf(read_meta(ckpt_dir)["config"])


def default_workers() -> int:
    return min(32, (os.cpu_count() or 1) + 4)  # threads for stat/hash: hide I/O latency, use every core


def check_files(ckpt_dir: str, verify: bool = False, workers: int | None = None, progress: bool | None = None):
    """Refuse a checkpoint whose files differ from its manifest: presence and sizes (cheap: a listing and a stat
    per file), and with `verify` every byte's checksum (a full read, on parallel threads, with a progress bar).
    Returns the manifest."""
    try:
        m = M.read(ckpt_dir)
    except M.ManifestError as e:
        raise CheckpointError(str(e)) from None
    if m is None:
        raise CheckpointError(
            f"{ckpt_dir} has no {M.MANIFEST} (it was converted before checkpoints listed their files' sizes and "
            f"checksums), so a damaged copy would load silently: run k3jax-convert --write-manifest {ckpt_dir} "
            "(hashes the files as they are now: run it where the checkpoint was made), or re-convert it"
        )
    workers = workers or default_workers()
    problems = M.verify(ckpt_dir, m, workers, progress) if verify else M.check_sizes(ckpt_dir, m, workers)
    if problems:
        shown = "; ".join(map(str, problems[:3])) + ("; ..." if len(problems) > 3 else "")
        raise CheckpointError(
            f"{ckpt_dir}: weights are missing or corrupt: {len(problems)} of {M.count_files(m)} files differ from "
            f"its manifest ({shown}); re-run k3jax-convert (with --overwrite) or copy the checkpoint again "
            f"(k3jax-convert --check {ckpt_dir} lists every such file)"
        )
    return m


def load(ckpt_dir: str, mesh=None, dtype=None, expect: K3Config | None = None, verify: bool = False):
    """(cfg, params). `dtype` casts the bf16 trunk on read (fp32 tensors and packed experts are kept);
    `mesh` places every leaf with `k3jax.sharding.param_shardings`, else all on the first device;
    `expect` refuses a checkpoint of a different config; `verify` checks every file's checksum first (a full
    read of the checkpoint; without it only presence and sizes are checked)."""
    meta = read_meta(ckpt_dir)
    try:
        cfg = K3Config.from_hf(meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{ckpt_dir}: stored config is not runnable: {e}") from None
    if expect is not None and expect != cfg:
        diff = [
            f.name
            for f in cfg.__dataclass_fields__.values()
            if f.compare and getattr(cfg, f.name) != getattr(expect, f.name)
        ]
        raise CheckpointError(f"{ckpt_dir}: config differs from the expected one in {diff}")
    experts = meta["experts"]
    table = P.tensor_table(cfg, experts)
    stored = meta["tensors"]
    want = {s.key: s for s in table}
    if set(stored) != set(want):
        extra, missing = sorted(set(stored) - set(want)), sorted(set(want) - set(stored))
        raise CheckpointError(
            f"{ckpt_dir}: tensors do not match the tensor table (missing {missing[:3]}, "
            f"unexpected {extra[:3]}); re-run k3jax-convert"
        )
    for key, s in want.items():
        if tuple(stored[key]["shape"]) != s.shape:
            raise CheckpointError(
                f"{ckpt_dir}: {key} has shape {stored[key]['shape']}, the table says "
                f"{list(s.shape)}; re-run k3jax-convert"
            )
    check_files(ckpt_dir, verify)
    if mesh is not None:
        from k3jax.sharding import param_shardings

        shardings = P.flatten(param_shardings(cfg, mesh, experts), cfg, experts)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {s.path: dev for s in table}

    def target(s: P.TensorSpec):
        dt = jnp.dtype(stored[s.key]["dtype"])
        if dtype is not None and s.dtype == "bfloat16":
            dt = jnp.dtype(dtype)  # tensorstore casts while reading
        return jax.ShapeDtypeStruct(s.shape, dt, sharding=shardings[s.path])

    abstract = P.unflatten({s.path: target(s) for s in table})
    import orbax.checkpoint as ocp

    params_dir = os.path.join(os.path.abspath(ckpt_dir), meta.get("params", "params"))
    with errors.captured_logs() as logs:  # one failed read makes asyncio log every other task's: ~40k lines
        try:
            with ocp.StandardCheckpointer() as ckptr:
                params = ckptr.restore(params_dir, abstract)
        except Exception as e:  # orbax/tensorstore raise bare Exceptions with a page of spec dump; keep the gist
            log = logs.save("k3jax.load", e)
            if "tensorstore" not in str(e).lower():  # not a read of the files (device OOM, mesh): not their fault
                if log:
                    e.add_note(f"orbax's log of the failed restore: {log}")
                raise
            raise CheckpointError(
                f"{ckpt_dir}: weights are missing or corrupt ({_gist(e)}); re-run k3jax-convert (with "
                f"--overwrite) to rewrite it" + (f" (orbax's log: {log})" if log else "")
            ) from e
    return cfg, params


def _gist(e: Exception) -> str:
    """One line of an orbax/tensorstore error: its first sentence and the leaf (zarr directory) it names. Orbax
    wraps tensorstore's error (which names the file) in one that names only an index range: use the innermost."""
    while e.__cause__ is not None and "tensorstore" not in str(e).lower():
        e = e.__cause__
    while e.__cause__ is not None and "local file" in str(e.__cause__):
        e = e.__cause__
    msg = str(e)
    leaf = re.search(r"""path\\?['"]\s*:\s*\\?['"]([^'"\\]+)""", msg)  # 'path': '...' or \"path\":\"...\"
    first = re.split(r"\. See full TensorStore details| \[tensorstore_spec", msg)[0].splitlines()[0][:200]
    return f"{type(e).__name__}: {first}" + (f" in {os.path.basename(leaf[1].rstrip('/'))}" if leaf else "")
