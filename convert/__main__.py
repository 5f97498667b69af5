"""`k3jax-convert HF_DIR OUT_DIR` (= `python -m convert`): HF Kimi K3 checkpoint -> k3jax checkpoint."""

from __future__ import annotations

import argparse
import sys
import time

from convert.core import Options, convert
from convert.source import ConvertError
from k3jax.config import ConfigError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3jax-convert", description=__doc__)
    ap.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors shards)")
    ap.add_argument("out_dir", help="output directory (appears atomically when the conversion succeeds)")
    ap.add_argument(
        "--experts",
        choices=("mxfp4", "bf16"),
        default=None,
        help="keep routed experts packed MXFP4 (default when stored so) or dequantise to bf16",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="storage dtype of the bf16 trunk (fp32 tensors stay fp32, packed bytes stay packed)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size hint (chunking; recorded)")
    ap.add_argument("--workers", type=int, default=4, help="reader/writer threads (I/O-latency bound)")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    ap.add_argument("--verify", action="store_true", help="re-read the output and compare it with the source")
    ap.add_argument(
        "--checksum",
        choices=("fast", "full"),
        default="fast",
        help="source checksums: sampled fingerprint (fast) or sha256 of every byte (full)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    opts = Options(
        experts=a.experts,
        dtype=a.dtype,
        tp=a.tp,
        workers=a.workers,
        resume=a.resume,
        verify=a.verify,
        checksum=a.checksum,
        overwrite=a.overwrite,
        progress=not a.no_progress,
    )
    t0 = time.perf_counter()
    try:
        meta = convert(a.hf_dir, a.out_dir, opts)
    except (ConvertError, ConfigError) as e:
        print(f"k3jax-convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # finished parts are kept in OUT_DIR.tmp-*; nothing at OUT_DIR loads
        print(
            f"k3jax-convert: interrupted; {a.out_dir} was not written. Run the same command with --resume "
            "to continue from the finished parts",
            file=sys.stderr,
        )
        return 130
    dt = time.perf_counter() - t0
    src = meta["source"]
    nbytes = sum(int(_prod(t["shape"])) * _itemsize(t["dtype"]) for t in meta["tensors"].values())
    skipped = ", ".join(f"{n} {k}" for k, n in src["skipped"].items()) or "none"
    print(
        f"converted {src['tensors_read']} tensors into {len(meta['tensors'])} arrays "
        f"({nbytes / 1e9:.2f} GB, experts {meta['experts']}, dtype {meta['dtype']}) in {dt:.1f} s; "
        f"skipped: {skipped}; verified: {a.verify}; -> {a.out_dir}"
    )
    return 0


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4, "uint8": 1}[dtype]


if __name__ == "__main__":
    sys.exit(main())
