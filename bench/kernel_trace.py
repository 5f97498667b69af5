"""Reading Mosaic GPU's in-kernel traces (CompilerParams(profile_space=..., profile_dir=...)).

A kernel compiled with a profile_dir writes one Chrome-trace JSON per call there, with a begin/end event pair
per `jax.named_scope` phase per warpgroup. The kernel must run with a CPU device beside the GPUs
(JAX_PLATFORMS=cuda,cpu): the trace buffer comes back through a host callback.
"""

import glob
import json
import os

import numpy as np


def phases(trace_dir):
    """Mean duration (us) of each named phase over the warpgroups of the newest trace in trace_dir."""
    path = sorted(glob.glob(os.path.join(trace_dir, "*.json")))[-1]
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    open_at, spans = {}, {}
    for e in events:
        key = (e["pid"], e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        else:
            spans.setdefault(e["name"], []).append(e["ts"] - open_at.pop(key))
    return {k: float(np.mean(v)) for k, v in spans.items()}
