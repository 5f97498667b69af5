"""The output side: one orbax PyTree checkpoint (no OCDBT, zarr v2 per leaf), written leaf by leaf.

Orbax's own save materialises each whole array on the host first; the release's per-layer expert stacks are
~5 GB each, so we write the same on-disk layout that `PyTreeCheckpointHandler(use_ocdbt=False)` produces
(a zarr array per leaf, named by its dotted path, plus `_METADATA`) directly with tensorstore, one stack entry
or row block at a time. `ocp.StandardCheckpointer().restore(dir, target)` then restores it with target
shardings, each device reading only the chunks of its shard. Chunks are uncompressed (weights do not compress,
and zstd would cost CPU on both sides) and cut along the axes a tensor-parallel loader splits.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time

import ml_dtypes
import numpy as np
import tensorstore as ts

from k3jax import params as P
from k3jax import sharding


def leaf_name(path) -> str:
    return ".".join(str(p) for p in path)


def np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _zarr_dtype(name: str) -> str:
    return "bfloat16" if name == "bfloat16" else np.dtype(name).str


def chunk_shape(spec: P.TensorSpec, dtype: str, tp: int, block_bytes: int) -> tuple[tuple[int, ...], int]:
    """(chunk shape, streamed axis). Stacked tensors are written one stack entry at a time (axis 0); large
    unstacked copy/reshape/T tensors in row blocks of <= block_bytes along the axis their HF rows map to."""
    c = list(spec.shape)
    for i, ax in enumerate(spec.axes):
        if tp > 1 and sharding.RULES.get(ax) and c[i] % tp == 0:  # TP-split axes
            c[i] //= tp
    if spec.stack is not None:
        c[0] = 1
        return tuple(c), 0
    axis = 1 if spec.transform == "T" else 0
    if spec.transform in ("copy", "reshape", "T") and len(c) > axis:
        per = math.prod(c) // c[axis] * np_dtype(dtype).itemsize
        c[axis] = max(1, min(c[axis], block_bytes // max(per, 1)))
    return tuple(c), axis


def open_leaf(params_dir: str, spec: P.TensorSpec, dtype: str, chunks, create: bool) -> ts.TensorStore:
    spec_json = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": os.path.join(params_dir, leaf_name(spec.path))},
    }
    if create:
        spec_json["metadata"] = {
            "shape": list(spec.shape),
            "chunks": list(chunks),
            "dtype": _zarr_dtype(dtype),
            "compressor": None,
            "dimension_separator": ".",
            "fill_value": None,
        }
        return ts.open(spec_json, create=True, delete_existing=True).result()
    return ts.open(spec_json, open=True).result()


def covered_chunks(idx: tuple, shape, chunks) -> list[tuple[int, ...]]:
    """Grid indices of the chunks that a write of `arr` at `t[idx]` fills (idx: ints and slices, one per leading
    axis; missing axes are whole). The converter's blocks start on chunk boundaries, so each chunk is written
    by exactly one block and can be hashed right after it."""
    ranges = []
    for ax, (n, c) in enumerate(zip(shape, chunks, strict=True)):
        i = idx[ax] if ax < len(idx) else slice(None)
        a, b = (i, i + 1) if isinstance(i, int) else i.indices(n)[:2]
        if a % c:
            raise ValueError(f"block {idx} does not start on a chunk boundary of {list(chunks)}")
        ranges.append(range(a // c, -(-b // c)))
    return list(itertools.product(*ranges))


def write_metadata(params_dir: str, table: list[P.TensorSpec]):
    """orbax `_METADATA` (tree structure; leaves restore as arrays) and `_CHECKPOINT_METADATA`."""
    tree = {}
    for spec in table:
        parts = tuple(str(p) for p in spec.path)
        tree[str(parts)] = {
            "key_metadata": [
                {"key": p, "key_type": 1 if isinstance(q, int) else 2} for p, q in zip(parts, spec.path, strict=True)
            ],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
    meta = {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    with open(os.path.join(params_dir, "_METADATA"), "w") as f:
        json.dump(meta, f)
    now = time.time_ns()
    with open(os.path.join(params_dir, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(
            {
                "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
                "metrics": {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {},
            },
            f,
        )
