"""Test helpers: random parameters in our layout and the same tensors in HF layout for the NumPy oracle."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import params as P
from k3jax.transforms import params_to_hf


def edit_json(path, edit) -> None:
    """Load a JSON file, let `edit` change the dict in place, write it back (bad-input tests)."""
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


# Two fp32 paths through the same model (bf16 cache vs none, another batch shape or summation order) differ by
# up to ~2e-5 of the logits' RMS. Where the top two logits are closer than NEAR_TIE of that RMS either token is a
# correct greedy choice; a random tiny model puts ~3e-4 of its rows that close (top-2 gap / RMS has density ~3.3
# at 0, measured over 3840 rows), so greedy-equality tests skip those rows (or stop at them: the paths part there).
NEAR_TIE = 1e-4


def near_tie(logits_NV):
    """[N] bool: rows whose top-2 logit gap is below NEAR_TIE of the row's RMS."""
    x = np.asarray(logits_NV, np.float64)
    top2 = np.sort(x, -1)[..., -2:]
    return top2[..., 1] - top2[..., 0] < NEAR_TIE * np.sqrt(np.mean(x * x, -1))


# The oracle's router picks a token's experts by its biased scores; where the k-th and (k+1)-th are closer than
# a float32 path's error there (~3e-6 after 14 layers), the two paths may pick different experts and the logits
# part by O(0.1) (seen once in ~500 draws of test_layers' 14-layer model: a gap of 4.5e-7). Such a draw is
# redrawn, not compared.
ROUTE_TIE = 1e-5


def oracle_clear_of_route_ties(hf, tc, draw_tokens, tries: int = 8):
    """(tokens, the oracle's logits) for the first draw_tokens() whose routing has no near-tie (ROUTE_TIE)."""
    import np_reference

    for _ in range(tries):
        tokens = draw_tokens()
        with np_reference.record_routing_margins() as margins:
            logits = np_reference.forward(hf, tc, tokens)
        if min(margins, default=1.0) >= ROUTE_TIE:
            return tokens, logits
    raise AssertionError(f"{tries} draws of tokens all routed within {ROUTE_TIE} of a tie: a degenerate model")


def random_model(cfg, seed, dtype=jnp.float32):
    """(params in the compute dtype, HF dict for np_reference keyed without the language_model. prefix)."""
    params = P.init_params(cfg, seed)
    table = P.tensor_table(cfg)
    flat = {s.path: np.asarray(jax.device_get(P.get_path(params, s.path))) for s in table}
    hf = params_to_hf(flat, table)
    hf_ref = {}
    for name, arr in hf.items():
        name = name.removeprefix("language_model.")
        name = name.removeprefix("model.")
        hf_ref[name] = arr if arr.dtype == np.uint8 else np.asarray(arr, np.float64)
    return P.cast_params(params, dtype), hf_ref


def assert_cli_refused(capsys, argv, msg):
    """k3jax.generate refuses argv up front: exit 2, nothing generated, one 'error: ...' naming msg."""
    from k3jax import generate

    capsys.readouterr()  # drop what fixtures printed (seed lines)
    rc = generate.main(argv)
    out = capsys.readouterr()
    assert rc == 2, (argv, out.err)
    assert out.out == "", "something was generated"
    assert out.err.startswith("error: ") and msg in out.err, out.err
