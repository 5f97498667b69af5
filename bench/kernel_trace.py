"""Reading Mosaic GPU's in-kernel traces (CompilerParams(profile_space=..., profile_dir=...)).

A kernel compiled with a profile_dir writes one Chrome-trace JSON per call there, with a begin/end event pair
per `jax.named_scope` phase per warpgroup. The kernel must run with a CPU device beside the GPUs
(JAX_PLATFORMS=cuda,cpu): the trace buffer comes back through a host callback.
"""

import glob
import json
import os

import numpy as np


def phases(trace_dir) -> dict:
    """{phase: {"mean_us", "count", "total_us"}} over every warpgroup's spans of the newest trace in trace_dir
    (count / warpgroups = the phase's occurrences a warpgroup, e.g. a loop's iterations)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "*.json")), key=os.path.getmtime)[-1]
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    open_at, spans = {}, {}
    for e in events:
        if e.get("ph") not in ("B", "E"):
            continue
        key = (e["pid"], e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        elif key in open_at:
            spans.setdefault(e["name"], []).append(e["ts"] - open_at.pop(key))
    return {k: {"mean_us": float(np.mean(v)), "count": len(v), "total_us": float(np.sum(v))} for k, v in spans.items()}
