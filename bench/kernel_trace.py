"""Reading Mosaic GPU's in-kernel traces (CompilerParams(profile_space=..., profile_dir=...)).

A kernel compiled with a profile_dir writes one Chrome-trace JSON per call there, with a begin/end event pair
per `jax.named_scope` phase per warpgroup. The kernel must run with a CPU device beside the GPUs
(JAX_PLATFORMS=cuda,cpu): the trace buffer comes back through a host callback.
"""

import glob
import json
import os

import numpy as np


def _spans(trace_dir) -> dict:
    """{phase: [(begin, end)]} over every warpgroup of the newest trace in trace_dir (microseconds)."""
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
            spans.setdefault(e["name"], []).append((open_at.pop(key), e["ts"]))
    return spans


def phases(trace_dir) -> dict:
    """{phase: {"mean_us", "count", "total_us"}} over every warpgroup's spans of the newest trace in trace_dir
    (count / warpgroups = the phase's occurrences a warpgroup, e.g. a loop's iterations)."""
    out = {}
    for k, v in _spans(trace_dir).items():
        d = np.array([e - b for b, e in v])
        out[k] = {"mean_us": float(d.mean()), "count": len(d), "total_us": float(d.sum())}
    return out


def timeline(trace_dir) -> dict:
    """When each phase runs in the kernel, relative to the trace's first span: {phase: {"first_begin_us",
    "mean_begin_us", "last_end_us"}}, and "span_us" (first begin to last end): for kernels of short CTAs, where
    a CTA's first span starts (its launch and loads before it) says as much as how long the spans take."""
    spans = _spans(trace_dir)
    t0 = min(b for v in spans.values() for b, _ in v)
    out = {
        k: {
            "first_begin_us": float(min(b for b, _ in v) - t0),
            "mean_begin_us": float(np.mean([b for b, _ in v]) - t0),
            "last_end_us": float(max(e for _, e in v) - t0),
        }
        for k, v in spans.items()
    }
    out["span_us"] = max(x["last_end_us"] for x in out.values())
    return out
