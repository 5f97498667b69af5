"""What a grid-wide barrier costs inside one launch (pallas_kernels.common.grid_barrier), against a launch: the
premise of every persistent-kernel lever in bench/NOTES.md (the routed experts at T <= 8 as one launch, the
4-launch layer of issue 28). If a barrier costs about what a launch does (~1.5-2 us), those levers gain little.

  PYTHONPATH=. python3 bench/grid_barrier.py [OUT_DIR] [--ctas 132,264] [--rounds 0,1,4,16]
  -> OUT_DIR/grid_barrier.{json,md} (OUT_DIR defaults to bench/results)

Rows, per grid of G one-warpgroup CTAs (all resident: G <= 16 a SM) and R rounds, CUPTI device us per call (the
launch and XLA's memset of the semaphore included; `kernels` names them):
  barriers   R barriers back to back, nothing else
  exchange   R rounds of: each CTA writes its [128] row of GMEM, a barrier, reads its neighbour's row (i + 1) into
             its sum, a barrier (2 R barriers); the sums checked against NumPy before timing
The slope over R is a barrier's (or a round's) cost; R = 0 is the launch alone.
"""

import argparse
import json
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.device_time import device_us, kernel_names
from pallas_kernels.common import grid_barrier

LANES = 128  # one warpgroup a CTA


def barriers(G: int, R: int):
    """A launch of G CTAs that pass R grid barriers and write their count -> [G, LANES] int32 (all R)."""

    def body(out_ref):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

        @pl.loop(0, R)
        def _(r):
            grid_barrier(sem, G, r + 1)

        out_ref[lax.axis_index("g")] = jnp.full((LANES,), R, jnp.int32)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((G, LANES), jnp.int32), grid=(G,), grid_names=("g",))


def exchange(G: int, R: int):
    """seed [G, LANES] int32 -> (the rows' last values [G, LANES], sums [G, LANES]): in round r CTA i writes
    seed[i] + r to its row, passes a barrier, adds its neighbour's row (i + 1 mod G) to its sum, passes another
    (nobody overwrites a row before its reader has read it). Wrong without the barriers' ordering."""

    def body(seed_ref, rows_ref, sums_ref):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        i = lax.axis_index("g")
        nxt = lax.rem(i + 1, G)

        def round_(r, acc):
            rows_ref[i] = seed_ref[i] + r
            grid_barrier(sem, G, 2 * r + 1)
            acc = acc + rows_ref[nxt]
            grid_barrier(sem, G, 2 * r + 2)
            return acc

        sums_ref[i] = lax.fori_loop(0, R, round_, jnp.zeros((LANES,), jnp.int32))

    out = jax.ShapeDtypeStruct((G, LANES), jnp.int32)
    return plgpu.kernel(body, out_type=(out, out), grid=(G,), grid_names=("g",))


def exchange_want(seed, R):
    """NumPy: exchange's outputs for seed [G, LANES]."""
    nxt = np.roll(seed, -1, axis=0).astype(np.int64)
    return seed + R - 1, (R * nxt + R * (R - 1) // 2).astype(np.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default="bench/results")
    ap.add_argument("--ctas", default="132,264")
    ap.add_argument("--rounds", default="0,1,4,16")
    args = ap.parse_args(argv)
    rows, out = [], pathlib.Path(args.out_dir)
    rng = np.random.default_rng()
    for G in map(int, args.ctas.split(",")):
        for R in map(int, args.rounds.split(",")):
            for form in ("barriers", "exchange"):
                row = {"form": form, "ctas": G, "rounds": R, "barriers": R * (2 if form == "exchange" else 1)}
                try:
                    if form == "barriers":
                        f, fargs = jax.jit(barriers(G, R)), ()
                        ok = bool(np.all(np.asarray(f()) == R))
                    else:
                        seed = rng.integers(0, 1 << 20, (G, LANES), dtype=np.int32)
                        f, fargs = jax.jit(exchange(G, R)), (jnp.asarray(seed),)
                        got = [np.asarray(a) for a in f(*fargs)]
                        pairs = zip(got, exchange_want(seed, R), strict=True)
                        ok = all(np.array_equal(g, w) for g, w in list(pairs)[R == 0 :])  # R = 0 writes no rows
                    row["correct"] = ok
                    row["us"] = device_us(f, *fargs)
                    row["kernels"] = kernel_names(f, *fargs)
                except Exception as e:  # noqa: BLE001
                    row["us"] = f"failed: {type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "grid_barrier.json").write_text(json.dumps(rows, indent=1))
    (out / "grid_barrier.md").write_text(markdown(rows))


def markdown(rows):
    """A row per (form, grid), a column per R: device us (barriers passed)."""
    Rs = sorted({r["rounds"] for r in rows})
    lines = [
        f"Grid barriers in one launch, CUPTI device us per call (launch and semaphore memset included), "
        f"{jax.devices()[0].device_kind}",
        "",
        "| form | CTAs | " + " | ".join(f"R = {R}" for R in Rs) + " | correct |",
        "|---|---|" + "---|" * (len(Rs) + 1),
    ]
    for form, G in dict.fromkeys((r["form"], r["ctas"]) for r in rows):
        cells = {r["rounds"]: r for r in rows if (r["form"], r["ctas"]) == (form, G)}
        txt = [
            f"{cells[R]['us']:.2f} ({cells[R]['barriers']})" if isinstance(cells.get(R, {}).get("us"), float) else ""
            for R in Rs
        ]
        good = all(c.get("correct", False) for c in cells.values())
        lines.append(f"| {form} | {G} | " + " | ".join(txt) + f" | {good} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
