"""Where a step's wall time goes between its kernels: a profiler trace of a few back-to-back steps, read as a
device timeline (every kernel, memcpy and memset on the GPU's streams, with start times).

Why: CUPTI's kernel sum (bench/device_time.py, rank_slice's step_us) leaves out the time between kernels and
non-kernel work. This says where the device idles (between steps: the host's dispatch; between kernels, by the
waiting kernel's kind) and what memcpy / memset adds (jax's trace of this stack records no host driver calls).

    summary = trace_steps(lambda: run_steps(n), n)   # on a GPU; CPU traces have no device plane -> None
"""

from __future__ import annotations

import glob
import tempfile
from collections import Counter, defaultdict

import jax


def kind(name: str) -> str:
    """A device event's kind: memcpy, memset, mosaic (a Pallas Mosaic GPU kernel) or xla (every other kernel)."""
    low = name.lower()
    if "memcpy" in low:
        return "memcpy"
    if "memset" in low:
        return "memset"
    return "mosaic" if "mosaic_gpu" in low else "xla"


def device_events(xspace) -> list[tuple[int, int, str]]:
    """(start_ns, end_ns, name) of every event on the first GPU's streams, by start time; a memcpy or memset is
    named by its HLO op where the trace says which ("MemcpyD2D copy.3"), so a step's copies can be traced back."""
    out = []
    for plane in xspace.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                for e in line.events:
                    name = e.name
                    if kind(name) in ("memcpy", "memset"):
                        op = dict(e.stats).get("hlo_op")
                        name = f"{name} {op}" if op else name
                    out.append((int(e.start_ns), int(e.end_ns), name))
    return sorted(out)


def summarize(events: list[tuple[int, int, str]], steps: int, top: int = 12) -> dict:
    """Per step: the span from the first event's start to the last one's end, the time some event runs (their
    union), the sum of each kind's durations and counts, and the idle time between consecutive events by the
    kind of the event that waits (the next one), plus the largest gaps with their neighbours."""
    if not events:
        return {}
    busy, end_max = 0, events[0][0]
    dur, count, gap_by = Counter(), Counter(), Counter()
    gaps = []
    for (s, e, name), nxt in zip(events, events[1:] + [None], strict=True):
        busy += max(0, e - max(s, end_max))
        end_max = max(end_max, e)
        dur[kind(name)] += e - s
        count[kind(name)] += 1
        if nxt is not None and nxt[0] > end_max:
            g = nxt[0] - end_max
            gap_by[kind(nxt[2])] += g
            gaps.append((g, name, nxt[2]))
    span = end_max - events[0][0]
    us = 1e-3 / steps
    gaps.sort(reverse=True)
    return {
        "steps": steps,
        "span_us_per_step": span * us,
        "busy_us_per_step": busy * us,
        "idle_us_per_step": (span - busy) * us,
        "us_per_step_by_kind": {k: v * us for k, v in dur.items()},
        "events_per_step_by_kind": {k: v / steps for k, v in count.items()},
        "idle_us_per_step_before_kind": {k: v * us for k, v in gap_by.items()},
        "idle_us_per_event_before_kind": {k: gap_by[k] / count[k] * 1e-3 for k in gap_by},
        "largest_gaps": [[round(g * 1e-3, 2), a, b] for g, a, b in gaps[:top]],
        "copies_per_step": {
            n: c / steps for n, c in Counter(n for *_, n in events if kind(n) in ("memcpy", "memset")).most_common(top)
        },
    }


def trace_steps(run, steps: int) -> dict | None:
    """Run `run()` (which runs and waits for `steps` steps) under the profiler with the Python tracer off; ->
    summarize(...) of its device timeline, or None without a GPU plane."""
    from jaxlib import _profile_data

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, profiler_options=opts):
            run()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            return None
        xspace = _profile_data.ProfileData.from_file(files[0])
        events = device_events(xspace)
        if not events:
            return None
        out = summarize(events, steps)
        lines = defaultdict(int)
        for plane in xspace.planes:
            if plane.name.startswith("/device:GPU:0"):
                for line in plane.lines:
                    lines[line.name] += len(list(line.events))
        out["device_lines"] = dict(lines)
    return out
