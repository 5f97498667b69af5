"""PROJECTION of GB300 TP16 decode tokens/s from what one H200 measured (labeled as such everywhere).

  step_GB300(B) = rank-slice step device time on H200 (B) x (4.8 / 8.0)        memory-bound part, HBM ratio
                + sum over the step's collectives of the measured per-call latency at that message size

Inputs: bench/results/rank_slice*.json (bench/rank_slice.py: step time and the collectives one step issues, as
traced by StubComm) and bench/results/collectives.json (bench/collectives.py: CUPTI device time per call on
2 x H200). Assumptions, stated in the output: per-call latency is the TP2 measurement (TP16 one-shot pushes to
15 peers: it will not be cheaper); an all-gather costs what an all-reduce of its input message costs; messages
larger than the measured ones add bytes / 450 GB/s; nothing overlaps (no collective hides behind weight reads).
"""

from __future__ import annotations

import json
import math
import os

HBM_H200, HBM_GB300 = 4.8e12, 8.0e12
LINK_BW = 450e9  # NVLink 4 per direction, 18 links x 25 GB/s (bench/collectives.py's NVLINK_BYTES_PER_S)
ANCHORS = [  # docs/roofline.md §6, published, TP16 on 16 x GB300 unless noted
    ("vLLM stock (day 0)", 1, 118.0),
    ("vLLM stock (later)", 1, 136.0),
    ("vLLM latency_specialized", 1, 256.4),
    ("vLLM latency_specialized", 64, 3606.1),
    ("Inferact Pallas megakernel (16x TPU v7)", 1, 249.0),
]
HERE = os.path.dirname(os.path.abspath(__file__))


def load_collectives(path: str | None = None) -> dict:
    """{op: {(batch, d): us_per_call}} from bench/collectives.json (psum = NCCL, one_shot_st = Pallas)."""
    path = path or os.path.join(HERE, "results", "collectives.json")
    with open(path) as f:
        bench = json.load(f)["bench"]
    table: dict = {}
    for e in bench:
        if "us_per_call" in e and "batch" in e and "d" in e:
            table.setdefault(e["op"], {})[(e["batch"], e["d"])] = e["us_per_call"]
    return table


def call_us(table: dict, op: str, nbytes: int) -> float:
    """Latency of one collective moving `nbytes` per rank: the measured call with the nearest size at or above
    it (bf16 [batch, d] messages), plus bytes beyond the largest measured message at LINK_BW."""
    sizes = sorted((2 * b * d, us) for (b, d), us in table[op].items())
    for size, us in sizes:
        if size >= nbytes:
            return us
    size, us = sizes[-1]
    return us + 1e6 * (nbytes - size) / LINK_BW


def collective_us(calls: list, table: dict, op: str) -> float:
    """calls: StubComm.log entries (kind, what, shape, dtype). Gathers are charged on their input message."""
    total = 0.0
    for _, _, shape, dtype in calls:
        itemsize = 4 if "32" in dtype else 2
        total += call_us(table, op, math.prod(shape) * itemsize)
    return total


def project(run: dict, table: dict, full_layers: int, op: str = "psum") -> dict:
    """One rank-slice run entry -> projected GB300 TP16 step and tokens/s (uses the full-depth estimate)."""
    step = run.get("full_estimate_us") or run["step_us"]
    calls = run["collective_calls"]
    if run["layers"] != full_layers:
        calls = scale_calls(calls, run["layers"], full_layers)
    mem = step * HBM_H200 / HBM_GB300
    coll = collective_us(calls, table, op)
    total = mem + coll
    return {
        "batch": run["batch"],
        "backend": run["backend"],
        "layers_measured": run["layers"],
        "collective_op": op,
        "h200_step_us": step,
        "memory_term_us": mem,
        "collectives_per_step": len(calls),
        "collective_term_us": coll,
        "step_us": total,
        "tokens_per_s": run["batch"] * 1e6 / total,
        "tokens_per_s_no_collectives": run["batch"] * 1e6 / mem,
    }


def scale_calls(calls: list, layers: int, full: int) -> list:
    """A truncated run's collectives -> the full model's: per-layer calls x full/layers, embed/logits once."""
    once = [c for c in calls if c[1] in ("embed", "logits")]
    per_layer = [c for c in calls if c[1] not in ("embed", "logits")]
    n = round(len(per_layer) * (full - 1) / max(layers - 1, 1))  # layer 0 (dense) is in both
    return once + [per_layer[i % len(per_layer)] for i in range(n)]


def markdown(rows: list[dict]) -> str:
    lines = [
        "## PROJECTION: GB300 TP16 decode tokens/s (not a measurement)",
        "",
        "step = H200 rank-slice step x 4.8/8.0 (HBM ratio) + collectives per step x measured per-call "
        "latency (2 x H200, CUPTI, bench/results/collectives.json). Per-call latency measured at TP2 (TP16 will "
        "not be cheaper), gathers charged like an all-reduce of their input, no overlap assumed.",
        "",
        "| backend | collectives via | batch | H200 step us | memory term us | collectives/step | "
        "collective term us | projected step us | projected tok/s | tok/s if collectives were free |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['collective_op']} | {r['batch']} | {r['h200_step_us']:.0f} | "
            f"{r['memory_term_us']:.0f} | {r['collectives_per_step']} | {r['collective_term_us']:.0f} | "
            f"{r['step_us']:.0f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_no_collectives']:.0f} |"
        )
    lines += [
        "",
        "Published anchors (docs/roofline.md §6; measured by their authors on 16 x GB300 / 16 x TPU v7):",
        "",
        "| system | batch | tok/s |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {b} | {t} |" for name, b, t in ANCHORS]
    return "\n".join(lines) + "\n"
