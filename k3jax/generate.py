"""`python -m k3jax.generate`: prompt in, tokens out.

With no --checkpoint it runs the embedded demo: a tiny K3-architecture model with RANDOM weights, written by
convert/fake_hf.py, converted by the real converter and cached in the user's cache directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from pallas_kernels import policy as policy_lib

DEMO_SEED = 0


def demo_checkpoint(log=print) -> str:
    """Make (once) and return the demo checkpoint directory; a cached one that fails its file checks (made
    before checkpoints had manifests, or damaged) is rebuilt: it is ours, made in ~20 s."""
    import tempfile

    from convert.core import Options, convert
    from convert.fake_hf import write_fake_hf
    from k3jax import checkpoint, errors, manifest
    from k3jax.config import preset
    from k3jax.params import TABLE_VERSION

    root = errors.cache_root()
    cfg = preset("demo")
    tag = hashlib.sha256(json.dumps([cfg.to_hf(), DEMO_SEED]).encode()).hexdigest()[:8]
    out = os.path.join(root, f"demo-v{TABLE_VERSION}-{tag}")  # a changed demo config never reuses a stale one
    if os.path.exists(out):
        try:
            checkpoint.check_files(out, workers=2)
            return out
        except checkpoint.CheckpointError as e:
            old = f"no {manifest.MANIFEST}" in str(e)
            why = "it was made before checkpoints had manifests" if old else "its files differ from its manifest"
            log(f"[demo] rebuilding the cached demo model in {out} ({why})")
    else:
        log(f"[demo] making the embedded demo model (tiny K3 architecture, random weights) in {out}")
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as hf:
        write_fake_hf(hf, cfg, seed=DEMO_SEED, shards=2, tokenizer=True)
        convert(hf, out, Options(progress=False, overwrite=True))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="k3jax-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="converted checkpoint (k3jax-convert); default: the embedded demo")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="raw token ids, comma separated (no tokenizer needed)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in K3's chat markup (one user turn)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding (the default; same as --temperature 0)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    ap.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off; needs --temperature > 0)"
    )
    ap.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off; needs --temperature > 0)"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per sequence (default 32)")
    ap.add_argument("--max-len", type=int, default=None, help="cache positions per sequence (default: fits)")
    ap.add_argument("--batch", type=int, default=1, help="run the prompt as this many sequences (<= 64)")
    ap.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype (float32 for verification)"
    )
    ap.add_argument("--cache-dtype", choices=("fp8", "bf16"), default="fp8", help="MLA latent cache dtype")
    ap.add_argument(
        "--decode-backend",
        choices=policy_lib.BACKENDS + tuple(policy_lib.BACKEND_ALIASES),
        default="auto",
        help="auto (xla is the same): stock XLA; latency_specialized: Pallas GPU kernels where they apply "
        "(each refusal logged once; --json reports what ran)",
    )
    ap.add_argument(
        "--moe-impl",
        choices=policy_lib.MOE_IMPLS,
        default="packed",
        help="how the XLA routed experts read MXFP4: straight from the packed codes (default) or via a bf16 copy",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices across all processes)")
    ap.add_argument("--coordinator", help="jax.distributed coordinator host:port (multi-host)")
    ap.add_argument("--num-processes", type=int, help="processes in a multi-host job (one per host)")
    ap.add_argument("--process-id", type=int, help="this process's index in 0..num-processes-1")
    ap.add_argument(
        "--spec",
        choices=("none", "dspark", "ngram", "synthetic"),
        default="none",
        help="speculative decoding: DSpark drafter, prompt-lookup n-grams, or synthetic acceptance",
    )
    # None = not given: a speculative flag without --spec is refused instead of silently ignored
    ap.add_argument("--num-draft", type=int, default=None, help="draft tokens per step, 1..7 (default 7)")
    ap.add_argument("--draft-checkpoint", help="HF DSpark drafter directory (--spec dspark)")
    ap.add_argument(
        "--acceptance-length",
        type=float,
        default=None,
        help="--spec synthetic: tokens per step counting the bonus (default 6; benchmark mode, text is meaningless)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_checkpoint_flags(ap)
    return ap.parse_args(argv)


def _add_checkpoint_flags(ap) -> None:
    ap.add_argument(
        "--verify-checkpoint",
        action="store_true",
        help="check every checkpoint file's checksum before loading (a full read; sizes are always checked)",
    )
    ap.add_argument("--verbose", action="store_true", help="library logs and full tracebacks on the terminal")


def main(argv=None) -> int:
    from k3jax import errors

    args = parse_args(argv)
    # our errors are ValueErrors with a message saying what to do: one line; anything else names a log file
    return errors.cli_main("k3jax-generate", lambda: _run(args), verbose=args.verbose, label="")


def _check_sampling_flags(args, sp) -> None:
    """Refuse flags that greedy decoding would silently ignore: the user asked for sampling and would get argmax."""
    if args.greedy and args.temperature != 0:
        raise ValueError(f"--greedy contradicts --temperature {args.temperature}: give one of them")
    if sp.greedy and (sp.top_k or sp.top_p < 1):
        raise ValueError(
            "--top-k/--top-p only act when sampling, and decoding is greedy (temperature 0): "
            "add --temperature, e.g. --temperature 0.7"
        )


def _check_spec_flags(args) -> None:
    """Speculative flags: refuse impossible or ignored combinations, then fill in the defaults (in place)."""
    given = [
        f
        for f, v in (
            ("--num-draft", args.num_draft),
            ("--draft-checkpoint", args.draft_checkpoint),
            ("--acceptance-length", args.acceptance_length),
        )
        if v is not None
    ]
    if args.spec == "none" and given:
        raise ValueError(
            f"{', '.join(given)} given but --spec is none (they only act in speculative decoding): "
            "add --spec dspark|ngram|synthetic or drop them"
        )
    if args.draft_checkpoint is not None and args.spec != "dspark":
        raise ValueError(f"--draft-checkpoint is only used by --spec dspark, not --spec {args.spec}")
    if args.acceptance_length is not None and args.spec != "synthetic":
        raise ValueError(f"--acceptance-length is only used by --spec synthetic, not --spec {args.spec}")
    args.num_draft = 7 if args.num_draft is None else args.num_draft
    args.acceptance_length = 6.0 if args.acceptance_length is None else args.acceptance_length
    if args.spec == "none":
        return
    if not 1 <= args.num_draft <= 7:
        raise ValueError(f"--num-draft must be in 1..7, got {args.num_draft}")
    if args.spec == "dspark" and not args.draft_checkpoint:
        raise ValueError("--spec dspark needs --draft-checkpoint DIR (an HF DSpark drafter directory)")
    if args.spec == "synthetic" and not 1 <= args.acceptance_length <= args.num_draft + 1:
        raise ValueError(
            f"--acceptance-length must be in [1, num_draft + 1 = {args.num_draft + 1}], got {args.acceptance_length}"
        )


def _read_prompt(args) -> str | None:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file) as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    if args.prompt_ids is None and not sys.stdin.isatty():
        return sys.stdin.read() or None  # an empty pipe is no prompt
    return None


def _run(args) -> int:
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    # Validate everything cheap before touching devices or files.
    from k3jax.sampling import SamplingParams

    sp = SamplingParams(
        temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    _check_sampling_flags(args, sp)
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        text = None
    else:
        ids, text = None, _read_prompt(args)
        if text is None:
            if args.checkpoint is not None:
                raise ValueError("no prompt: give --prompt, --prompt-file, --prompt-ids or text on stdin")
            text = "the quick brown fox"
            log(f"[demo] no prompt given; using {text!r}")
    _check_spec_flags(args)
    policy = policy_lib.DecodePolicy(args.decode_backend, args.moe_impl)  # the one decode policy of this run
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1 (1 = one device), got {args.tp}")
    if args.coordinator or args.num_processes or args.process_id is not None:  # any of them: a multi-host start
        from k3jax import distributed

        distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import jax
    import jax.numpy as jnp

    from k3jax import checkpoint
    from k3jax.engine import MAX_BATCH, Engine, check_request
    from k3jax.sharding import make_mesh, validate_tp
    from k3jax.tokenizer import Tokenizer, TokenizerError

    if not 1 <= args.batch <= MAX_BATCH:
        raise ValueError(f"--batch must be in 1..{MAX_BATCH} (one cache slot per sequence), got {args.batch}")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = demo_checkpoint(log)
        log(
            "[demo] running the embedded demo model: tiny K3 architecture with RANDOM weights, "
            "so the text is gibberish; pass --checkpoint for a real model"
        )
    cfg = checkpoint.load_config(ckpt)
    if args.tp > 1:
        validate_tp(cfg, args.tp)
    if args.spec == "dspark":  # a drafter for another target fails deep inside jit: check its config first
        from k3jax import drafter_params

        dcfg = drafter_params.read_config(args.draft_checkpoint)
        drafter_params.check_target(dcfg, cfg)
        drafter_params.check_tp(dcfg, args.tp)  # its layers split over --tp as the target's
    tok = None
    try:
        tok = Tokenizer.from_dir(ckpt)
    except TokenizerError as e:
        if ids is None:
            raise ValueError(f"a text prompt needs tokenizer files: {e}") from None
    if ids is None:
        ids = tok.chat_prompt(text) if args.chat else tok.encode(text)
        if not ids:
            raise ValueError("the prompt is empty: give some text or --prompt-ids")
    # speculative steps write up to num_draft + 1 positions past the last kept token
    need = args.max_new_tokens + (args.num_draft + 1 if args.spec != "none" else 0)
    max_len = args.max_len or _round_up(len(ids) + need, 64)
    prompts = [ids] * args.batch
    if args.spec != "none" and len(ids) + need > max_len:  # say where the extra positions come from
        raise ValueError(
            f"the prompt has {len(ids)} tokens; --max-new-tokens {args.max_new_tokens} plus the "
            f"{args.num_draft + 1} positions a speculative step writes ahead need {len(ids) + need} "
            f"cache positions but --max-len is {max_len}: raise --max-len or lower --max-new-tokens"
        )
    check_request(cfg, prompts, need, max_len, args.batch)  # before reading a byte of weights
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-len {max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    if dtype == jnp.float32:
        jax.config.update("jax_default_matmul_precision", "highest")
    mesh = make_mesh(args.tp) if args.tp > 1 else None
    t0 = time.perf_counter()
    cfg, params = checkpoint.load(ckpt, mesh=mesh, dtype=dtype, verify=args.verify_checkpoint)
    log(
        f"loaded {ckpt} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}) in "
        f"{time.perf_counter() - t0:.1f}s on {args.tp} device(s) [{jax.devices()[0].platform}]"
    )
    stop = tok.stop_ids if tok is not None else (cfg.eos_token_id,)
    if args.spec != "none":
        with policy_lib.recording(policy_lib.DispatchLog()) as ran:  # the speculative prefill and step, traced
            res = _speculative(args, cfg, params, prompts, sp, stop, dtype, mesh, max_len, policy)
        decode_ops = ran.ops
    else:
        eng = Engine(
            cfg,
            params,
            max_len=max_len,
            max_batch=args.batch,
            dtype=dtype,
            cache_dtype=args.cache_dtype,
            policy=policy,
            mesh=mesh,
        )
        progress = _progress(args, log, tok)
        res = eng.generate(prompts, args.max_new_tokens, sp, stop_ids=stop, on_tokens=progress)
        progress.bar.close()
        decode_ops = eng.decode_ops()
    out = {
        "prompt_ids": ids,
        "generated_ids": res.tokens,
        "text": [tok.decode(t) for t in res.tokens] if tok is not None else None,
        "ttft_s": res.ttft_s,
        "decode_tokens_per_s": res.decode_tokens_per_s,
        "decode_tokens": res.decode_tokens,
        "batch": args.batch,
        "decode_backend": policy.backend,
        "moe_impl": policy.moe_impl,
        "decode_ops": decode_ops,  # op -> {"impl": "pallas" | "xla", "reason": why not the kernel}
        "tp": args.tp,
        "spec": args.spec,
        **({"spec_stats": res.stats} if res.stats else {}),
    }
    if jax.process_index() != 0:  # multi-host: every process ran the same program; one of them reports
        return 0
    if args.json:
        print(json.dumps(out))
    else:
        for b, t in enumerate(res.tokens):
            shown = out["text"][b] if tok is not None else ",".join(map(str, t))
            log(f"--- sequence {b}: {len(t)} tokens ---\n{shown}")
        log(
            f"TTFT {res.ttft_s * 1e3:.1f} ms (includes compilation on the first run); decode "
            f"{res.decode_tokens_per_s:.1f} tokens/s excluding prefill ({res.decode_tokens} tokens)"
        )
    return 0


def _speculative(args, cfg, params, prompts, sp, stop, dtype, mesh, max_len, policy):
    """Speculative generation (k3jax.speculative): the whole loop runs on device (sharded over `mesh`)."""
    import jax
    import numpy as np

    from k3jax import drafter as drafters
    from k3jax import speculative
    from k3jax.engine import Result

    draft_params = None
    if args.spec == "dspark":
        from k3jax import drafter_params

        dcfg, draft_params = drafter_params.load(args.draft_checkpoint, dtype=dtype)
        drafter = drafters.DSparkDrafter(dcfg)
    else:
        drafter = drafters.NgramDrafter()
    prompt = np.array(prompts, np.int32)
    run = lambda: speculative.generate(  # noqa: E731
        params,
        cfg,
        prompt,
        np.full((len(prompts),), prompt.shape[1]),
        drafter=drafter,
        draft_params=draft_params,
        num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        acceptance_length=args.acceptance_length if args.spec == "synthetic" else None,
        seed=sp.seed,
        dtype=dtype,
        policy=policy,
        stop_ids=stop,
        cache_dtype=args.cache_dtype,
        max_len=max_len,
        mesh=mesh,
    )
    t0 = time.perf_counter()
    toks, stats = run()
    jax.block_until_ready(toks)
    first = time.perf_counter() - t0  # includes compilation
    t0 = time.perf_counter()
    toks, stats = run()  # timed run, compiled
    toks = np.asarray(toks)
    dt = time.perf_counter() - t0
    out = []
    for row in toks.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        out.append(row[:cut])
    n = sum(len(r) for r in out)
    stats = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in stats.items()}
    return Result(out, [len(p) for p in prompts], first, dt, n, stats)


def _round_up(n, m):
    return -(-n // m) * m


def _progress(args, log, tok):
    """Stream tokens between device chunks: a progress bar (tqdm) on stderr."""
    from tqdm import tqdm

    total = args.max_new_tokens * args.batch
    bar = tqdm(
        total=total,
        unit="tok",
        desc="generating",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty() and not os.environ.get("K3JAX_PROGRESS"),
    )

    def on_tokens(toks, emitted):
        bar.update(int(emitted.sum()))

    on_tokens.bar = bar
    return on_tokens


if __name__ == "__main__":
    sys.exit(main())
