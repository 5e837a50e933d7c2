"""jaxscale.plan.frontier: MaxText's walk of per-activation policies, the order activations move in, the Pareto
frontier against brute force, the walk's caps and bounds, and one real deviceless walk through `python -m jaxscale.fit
--remat frontier` at a tiny size."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from conftest import CONFIGS, load_config

from jaxscale import fit as fit_cli
from jaxscale.config.spec import ModelConfig
from jaxscale.plan import fit_search, frontier, gpu_plan

needs_extra = pytest.mark.skipif(gpu_plan.missing_extra() is not None, reason="needs the gpu-plan extra")


def test_the_walk_moves_one_activation_one_place_at_a_time_as_maxtext_does():
    """MaxText's next_policy from everything rematerialized: each activation to offload in turn, then each to the
    device (written out by hand for three activations)."""
    r, o, d = "remat", "offload", "device"
    expected = [(r, r, r), (o, r, r), (o, o, r), (o, o, o), (d, o, o), (d, d, o), (d, d, d)]
    walked = frontier.walk(("a", "b", "c"))
    assert [tuple(p[name] for name in "abc") for p in walked] == expected
    assert [tuple(p.values()) for p in frontier.walk(("a", "b"), ("device",))] == [(r, r), (d, r), (d, d)]
    rank = {r: 0, o: 1, d: 2}  # each policy keeps at least what the one before keeps
    assert all(rank[after[n]] >= rank[before[n]] for before, after in itertools.pairwise(walked) for n in "abc")
    name = frontier.policy_name(walked[4])
    assert name == "per_activation:a=device+b=offload+c=offload" and frontier.places_of(name) == walked[4]
    assert frontier.describe(walked[0]) == "all remat" and frontier.describe(walked[1]) == "a=offload"


def test_activations_move_by_bytes_per_flop_saved_then_size():
    """A hand-built toy: the fewest bytes per FLOP saved first; a tie goes to the smaller tensor; none saved last."""
    costs = {"x": (100, 10.0), "y": (10, 10.0), "z": (5, 0.0), "w": (20, 20.0), "v": (0, 0.0)}
    assert frontier.promotion_order(costs) == ("y", "w", "x", "v", "z")


def test_activation_costs_are_the_hand_counts_of_tiny_llama():
    """Keeping one activation of the block (bf16, minibatch 1, every layer) costs its [s, width] tensor and saves the
    matmul that makes it, every token of the step's minibatches: counted by hand from the model's sizes."""
    config = load_config("bf16_remat", "tiny-llama")
    sizes, layers, s = ModelConfig.from_config(config.model), config.model.num_layers, config.data.seq_len
    h, q, kv, f, p = config.model.hidden_size, sizes.q_width, sizes.kv_width, sizes.mlp_width, 2
    tokens = config.train.num_minibatches * s  # minibatch 1
    costs = frontier.activation_costs(config)
    assert costs["out_proj"] == (p * s * h * layers, 2 * q * h * tokens * layers)
    assert costs["qkv_proj"] == (p * s * (q + 2 * kv) * layers, 2 * h * (q + 2 * kv) * tokens * layers)
    assert costs["mlp_gate"] == costs["mlp_up"] == (p * s * f * layers, 2 * h * f * tokens * layers)
    assert costs["context"] == (p * s * q * layers, 2 * s * q * tokens * layers)  # the AV einsum (reference kernel)
    assert costs["mlp_hidden"][1] == costs["mlp_down"][1] == 0  # no matmul is spared by keeping them
    order = frontier.promotion_order(costs)
    assert order == ("out_proj", "qkv_proj", "mlp_gate", "mlp_up", "context", "mlp_hidden", "mlp_down")
    assert frontier.activations("gpt") == ("qkv_proj", "context", "out_proj", "mlp_up", "mlp_hidden", "mlp_down")


def _dominated_brute_force(points: list[tuple[int, float]], i: int) -> bool:
    return any(j != i and b >= points[i][0] and s >= points[i][1] and (b, s) != points[i] for j, (b, s) in
               enumerate(points))  # fmt: skip


@pytest.mark.parametrize("seed", range(5))
def test_pareto_matches_brute_force_on_made_up_rows(seed):
    rng = random.Random(seed)
    points = [(rng.randint(1, 6), float(rng.randint(1, 6))) for _ in range(12)]
    assert frontier.pareto(points) == [not _dominated_brute_force(points, i) for i in range(len(points))]
    # a policy that fits nothing is off the frontier; one without a prediction cannot be placed
    assert frontier.pareto([(None, None), (3, None), (2, 5.0)]) == [False, None, True]


def _fake_answer(peaks_per_sequence: dict[str, int], usable: int, calls: list[tuple[str, int, int]]):
    """answer() over a linear plan per policy (peak = 1000 + slope x minibatch), searched by fit_search's search."""

    def answer(name: str, cap: int, probes: int) -> dict:
        calls.append((name, cap, probes))
        slope = peaks_per_sequence[name]

        def measure(minibatch: int) -> fit_search.Probe:
            peak = 1000 + slope * minibatch
            return fit_search.Probe(minibatch, peak <= usable, peak, None, {}, 0.0)

        found = fit_search.search_largest(measure, usable, 1, cap, probes)
        largest = found.largest.minibatch if found.largest else None
        return {"status": "ok" if largest else "oom", "fit_largest_minibatch": largest, "fit_compiles": found.compiles,
                "fit_search_complete": found.complete}  # fmt: skip

    return answer


def test_search_caps_each_policy_at_the_previous_largest_and_stops_where_nothing_fits():
    slopes = {"p0": 10, "p1": 20, "p2": 30, "p3": 2000, "p4": 10}  # p3 fits nothing: p4 is never searched
    calls: list = []
    found = frontier.search(list(slopes), _fake_answer(slopes, 1000 + 300, calls), 64, 20, 1000)
    assert [r["fit_largest_minibatch"] for r in found.rows] == [30, 15, 10, None]
    assert [cap for _, cap, _ in calls] == [64, 30, 15, 10]  # MaxText's bound: the previous policy's batch
    assert found.unsearched == ["p4"] and "policy 3 fits no minibatch" in found.stopped and not found.cut_by_bound
    same = {"p0": 10, "p1": 10}
    capped = frontier.search(list(same), _fake_answer(same, 1300, []), 64, 20, 1000)
    assert [r["frontier_capped"] for r in capped.rows] == [False, True]


def test_the_compile_bound_cuts_the_walk_and_says_so():
    slopes = dict.fromkeys(("p0", "p1", "p2", "p3"), 10)
    calls: list = []
    found = frontier.search(list(slopes), _fake_answer(slopes, 1300, calls), 4096, 20, 8)
    spent = sum(r["fit_compiles"] for r in found.rows)
    assert spent <= 8 and found.cut_by_bound and found.stopped.startswith("--frontier_compiles 8 spent after")
    assert found.unsearched == list(slopes)[len(found.rows) :] and found.unsearched
    assert all(probes <= 8 for _, _, probes in calls)


def test_mark_sets_the_frontier_and_the_fastest_that_fits():
    rows = [
        {"status": "ok", "fit_largest_minibatch": 8, "predicted_tokens_per_s": 100.0},
        {"status": "ok", "fit_largest_minibatch": 6, "predicted_tokens_per_s": 300.0},
        {"status": "ok", "fit_largest_minibatch": 5, "predicted_tokens_per_s": 200.0},
        {"status": "oom", "fit_largest_minibatch": None, "predicted_tokens_per_s": None},
    ]
    for row in rows:
        row.update(tokens_per_step=row["fit_largest_minibatch"] or 1, fit_usable_bytes=100, compiled_peak_bytes=90,
                   fit_remat="Block, ...")  # fmt: skip
    best = frontier.mark(rows)
    assert [r["frontier_on"] for r in rows] == [True, True, False, False]
    assert best is rows[1] and [r["frontier_fastest"] for r in rows] == [False, True, False, False]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--remat", "frontier,block"], "--remat frontier: walks the per-activation policies by itself"),
        (["--remat", "frontier", "--frontier_places", "device,offload"], "--frontier_places: device,offload;"),
        (["--remat", "frontier", "--frontier_places", "host"], "--frontier_places: host; allowed: offload,device"),
        (["--remat", "frontier", "--frontier_compiles", "0"], "--frontier_compiles: must be >= 1, got 0"),
    ],
)
def test_bad_frontier_flags_are_one_line_with_exit_2(tmp_path, capsys, args, message):
    code = fit_cli.main(["fit", "--config", f"{CONFIGS}/bf16_remat.py:tiny", "--output_root", str(tmp_path),
                         "--memory", "4MiB", *args])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("jaxscale: error: ") and message in err and err.count("\n") == 1


@needs_extra
def test_a_real_deviceless_walk_records_marks_plots_and_resumes(tmp_path, capsys):
    """tiny-llama on an A5000 target (cuBLAS plans only, ~1 s each): the walk within a bound of 4 probes, cut by it
    and saying so; the rows' frontier flags are the brute-force Pareto set of their own points, the fastest is the
    largest prediction; a rerun answers from the rows without compiling."""
    args = ["fit", "--config", f"{CONFIGS}/bf16_remat.py:tiny-llama", "--output_root", str(tmp_path), "--target",
            "a5000", "--gemm", "cublas", "--memory", "8MiB", "--max_minibatch", "4", "--remat", "frontier",
            "--frontier_places", "device", "--frontier_compiles", "4"]  # fmt: skip
    assert fit_cli.main(args) == 0
    out = capsys.readouterr().out
    directory = tmp_path / "experiments" / "results" / "fit_bf16_remat_tiny-llama_a5000_frontier"
    rows = sorted((json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()),
                  key=lambda r: r["frontier_step"])  # fmt: skip
    assert sum(r["fit_compiles"] for r in rows) <= 4 and rows[0]["frontier_policy"] == "all remat"
    assert "stopped: --frontier_compiles 4 spent after" in out and "the bound cut the walk" in out
    assert rows[0]["frontier_unsearched"] and rows[0]["frontier_policies"] == 8  # 1 + 7 activations to the device
    points = [(r["fit_largest_minibatch"], r["predicted_tokens_per_s"]) for r in rows]
    assert [r["frontier_on"] for r in rows] == [not _dominated_brute_force(points, i) for i in range(len(points))]
    fastest = max((r for r in rows if r["fit_largest_minibatch"]), key=lambda r: r["predicted_tokens_per_s"])
    assert fastest["frontier_fastest"] and sum(r["frontier_fastest"] for r in rows) == 1
    assert f"--config.model.remat_policy={fastest['fit_choice']}" in out and "predicted" in out
    assert (directory / "frontier.png").stat().st_size > 0
    assert fit_cli.main(args) == 0  # the same question again: every searched policy answered from its row
    assert capsys.readouterr().out.count("already answered") == len(rows)
