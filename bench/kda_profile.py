"""Where the KDA decode kernel's time goes at small batch, on one GPU.

  JAX_PLATFORMS=cuda,cpu python bench/kda_profile.py OUT_DIR

For B x H in (1, 6), (1, 12), (8, 6), (8, 12), (64, 6), (64, 12), the launch tuning.json picks (at 1 x 6 also
one CTA per tile and the split with the gmem gather, against the tuned split4 dsmem; the 384 and 768 tile rows
show each phase under HBM contention, where the kernel is at 67-68% of peak): CUPTI device time,
then Mosaic GPU's in-kernel trace of the named phases
(prologue: conv + gates + L2 norms; recurrence: the state read, update and output; gated_norm: with a split,
the gather's cluster barrier too; store_wait: the state's TMA store). Writes OUT_DIR/kda_profile.json.

  JAX_PLATFORMS=cuda,cpu python bench/kda_profile.py --sublayer OUT_DIR

The decode kernel as the TP16 sublayer runs it at B = 1 and 8 (8.5 us at B = 1 in kda_layer.json): fed by
the decode GEMV's fp32 partials (from_gemv), against the same kernel fed finished projections (5.5 us in
kda_decode.md's gates table), phases including "gates" (the f_b and b projections inside the prologue).
Writes OUT_DIR/kda_profile_sublayer.json.
"""

import functools
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.device_time import device_us  # noqa: E402
from bench.kda_decode import make_inputs  # noqa: E402
from bench.kernel_trace import phases  # noqa: E402
from pallas_kernels.kda_decode import kernel, sm90  # noqa: E402


def main_sublayer(out):
    from bench.kda_layer import layer_inputs
    from bench.rank_slice import init_local_params, local_cfg, truncate
    from k3jax.config import preset
    from pallas_kernels.gemv import api as gemv_api
    from pallas_kernels.gemv import kernel as gemv
    from pallas_kernels.kda_decode import reference

    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[])
    cfg = truncate(preset("k3"), 1)
    p = init_local_params(cfg, 16)["layers"][0]["attn"]
    lcfg = local_cfg(cfg, 16)
    for B in (1, 8):
        x, state, window = layer_inputs(lcfg, B)
        D = x.shape[1]
        rest = (state, window, p["conv"], p["A_log"], p["dt_bias"], p["o_norm"])
        qkvg_SN8, fa_SR8 = jax.jit(functools.partial(gemv.partials, **gemv_api.pick_launch(B, D)))(
            x, (p["qkvg"].reshape(-1, D), p["f_a"])
        )
        qkvg, fa = jax.jit(reference.project)(x, p["qkvg"], p["f_a"])
        H, K = window.shape[-2:]
        launch = dict(kernel.pick_launch(sm90.TUNING, jax.ShapeDtypeStruct((B, 3, H, K), x.dtype)), warpgroups=1)
        cases = {
            "from GEMV partials": ((qkvg_SN8, fa_SR8, p["f_b"], x, p["b"], qkvg_SN8, *rest), dict(from_gemv="NT")),
            "finished projections": ((qkvg[:, :3], fa, p["f_b"], x, p["b"], qkvg[:, 3], *rest), {}),
        }
        for name, (args, kw) in cases.items():
            tdir = os.path.join(out, f"kda sublayer trace B{B} {name}")
            os.makedirs(tdir, exist_ok=True)
            f = jax.jit(functools.partial(kernel.decode_gates, eps=1e-5, **launch, **kw))
            traced = jax.jit(functools.partial(kernel.decode_gates, eps=1e-5, profile_dir=tdir, **launch, **kw))
            jax.block_until_ready(traced(*args))
            row = dict(
                B=B,
                H=H,
                case=name,
                launch={k: str(v) for k, v in launch.items()},
                us=device_us(f, *args),
                phases_us=phases(tdir),
            )
            results["rows"].append(row)
            print(row, flush=True)
            with open(os.path.join(out, "kda_profile_sublayer.json"), "w") as fh:
                json.dump(results, fh, indent=1)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[])
    one_cta = dict(v_chunk=32, tma="chunked", v_split=1, gather="gmem")
    for B, H, over in (
        (1, 6, {}),
        (1, 6, one_cta),
        (1, 6, dict(one_cta, v_split=4)),
        (1, 12, {}),
        (8, 6, {}),
        (8, 12, {}),
        (64, 6, {}),
        (64, 12, {}),
    ):
        args = make_inputs(0, B, H)
        launch = dict(kernel.pick_launch(sm90.TUNING, args[0]), **over)
        tdir = os.path.join(out, f"kda trace B{B} H{H} split{launch['v_split']} {launch['gather']} {launch['tma']}")
        os.makedirs(tdir, exist_ok=True)
        f = jax.jit(functools.partial(kernel.decode, eps=1e-5, **launch))
        traced = jax.jit(functools.partial(kernel.decode, eps=1e-5, profile_dir=tdir, **launch))
        jax.block_until_ready(traced(*args))
        row = dict(
            B=B, H=H, launch={k: str(v) for k, v in launch.items()}, us=device_us(f, *args), phases_us=phases(tdir)
        )
        results["rows"].append(row)
        print(row, flush=True)
        with open(os.path.join(out, "kda_profile.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sublayer"]:
        main_sublayer(sys.argv[2] if len(sys.argv) > 2 else "bench/results")
    else:
        main()
