"""CPU smoke tests of the decode benchmark tools: structure of what they write, not timings."""

import json
import math
import pathlib
import re
import shutil
import subprocess
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import decode, projection
from bench import rank_slice as rs
from k3jax import sharding as sh
from k3jax.config import preset
from pallas_kernels.policy import DecodePolicy
from tests.kernel_testbase import abstract_gpu, cpu_only


def test_engine_mode_writes_json_md_png(tmp_path):
    rep = decode.run(
        decode.parse_args(
            [
                "--preset",
                "demo",
                "--batches",
                "1,2",
                "--input-len",
                "5",
                "--output-len",
                "3",
                "--steps-per-call",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
    )
    data = json.loads((tmp_path / "decode_demo_auto_tp1.json").read_text())
    assert {
        "machine",
        "mode",
        "config",
        "tp",
        "decode_backend",
        "speculative",
        "input_len",
        "output_len",
        "rows",
    } <= set(data)
    assert data["machine"]["jax"] and data["machine"]["date"]
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        assert r["decode_tokens"] == 2 * r["batch"]  # output 3 = first token from prefill + 2 decode steps
        assert r["ttft_s"] > 0 and r["tokens_per_s"] > 0
    assert (tmp_path / "decode_demo_auto_tp1.png").stat().st_size > 0
    assert "| 2 |" in (tmp_path / "decode_demo_auto_tp1.md").read_text()
    assert rep["files"]


def test_speculative_synthetic_mode(tmp_path):
    """Synthetic acceptance with L=6, K=7 is deterministic: every step accepts exactly 5 drafts + the bonus."""
    L, K, out_len = 6, 7, 13  # 12 decode tokens after the prefill's first one: exactly 2 steps of 6
    decode.run(
        decode.parse_args(
            [
                "--preset",
                "demo",
                "--batches",
                "2",
                "--input-len",
                "5",
                "--output-len",
                str(out_len),
                "--speculative",
                "synthetic",
                "--acceptance-length",
                str(L),
                "--num-draft",
                str(K),
                "--out",
                str(tmp_path),
            ]
        )
    )
    data = json.loads((tmp_path / "decode_demo_auto_tp1_spec-synthetic.json").read_text())
    assert data["speculative"] == "synthetic" and data["num_draft"] == K and data["acceptance_length"] == L
    (r,) = data["rows"]
    assert r["batch"] == 2 and r["decode_tokens"] == 2 * (out_len - 1)
    assert r["mean_acceptance_length"] == L
    assert r["position_acceptance_rates"] == [1.0] * (L - 1) + [0.0] * (K - L + 1)
    assert r["decode_steps"] == math.ceil((out_len - 1) / L)
    assert r["ttft_s"] > 0 and r["decode_s"] > 0 and r["step_us"] > 0
    assert math.isclose(r["tokens_per_s"], r["decode_tokens"] / r["decode_s"])
    assert math.isclose(r["step_us"], 1e6 * r["decode_s"] / r["decode_steps"])
    assert "| 6.00 |" in (tmp_path / "decode_demo_auto_tp1_spec-synthetic.md").read_text()


def test_stub_comm_is_local_and_shape_preserving(rng):
    comm = rs.StubComm("tp", "xla", tp=4)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(comm.all_reduce(jnp.asarray(x), "a")), x)
    np.testing.assert_array_equal(np.asarray(comm.all_gather(jnp.asarray(x), -1, "g")), np.tile(x, (1, 4)))
    assert int(comm.local_start(2)) == 0  # the first block
    table = rng.standard_normal((7, 2)).astype(np.float32)
    ids = rng.integers(0, 30, (2, 3))
    np.testing.assert_array_equal(
        np.asarray(comm.embed(jnp.asarray(table), jnp.asarray(ids))), table[np.clip(ids, 0, 6)]
    )
    assert dict(comm.counts) == {"a": 1, "g": 1, "embed": 1}
    assert [c[0] for c in comm.log] == ["all_reduce", "all_gather", "all_reduce"]
    # under latency_specialized the layer boundaries take the launch a real rank runs, minus the exchange (no
    # real axis behind it), and the all-reduce it stands for is logged as all_reduce logs it
    spec = rs.StubComm("tp", DecodePolicy("latency_specialized"), tp=4)
    assert spec.fuses_boundaries and spec.exchange_axis is None
    spec.note_fused("b", jnp.asarray(x))
    assert dict(spec.counts) == {"b": 1} and spec.log == [("all_reduce", "b", (3, 5), "float32")]


def test_kernel_trace_phases_and_timeline(tmp_path, rng):
    """bench.kernel_trace on a Chrome trace as Mosaic GPU writes one (a begin / end pair per named scope per
    warpgroup): each phase's mean span, and when the phases begin and end relative to the first span."""
    from bench import kernel_trace

    events, spans = [{"ph": "M", "name": "process_name"}], {"mma": [], "store": []}
    for pid in range(3):
        for tid in range(2):
            t = rng.uniform(10, 20)
            for name, d in (("mma", rng.uniform(0.5, 2)), ("store", rng.uniform(0.1, 0.5))):
                events += [
                    dict(ph="B", pid=pid, tid=tid, name=name, ts=t),
                    dict(ph="E", pid=pid, tid=tid, name=name, ts=t + d),
                ]
                spans[name].append((t, t + d))
                t += d
    (tmp_path / "1-trace.json").write_text(json.dumps({"traceEvents": events}))
    got, line = kernel_trace.phases(tmp_path), kernel_trace.timeline(tmp_path)
    t0 = min(b for b, _ in spans["mma"])
    for name, v in spans.items():
        d = [e - b for b, e in v]
        assert got[name]["count"] == 6 and np.isclose(got[name]["mean_us"], np.mean(d))
        assert np.isclose(line[name]["first_begin_us"], min(b for b, _ in v) - t0)
        assert np.isclose(line[name]["mean_begin_us"], np.mean([b for b, _ in v]) - t0)
        assert np.isclose(line[name]["last_end_us"], max(e for _, e in v) - t0)
    assert np.isclose(line["span_us"], max(e for _, e in spans["store"]) - t0)


def test_stub_comm_routing_gather_stands_for_a_balanced_router(rng):
    """The routing block the stub gathers (rank pieces [T, E_l scores | E_l biased | L_l z]) picks ~uniform
    expert sets, a different one per token, even where every token's local scores are the same (what tiling
    the local piece gave: each token's k choices one local expert's copies); the unbiased scores and z are the
    local piece's in every rank's piece."""
    tp, E_l, L_l, T, k = 8, 16, 4, 64, 8
    comm = rs.StubComm("tp", "xla", tp=tp, experts_local=E_l)
    row = rng.random(2 * E_l + L_l).astype(np.float32)
    block = np.asarray(comm.all_gather(jnp.asarray(np.tile(row, (T, 1))), -1, "routing"))
    pieces = block.reshape(T, tp, 2 * E_l + L_l)
    np.testing.assert_array_equal(pieces[..., :E_l], np.broadcast_to(row[:E_l], (T, tp, E_l)))
    np.testing.assert_array_equal(pieces[..., 2 * E_l :], np.broadcast_to(row[2 * E_l :], (T, tp, L_l)))
    chosen = np.argsort(-pieces[..., E_l : 2 * E_l].reshape(T, tp * E_l), axis=-1)[:, :k]
    E = tp * E_l
    uniform = E * (1 - (1 - k / E) ** T)  # distinct experts of T uniform draws of k
    # the local scores (uniform in [0, 1) here) favour some experts under the N(0, 1) offsets, as a trained
    # router's do: 0.86-1.0 x uniform over 3000 random rows at these sizes
    assert len(np.unique(chosen)) >= 0.8 * uniform
    assert len({tuple(sorted(c)) for c in chosen}) == T
    assert comm.counts["routing"] == 1


def test_stub_comm_collectives_do_not_depend_on_the_backend():
    """The projection's collective term comes from StubComm's log: a boundary fused into one launch under
    latency_specialized logs the same all-reduce the xla backend's join does."""
    cfg = rs.truncate(preset("k3"), 3)
    assert rs.collective_calls(cfg, 16, "latency_specialized", 1, 16) == rs.collective_calls(cfg, 16, "xla", 1, 16)


def test_local_table_and_floor_match_sharding():
    cfg = preset("demo")
    for tp in (2, 16):
        local = {s.path: s for s in rs.local_table(cfg, tp)}
        for s in sh.params_lib.tensor_table(cfg):
            split = any(sh.RULES.get(a) for a in s.axes if a)
            assert local[s.path].nbytes * (tp if split else 1) == s.nbytes
        fb = rs.floor_bytes(cfg, tp, 1, 64)
        assert math.isclose(fb["weights"], sh.active_bytes_per_device(cfg, tp), rel_tol=1e-6)
        assert rs.floor_bytes(cfg, tp, 8, 64)["weights"] > fb["weights"]  # more experts touched


def _fake_rank_slice(rng):
    cfg = preset("k3")
    calls = rs.collective_calls(rs.truncate(cfg, 3), 16, "xla", 1, 16)
    runs = []
    for B in (1, 64):
        step = float(rng.uniform(1e3, 1e4))
        runs.append(
            {
                "layers": 93,
                "backend": "xla",
                "batch": B,
                "step_us": step,
                "full_estimate_us": step,
                "wall_us_per_step": step * 1.1,
                "floor_us": step / 3,
                "frac_floor": 1 / 3,
                "summary": {"kernels": 100},
                "collective_calls": calls,
            }
        )
    return {
        "machine": {"device": "fake", "date": "now", "jax": "x"},
        "full_layers": 93,
        "config": "k3",
        "context": 16,
        "runs": runs,
    }, calls


def test_rank_slice_report_and_projection(tmp_path, rng):
    res, calls = _fake_rank_slice(rng)
    assert {c[1] for c in calls} >= {"attn_out", "routing", "latent_sum", "moe_out", "logits", "embed"}
    path = tmp_path / "rank_slice.json"
    path.write_text(json.dumps(res))
    decode.run(decode.parse_args(["--rank-slice", str(path), "--out", str(tmp_path), "--tag", "t"]))
    data = json.loads((tmp_path / "decode_t.json").read_text())
    assert data["mode"] == "rank_slice" and len(data["rows"]) == 2
    table = projection.load_collectives()
    for p in data["projection"]:
        run = next(r for r in res["runs"] if r["batch"] == p["batch"])
        mem = run["step_us"] * 4.8 / 8.0
        assert math.isclose(p["memory_term_us"], mem)
        assert p["collectives_per_step"] == len(calls)
        assert p["collective_term_us"] >= len(calls) * min(min(v.values()) for v in table.values())
        assert math.isclose(p["tokens_per_s"], p["batch"] * 1e6 / (mem + p["collective_term_us"]))
    assert "PROJECTION" in (tmp_path / "decode_t.md").read_text()


def test_op_floors_add_up_to_the_step_floor():
    for name, tp in (("demo", 2), ("k3", 16)):
        cfg = preset(name)
        for B in (1, 64):
            ops = rs.op_floor_bytes(cfg, tp, B, 64)
            assert set(ops) == set(rs.OPS)
            assert math.isclose(sum(ops.values()), rs.floor_bytes(cfg, tp, B, 64)["total"], rel_tol=1e-6)
            assert ops["routed experts"] > 0 and ops["KDA"] > 0 and ops["MLA"] > 0


def test_boundary_floor_reads_the_stored_blocks():
    """Each join mixes the AttnRes blocks stored so far (one more at every block boundary, before the layer's
    joins; layer 0's attention reads the prefix unmixed): the boundary's floor is those reads, bf16, replicated,
    plus its norm and AttnRes weights."""
    for name, layers, tp in (("k3", None, 16), ("k3", 12, 16), ("demo", None, 16), ("tiny", 5, 1)):
        cfg = rs.truncate(preset(name), layers)
        stored = reads = 0
        for L in range(cfg.num_hidden_layers):
            stored += L % cfg.attn_res_block_size == 0
            reads += 2 * stored  # the MLP's mix, then the next attention's (the output's after the last layer)
        assert rs.attnres_block_reads(cfg) == reads
        for B in (1, 64):
            fb = rs.floor_bytes(cfg, tp, B, 64)
            assert fb["attnres_blocks_read"] == reads * B * cfg.hidden_size * 2
            weights = sum(s.nbytes for s in rs.local_table(cfg, tp) if rs.op_of_tensor(s.path, cfg) == "boundary")
            assert rs.op_floor_bytes(cfg, tp, B, 64)["boundary"] == weights + fb["attnres_blocks_read"]
    assert rs.attnres_block_reads(preset("k3")) == 816  # 12 layers each with 1..7 blocks, then 9 with 8


def test_decode_ops_follow_a_layer(rng):
    """One layer's kernels as a step launches them (embed, KDA sublayer, boundary, MoE sublayer, boundary,
    head): each lands in its op, the unlabelled ones by the op before them or the hand-overs."""
    layer = [
        ("...d,shkd->...shk/dot_general", "KDA"),
        ("concatenate", "KDA"),
        ("add", "KDA"),
        ("...c,dc->...d/dot_general", "KDA"),
        ("reduce_sum", "boundary"),
        ("n...,n...d->...d/dot_general", "boundary"),
        ("mul", "boundary"),
        ("router/bd,nd->bn/dot_general", "router"),
        ("top_k", "router"),
        ("div", "router"),
        ("latent_down/bd,nd->bn/dot_general", "latent"),
        ("reduce_sum", "routed experts"),
        ("shared_gate/bd,nd->bn/dot_general", "FFN"),
        ("convert_element_type", "routed experts"),
        ("tkl,tk->tl/dot_general", "routed experts"),
        ("slice", "latent"),
        ("tl,dl->td/dot_general", "latent"),
        ("add", "boundary"),
        ("reduce_precision", "boundary"),
    ]
    rows = [{"name": "loop_gather_fusion", "op": "gather", "layer": None, "us": 1.0}]
    rows += [
        {"name": f"fusion_{i}", "op": op, "layer": 0, "us": float(rng.uniform(1, 9))} for i, (op, _) in enumerate(layer)
    ]
    rows += [
        {"name": "gemm_fusion_dot_7", "op": "gemm_fusion_dot_7", "layer": 0, "us": 30.0},  # lm_head, unnamed
        {"name": "input_reduce_fusion", "op": "reduce", "layer": None, "us": 2.0},
    ]
    want = ["embed/head"] + [op for _, op in layer] + ["embed/head", "embed/head"]
    assert rs.decode_ops(rows) == want
    for r in rows:
        r["kind"] = "kda_moe" if r["layer"] is not None else "embed/head"
    ops = rs.by_op(rows)
    assert math.isclose(sum(e["us"] for e in ops.values()), sum(r["us"] for r in rows))
    assert ops["embed/head"]["kernels"] == 3


def test_verify_table_has_a_cell_per_column(tmp_path):
    from bench import kda_verify

    case = dict(B=1, H=6, T=4, verify_bytes=1e6, commit_bytes=1e6, floor_us=0.4, pallas_us=20.0, pallas_kernels=2)
    case |= dict(pallas_frac_of_peak=0.02, pallas_verify_us=9.0, verify_frac_of_peak=0.02, pallas_commit_us=3.0)
    case |= dict(commit_frac_of_peak=0.1, xla_us=40.0, xla_kernels=16, xla_verify_us=38.0, xla_commit_us=2.5)
    case |= dict(speedup_vs_xla=2.0)
    for variants in ({}, {"ldg": {"verify": 10.0, "commit": 9.0}, "tma": "failed: x"}):
        res = dict(device="fake", jax="x", iterations=3, hbm_peak_Bps=4.8e12, cases=[dict(case, variants_us=variants)])
        path = tmp_path / "kda_verify.md"
        kda_verify.write_table(res, path)
        table = [line for line in path.read_text().splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in table}) == 1 and len(table) == 3


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
# the documents that cite result files by name (benchmark scripts and device groups name what they will write)
CITING = ["README.md", "bench/*.md", "bench/results/README.md", "pallas_kernels/**/*.py", "pallas_kernels/**/*.json"]
CITING += ["k3jax/**/*.py"]
REMOVED_AT = "721adb5"  # where a cited NAME@721adb5 lives


def _cited_result_names():
    """(document, name, removed) for every result file named in CITING: names shaped like an existing
    benchmark's results (its first word), with `.ext` or `.{ext,ext}`; removed = written NAME@721adb5."""
    prefixes = sorted({p.name.split("_")[0].split(".")[0] for p in RESULTS.iterdir() if p.name != "README.md"})
    name = re.compile(r"(?<![\w/$.-])(?:bench/results/|results/)?((?:" + "|".join(prefixes) + r")[\w]*)")
    ext = re.compile(r"\.(json|md|png)|\.\{([a-z,]+)\}")
    root = RESULTS.parents[1]
    for pattern in CITING:
        for doc in sorted(root.glob(pattern)):
            text = doc.read_text()
            for m in name.finditer(text):
                e = ext.match(text, m.end())
                if not e:
                    continue
                removed = text.startswith(f"@{REMOVED_AT}", e.end())
                for x in (e.group(1),) if e.group(1) else e.group(2).split(","):
                    yield doc.relative_to(root), f"{m.group(1)}.{x}", removed


def test_result_files_named_in_documents_exist():
    names = list(_cited_result_names())
    assert len(names) > 50  # the pattern still finds the citations
    missing = sorted({(str(d), n) for d, n, removed in names if not removed and not (RESULTS / n).exists()})
    assert not missing, (
        f"these documents name result files bench/results does not have: {missing}; run the benchmark that "
        f"writes it, or cite it as NAME@{REMOVED_AT} if it was removed"
    )
    if not shutil.which("git"):
        return
    git = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", REMOVED_AT, "bench/results"],
        cwd=RESULTS.parents[1],
        capture_output=True,
        text=True,
    )
    if git.returncode == 0:  # a clone without that commit (shallow CI) checks names only
        there = {pathlib.Path(p).name for p in git.stdout.split()}
        absent = sorted({(str(d), n) for d, n, removed in names if removed and n not in there})
        assert not absent, f"cited as @{REMOVED_AT} but not in that commit's bench/results: {absent}"


def test_every_result_file_is_in_the_index():
    index = (RESULTS / "README.md").read_text()
    stems = {
        m.group(1) + "." + e for m in re.finditer(r"`([\w]+)\.\{?([a-z,]+)\}?`", index) for e in m.group(2).split(",")
    }
    unlisted = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md" and p.name not in stems)
    assert not unlisted, f"bench/results/README.md does not say what these are: {unlisted}"


def _synthetic_step(rng, cfg, wrong_layer, fused_boundary=False):
    """A latency_specialized-like step of `cfg`'s layers as CUPTI lists it: (name, us, HLO layer, op label).
    Mosaic kernels have no HLO name; the fusions' HLO layers are `wrong_layer` (a reused kernel named after a
    later layer's fusion), so only the launch order tells the layers. fused_boundary: every join is the boundary
    kernel (mix_norm_single_device), its query's XLA kernel right before it or amid the sublayer it ends (XLA
    may schedule it anywhere), and the MoE's latent norm the same kernel without AttnRes.
    -> (kernels, want layer, want op)."""
    from pallas_kernels.collectives import mix_norm

    us = lambda: float(rng.uniform(1, 20))  # noqa: E731
    mosaic = "anonymous_mosaic_gpu_kernel"
    boundary_kernel = f"{mix_norm.BOUNDARY_KERNEL}_mosaic_gpu_kernel"
    latent_norm = f"{mix_norm.NORM_KERNEL}_mosaic_gpu_kernel"
    query = ("loop_multiply_fusion_3", "mix_norm/mul", "boundary")
    join = [
        ("input_reduce_fusion_1", "n...d,d->n.../dot_general", "boundary"),
        ("loop_divide_fusion", "div", "boundary"),
        ("loop_reduce_fusion_2", "reduce_precision", "boundary"),
        ("loop_multiply_fusion", "mul", "boundary"),
    ]

    def ends(sublayer):  # the sublayer's kernels, then its join
        if not fused_boundary:
            return sublayer + join
        if rng.random() < 0.5:
            return sublayer + [query, (boundary_kernel, boundary_kernel, "boundary")]
        return sublayer[:1] + [query] + sublayer[1:] + [(boundary_kernel, boundary_kernel, "boundary")]

    seq = [("loop_gather_fusion", "gather", None, "embed/head"), ("fusion_0", "mul", None, "embed/head")]
    for L, kind in enumerate(cfg.layer_kinds):
        if kind.startswith("kda"):
            attn = [(mosaic, mosaic, "KDA"), ("loop_add_fusion", "add", "KDA"), (mosaic, mosaic, "KDA")]
            attn += [(mosaic, mosaic, "KDA")]
        else:
            attn = [("gemm_fusion_dot_3", "q_a/bd,nd->bn/dot_general", "MLA"), ("fusion_4", "reduce_max", "MLA")]
            attn += [("loop_convert_fusion", "jit(attention)/jit(partials)/convert_element_type", "MLA")]
            attn += [(mosaic, mosaic, "MLA"), ("fusion_5", "jit(attention)/exp", "MLA")]
        if kind.endswith("moe"):
            ffn = [("gemm_fusion_dot_6", "router/bd,nd->bn/dot_general", "router"), ("fusion_7", "neg", "router")]
            ffn += [("moe_route_topk_mosaic_gpu_kernel", "moe_route_topk_mosaic_gpu_kernel", "router")]
            ffn += [("input_scatter_fusion", "scatter", "routed experts")]  # the grouping's, not MLA's
            ffn += [
                ("loop_gather_fusion_9", "jit(grouped)/gather", "routed experts"),
                (mosaic, mosaic, "routed experts"),
            ]
            ffn += [(mosaic, mosaic, "routed experts"), ("fusion_8", "tkl,tk->tl/dot_general", "routed experts")]
            if fused_boundary:  # the latent norm kernel, then the finish's one GEMV launch (moe.finish)
                ffn += [(latent_norm, latent_norm, "latent"), (mosaic, mosaic, "FFN")]
            else:  # the finish's reference: latent_up, shared_down, their add
                ffn += [("gemm_fusion_dot_9", "latent_up/bk,nk->bn/dot_general", "latent")]
                ffn += [("gemm_fusion_dot_10", "shared_down/bk,nk->bn/dot_general", "FFN")]
                ffn += [("loop_add_fusion_2", "add", "boundary")]
        else:
            ffn = [
                ("nvjet_sm90_tss_224x64", "nvjet_sm90_tss_224x64", "FFN"),
                ("fusion_10", "convert_element_type", "FFN"),
            ]
        seq += [(n, op, L, want) for n, op, want in ends(attn) + ends(ffn)]
    seq += [("loop_select_fusion", "jit(take_along_axis)/select_n", None, "embed/head")]
    seq += [("gemm_fusion_dot_11", "gemm_fusion_dot_11", None, "embed/head")]
    kernels = [(n, us(), None if n == op else wrong_layer, op) for n, op, _, _ in seq]
    return kernels, [L for _, _, L, _ in seq], [w for _, _, _, w in seq]


@pytest.mark.parametrize("fused_boundary", [False, True])
def test_layers_follow_the_launch_order_not_the_kernel_names(rng, fused_boundary):
    """Issue 28: under latency_specialized every kernel landed in layer 3, the running maximum of the layers
    that reused kernels' names map to. The layers come from the launch order (each sublayer ends in a join:
    XLA's kernels or the one boundary kernel), from the live attribution and from a saved JSON's kernel list
    alike; kind sums add up to the step."""
    cfg = rs.truncate(preset("k3"), 8)  # kda_dense, kda_moe x2, mla_moe, kda_moe x3, mla_moe
    kernels, want_layer, want_op = _synthetic_step(rng, cfg, wrong_layer=3, fused_boundary=fused_boundary)
    scopes = {rs._norm(n): (L, op) for n, _, L, op in kernels if n != op}
    for rows in (
        rs.attribute([(n, us) for n, us, _, _ in kernels], scopes, cfg),
        rs.assign_layers(
            [{"name": n, "us": us, "layer": L, "op": op, "named": op != n} for n, us, L, op in kernels], cfg
        ),
    ):
        assert [r["layer"] for r in rows] == want_layer
        assert rs.decode_ops(rows) == want_op
        s = rs.summarize(rows, cfg)
        assert s["layers_from"] == "launch order"
        assert math.isclose(sum(v["us_total"] for v in s["by_kind"].values()), sum(us for _, us, _, _ in kernels))
        assert {k: v["layers"] for k, v in s["by_kind"].items() if k != "embed/head"} == dict(Counter(cfg.layer_kinds))
        n_kda = sum(k.startswith("kda") for k in cfg.layer_kinds)
        ops = rs.decode_ops(rows)
        assert (
            sum(r["name"].startswith("anonymous") for r, op in zip(rows, ops, strict=True) if op == "KDA") == 3 * n_kda
        )
        assert s["boundary_kernels"] == (2 * cfg.num_hidden_layers if fused_boundary else 0)
        if fused_boundary:  # two boundary kernels per layer, each in its layer, and their queries with them
            per_layer = Counter(r["layer"] for r in rows if r["name"].startswith("mix_norm_attnres"))
            assert per_layer == dict.fromkeys(range(cfg.num_hidden_layers), 2)
            assert rs.by_op(rows)["boundary"]["kernels"] == 4 * cfg.num_hidden_layers


def test_layers_fall_back_to_the_hlo_scopes_when_the_order_does_not_split(rng):
    """A sequence with a join missing does not split into the config's layers: the HLO running maximum, marked."""
    cfg = rs.truncate(preset("k3"), 4)
    kernels, _, _ = _synthetic_step(rng, cfg, wrong_layer=1)
    cut = max(i for i, k in enumerate(kernels) if k[3] == "reduce_precision")
    kernels = [k for i, k in enumerate(kernels) if not (cut - 3 <= i <= cut)]  # drop the last join's labels
    rows = rs.assign_layers(
        [{"name": n, "us": us, "layer": L, "op": op, "named": op != n} for n, us, L, op in kernels], cfg
    )
    assert not rows[0]["segmented"] and rs.summarize(rows, cfg)["layers_from"] == "HLO scopes"


def test_rank_slice_speculative_runs_on_cpu(tmp_path):
    """--speculative K at a tiny config: the plain decode entry as before, plus the "speculative" section
    (verify, commit and drafter programs threaded through rounds; on CPU structure and wall time only)."""
    rs.main(
        ["--preset", "demo", "--layers", "4", "--batches", "1", "--context", "64", "--iters", "1"]
        + ["--speculative", "3", "--out", str(tmp_path)]
    )
    data = json.loads((tmp_path / "rank_slice.json").read_text())
    assert [(r["layers"], r["backend"], r["batch"]) for r in data["runs"]] == [(4, "xla", 1)]
    assert "errors" not in data
    sp = data["speculative"]
    assert (sp["num_draft"], sp["tokens_per_verify"]) == (3, 4)
    assert (sp["acceptance_length"], sp["acceptance_length_requested"]) == (4, 6.0)  # at most K + 1
    assert sp["drafter"]["config"].startswith("tiny") and sp["drafter"]["weight_bytes"] > 0
    (r,) = sp["runs"]
    assert (r["layers"], r["backend"], r["batch"]) == (4, "xla", 1)
    assert r["verify_us"] is None and r["tokens_per_s"] is None and r["wall_us_per_round"] > 0  # no CUPTI on CPU
    assert r["collectives"] == data["runs"][0]["collectives"]  # verify issues the decode step's collectives
    layers = 2  # the tiny drafter's (convert.fake_dspark), split over the slice's tp: an all-reduce a sublayer
    assert r["drafter_collectives"] == {"embed": 1, "draft_logits": 1, "draft_attn": layers, "draft_ffn": layers}
    md = (tmp_path / "rank_slice.md").read_text()
    assert "## Speculative round: DSpark, K = 3 drafts, synthetic acceptance length 4" in md
    assert md.startswith(rs.markdown({k: v for k, v in data.items() if k != "speculative"}))  # appended only


def test_rank_slice_policy_overrides_the_boundary_tuning_for_the_run_only():
    """--mix-norm-single-device [on|off] sets the collectives table's entry in the run's policy; without it the
    tuning.json default holds, and the flag leaves that default and every other entry as they were."""
    default = DecodePolicy("latency_specialized").table("collectives")
    for argv, want in (([], default["mix_norm_single_device"]), (["--mix-norm-single-device"], True)):
        for flag in (argv, ["--mix-norm-single-device", "off"]) if argv else (argv,):
            policy = rs.decode_policy(rs.parse_args(flag), "latency_specialized")
            table = policy.table("collectives")
            assert table == dict(default, mix_norm_single_device=want if flag == argv else False)
            assert policy.kernels and policy.moe_impl == "packed"
            assert policy.table("gemv") == DecodePolicy().table("gemv")
    assert DecodePolicy().table("collectives") == default  # tuning.json as it was


def test_rank_slice_tuning_flag_sets_one_entry_for_the_run_only():
    """--tuning OP.SECTION.KEY=JSON (repeatable) sets exactly those entries in the run's policy; a malformed one
    stops with a message saying the form."""
    kda, mla = (DecodePolicy().table(op) for op in ("kda_decode", "mla_decode"))
    argv = ["--tuning", "kda_decode.sm90.state_in_place=true", "--tuning", "mla_decode.sm100.write_rows=true"]
    policy = rs.decode_policy(rs.parse_args(argv), "latency_specialized")
    assert policy.table("kda_decode") == dict(kda, sm90=dict(kda["sm90"], state_in_place=True))
    assert policy.table("mla_decode") == dict(mla, sm100=dict(mla["sm100"], write_rows=True))
    assert policy.table("gemv") == DecodePolicy().table("gemv")
    assert DecodePolicy().table("kda_decode") == kda  # tuning.json as it was
    for bad in ("kda_decode.sm90.state_in_place", "kda_decode=1", "kda_decode.sm90.x=yes"):
        with pytest.raises(SystemExit, match="--tuning"):
            rs.decode_policy(rs.parse_args(["--tuning", bad]), "latency_specialized")


@cpu_only
def test_rank_slice_runs_the_boundary_kernel_on_cpu(monkeypatch, tmp_path):
    """The CPU rank slice with --mix-norm-single-device, the collectives api planning as on a GPU and the
    boundary kernel in interpret mode: under latency_specialized every join is the kernel (the demo's latent
    norm is too narrow for it), under xla none is; the result says so and from where. The kernel's XLA query is
    labelled in its layer's scope, as the attribution expects. (Without the flag the tuning's default holds:
    test_rank_slice_policy_overrides_the_boundary_tuning_for_the_run_only.)"""
    import jax
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.collectives import api, mix_norm

    monkeypatch.setattr(api, "current_platform", lambda: "gpu")  # the other ops' apis still see no GPU: XLA
    calls, kernel = [], mix_norm.mix_norm

    def counted(x, prefix, blocks, *a, **kw):
        calls.append(len(blocks))
        return kernel(x, prefix, blocks, *a, interpret=plgpu.InterpretGPUParams(), **kw)

    monkeypatch.setattr(mix_norm, "mix_norm", counted)
    argv = ["--preset", "demo", "--layers", "2", "--batches", "1", "--context", "64", "--iters", "1"]
    argv += ["--backends", "xla,latency_specialized", "--mix-norm-single-device", "--out", str(tmp_path)]
    rs.main(argv)
    data = json.loads((tmp_path / "rank_slice.json").read_text())
    assert "errors" not in data and [r["backend"] for r in data["runs"]] == ["xla", "latency_specialized"]
    assert data["mix_norm_single_device"] is True and data["mix_norm_single_device_from"] == "the command line"
    assert len(calls) == 2 * 2 and all(n >= 1 for n in calls)  # each layer's two joins (the last: the output mix)
    xla, spec = (r["collectives"] for r in data["runs"])
    assert spec == xla and spec["attn_out"] == 2  # the fused all-reduces are counted as the xla backend's
    line = "Layer boundaries under latency_specialized: the boundary kernel (mix_norm.py) minus its exchange"
    assert line in (tmp_path / "rank_slice.md").read_text()
    assert "latency_specialized: XLA's kernels" in rs.markdown(dict(data, mix_norm_single_device=False))
    cfg = rs.truncate(preset("demo"), 1)
    step = rs.make_step(cfg, rs.StubComm("tp", rs.decode_policy(rs.parse_args(argv), "latency_specialized")))
    cache = jax.eval_shape(lambda: rs.new_cache(cfg, 16, 1, 64))
    exe = step.lower(rs.abstract_local_params(cfg, 16), jax.ShapeDtypeStruct((1,), jnp.int32), cache).compile()
    # AttnRes's q = res_norm x res_proj is formed inside the kernel: no XLA product before the boundary
    assert (0, "mix_norm/mul") not in set(rs.hlo_scopes(exe.as_text()).values())


def test_rank_slice_speculative_estimate_and_table():
    """The round scaled to 93 layers: verify per layer kind, commit by the KDA layers, the drafter as is;
    tokens/s = batch x acceptance length / round."""
    full = preset("k3")
    per_layer = {"kda_dense": 10.0, "kda_moe": 20.0, "mla_moe": 30.0}
    by_kind = {k: {"us_per_layer": us, "us_total": us} for k, us in per_layer.items()}
    by_kind["kda_moe"]["us_total"] = 40.0  # two layers at 4
    by_kind["embed/head"] = {"us_per_layer": 5.0, "us_total": 5.0}
    entry = {"layers": 4, "backend": "xla", "batch": 8, "verify_us": 95.0, "verify_kernels": 50}
    entry.update(commit_us=3.0, drafter_us=100.0, summary={"by_kind": by_kind}, collectives={"logits": 1})
    est = rs.spec_estimate({"preset": "k3"}, entry, 6.0)
    verify = 5.0 + sum(
        n * per_layer.get(k, per_layer[k.split("_")[0] + "_moe"]) for k, n in Counter(full.layer_kinds).items()
    )
    commit = 3.0 * len(full.kda_layers) / 3  # 3 of the first 4 layers are KDA
    assert math.isclose(est["full_estimate"]["verify_us"], verify)
    assert math.isclose(est["full_estimate"]["commit_us"], commit)
    assert math.isclose(est["tokens_per_s"], 8 * 6.0 / (verify + commit + 100.0) * 1e6)
    entry.update(est)
    plain = {"layers": 4, "backend": "xla", "batch": 8, "step_us": 50.0, "full_estimate_us": 1000.0}
    result = {"preset": "k3", "full_layers": 93, "runs": [plain], "speculative": {"num_draft": 7, "runs": [entry]}}
    result["speculative"].update(
        acceptance_length=6.0, acceptance_length_requested=6.0, definition="d", drafter={"layers": 5, "weight_bytes": 1}
    )
    row = next(x for x in rs.spec_markdown(result) if x.startswith("| 4 | xla | 8 |"))
    assert row.endswith(f"| {est['tokens_per_s']:.0f} | {est['tokens_per_s'] / (8 / 1000.0 * 1e6):.2f} |")


def test_gemv_bench_moe_cases_are_one_ranks_and_every_candidate_fits():
    """bench/gemv.py's MoE in-projection cases: one TP16 / TP8 rank's router, latent_down and shared gate/up
    rows (the config's E, Dl and S split by tp), fp32 logits first; with --sweep every MOE_LAUNCHES candidate is
    timed at every batch 1-64 (none dropped by kernel.check_supported) beside the launch the moe_in_launch table
    picks (one of them)."""
    from bench import gemv
    from k3jax.config import K3Config

    cfg = K3Config()
    E, Dl, S = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.shared_intermediate
    moe = {c.name: c for c in gemv.CASES if c.table == "moe_in_launch"}
    assert set(moe) == {"moe_in tp16", "moe_in tp8"}
    for tp in (16, 8):
        case = moe[f"moe_in tp{tp}"]
        assert case.rows == (E // tp, Dl // tp, S // tp, S // tp) and case.D == cfg.hidden_size
        assert [jnp.dtype(d) for d in case.out_dtypes] == [jnp.dtype(jnp.float32)] + [jnp.dtype(jnp.bfloat16)] * 3
        assert sum(case.rows) * case.D * 2 * gemv.n_sets(case) >= gemv.COLD_BYTES  # the sets outgrow the L2
        for B in range(1, 65):
            launches, tuned = gemv.candidates(case, B, sweep=True)
            assert tuned in {gemv.launch_key(*launch) for launch in gemv.MOE_LAUNCHES}
            assert sorted(launches.values(), key=str) == sorted(
                (dict(block_k=k, split_k=s, steps=st, x_stream=xs) for k, s, st, xs in gemv.MOE_LAUNCHES), key=str
            )
    assert gemv.pick_cases("moe_in") == list(moe.values())


def test_gemv_bench_moe_out_cases_are_one_ranks_and_each_kernel_is_timed_once():
    """bench/gemv.py's MoE finish cases: one TP16 / TP8 rank's latent_up and shared_down K (Dl and S split by tp)
    into N = D; at every batch 1-64 the table's launch (if any) and the MOE_OUT_LAUNCHES candidates the kernel
    takes, each kernel they make once (at TP16 block_k 192 and 256 make the same one)."""
    from bench import gemv
    from k3jax.config import K3Config
    from pallas_kernels.gemv import kernel

    cfg = K3Config()
    out = {c.name: c for c in gemv.CASES if c.table == "moe_out_launch"}
    assert set(out) == {"moe_out tp16", "moe_out tp8"}
    for tp in (16, 8):
        case = out[f"moe_out tp{tp}"]
        assert case.ks == (cfg.routed_expert_hidden_size // tp, cfg.shared_intermediate // tp)
        assert case.rows == (cfg.hidden_size,) == (case.D,)
        assert gemv.weight_bytes(case) * gemv.n_sets(case) >= gemv.COLD_BYTES  # the sets outgrow the L2
        for B in (1, 8, 9, 33, 64):
            launches, tuned = gemv.candidates(case, B, sweep=True)
            assert (tuned in launches or tuned.startswith("none: ")) and len(launches) >= 2  # the table may be empty
            made = [
                (kernel.pair_blocks(case.ks, la["block_k"])[:2], la["steps"], la["x_stream"])
                for la in launches.values()
            ]
            n = [m[0][0] for m in made]
            assert len({(m[0], min(m[1], k), m[2]) for m, k in zip(made, n, strict=True)}) == len(made)
    assert gemv.pick_cases("moe_out") == list(out.values())


@cpu_only
def test_gemv_bench_runs_a_moe_out_case_on_cpu(tmp_path, monkeypatch):
    """bench/gemv.py end to end at a scaled-down finish (K 224 + 96 into N = 128), the pairs' kernel in interpret
    mode on an abstract H100 and the CUPTI timers stubbed: XLA and each candidate get a time and a small error
    against float64."""
    from bench import gemv

    monkeypatch.setattr(gemv, "device_us", lambda f, *a: (jax.block_until_ready(f(*a)), 2.0)[1])
    monkeypatch.setattr(gemv, "per_kernel_us", lambda f, x, sets, iters: [("kernel", 1.0)] * len(sets))
    monkeypatch.setattr(gemv, "SETS", 2)
    launches = ((128, 1, 2, "M"), (192, 1, 2, "N"))  # the second makes the table's kernel (B 5: k192 st4 N): once
    case = gemv.Case("moe_out tiny", 128, (128,), "moe_out_launch", launches=launches, ks=(224, 96))
    import jax.experimental.pallas.mosaic_gpu as plgpu

    with abstract_gpu("sm90"):
        res = gemv.main(tmp_path, (5,), True, "gemv_tiny", [case], interpret=plgpu.InterpretGPUParams(), cold_bytes=0)
    (row,) = res["rows"]
    assert row["ks"] == (224, 96) and row["out_dtypes"] == ["bfloat16"]
    if row["tuned"].startswith("none: "):  # moe_out_launch stays empty until the kernel is measured
        keys = ["xla", *(gemv.launch_key(*la) for la in launches)]
    else:
        assert row["tuned"] == "pallas k192 s1 st4 xsN" and "pallas k192 s1 st2 xsN_us" not in row
        keys = ["xla", row["tuned"], gemv.launch_key(*launches[0])]
    for key in keys:
        assert row[f"{key}_us"] == 1.0, (key, row)
        assert 0 < row[f"{key}_rel_err"] < 1e-2, (key, row)


@cpu_only
def test_gemv_bench_runs_a_moe_case_on_cpu(tmp_path, monkeypatch):
    """bench/gemv.py end to end at a scaled-down MoE case (56 / 224 / 72 / 72 rows over D = 512, fp32 logits),
    the kernel in interpret mode on an abstract H100 and the CUPTI timers stubbed: XLA and each candidate get
    a time, a small error against float64 and their kernels; nothing fails."""
    from bench import gemv

    monkeypatch.setattr(gemv, "device_us", lambda f, *a: (jax.block_until_ready(f(*a)), 2.0)[1])
    monkeypatch.setattr(gemv, "per_kernel_us", lambda f, x, sets, iters: [("kernel", 1.0)] * len(sets))
    monkeypatch.setattr(gemv, "SETS", 2)  # interpret mode is slow: two sets show the per-set split
    launches = ((128, 1, 2, "N"), (128, 2, 2, "M"))
    case = gemv.Case("moe_in tiny", 512, (56, 224, 72, 72), "moe_in_launch", gemv.MOE_DTYPES, launches)
    import jax.experimental.pallas.mosaic_gpu as plgpu

    with abstract_gpu("sm90"):
        res = gemv.main(tmp_path, (13,), True, "gemv_tiny", [case], interpret=plgpu.InterpretGPUParams(), cold_bytes=0)
    assert json.loads((tmp_path / "gemv_tiny.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    keys = ["xla"] + [gemv.launch_key(*launch) for launch in launches]
    for row in res["rows"]:
        assert row["sets"] == gemv.SETS and row["out_dtypes"] == ["float32"] + ["bfloat16"] * 3
        for key in keys:
            assert row[f"{key}_us"] == 1.0 and row[f"{key}_kernels"] == [("kernel", 1.0)], (key, row)
            assert 0 < row[f"{key}_rel_err"] < 1e-2, (key, row)


def test_step_trace_summary_adds_up(rng):
    """The timeline summary of random events (overlaps included): span = busy + idle, the idle before each
    kind sums to the idle time, each kind's durations and counts are the events', the largest gap is listed."""
    from bench import step_trace

    names = ["anonymous_mosaic_gpu_kernel", "loop_add_fusion", "MemcpyD2D", "Memset"]
    starts = np.cumsum(rng.integers(0, 5000, 40))
    durs, which = rng.integers(1, 4000, 40), rng.integers(0, 4, 40)
    ev = sorted((int(s), int(s + d), names[int(i)]) for s, d, i in zip(starts, durs, which, strict=True))
    steps = int(rng.integers(1, 4))
    out = step_trace.summarize(ev, steps)
    covered = np.zeros(ev[-1][1] + max(e for _, e, _ in ev) + 1, bool)
    for s, e, _ in ev:
        covered[s:e] = True
    span = max(e for _, e, _ in ev) - ev[0][0]
    assert out["span_us_per_step"] == pytest.approx(span * 1e-3 / steps)
    assert out["busy_us_per_step"] == pytest.approx(covered.sum() * 1e-3 / steps)
    assert out["busy_us_per_step"] + out["idle_us_per_step"] == pytest.approx(out["span_us_per_step"])
    assert sum(out["idle_us_per_step_before_kind"].values()) == pytest.approx(out["idle_us_per_step"])
    for k in set(map(step_trace.kind, names)):
        mine = [(s, e) for s, e, n in ev if step_trace.kind(n) == k]
        assert out["us_per_step_by_kind"].get(k, 0) == pytest.approx(sum(e - s for s, e in mine) * 1e-3 / steps)
        assert out["events_per_step_by_kind"].get(k, 0) == pytest.approx(len(mine) / steps)
    if out["largest_gaps"]:
        assert out["largest_gaps"][0][0] == max(g for g, _, _ in out["largest_gaps"])
    copies = Counter(n for _, _, n in ev if step_trace.kind(n) in ("memcpy", "memset"))
    assert out["copies_per_step"] == {n: c / steps for n, c in copies.items()}


def test_loop_is_the_steps_one_after_another(rng):
    """make_loop (the engine-style program the loop wall times) = its step called n times: the same tokens and
    the same decode state, the cache threaded through."""
    cfg, tp, B, n = rs.truncate(preset("demo"), 4), 2, 2, int(rng.integers(2, 5))
    comm = rs.StubComm("tp", DecodePolicy("xla"), tp=tp)
    params = rs.init_local_params(cfg, tp, seed=int(rng.integers(1 << 30)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
    step, loop = rs.make_step(cfg, comm), rs.make_loop(cfg, comm, n)
    t1, c1 = tokens, rs.new_cache(cfg, tp, B, 64)
    for _ in range(n):
        t1, c1 = step(params, t1, c1)
    t2, c2 = loop(params, tokens, rs.new_cache(cfg, tp, B, 64))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
