"""The demo: its pure parts, and a short run on 2 gloo ranks checking demo.json's structure and invariants."""

import json

import numpy as np
import pytest

from hf_dp_balance.apps.demo_ways import batch_rebalance_layout, fit_step, token_balanced_packs
from hf_dp_balance.apps.demo_analysis import (WAYS, check_invariants, format_table, placement_bound, reachable_cut,
                                              report_lines, summarize_way)


def test_token_balanced_packs_cut_contiguously_into_equal_tokens():
    tokens = [100, 10, 10, 80, 50, 50, 100]
    packs = token_balanced_packs(tokens, 2)
    assert [i for p in packs for i in p] == list(range(len(tokens)))
    assert [sum(tokens[i] for i in p) for p in packs] == [200, 200]
    packs = token_balanced_packs([1000, 1, 1, 1], 4)  # every pack gets a sample even when tokens are skewed
    assert [len(p) for p in packs] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="at least 4 samples"):
        token_balanced_packs([1, 2], 4)


def test_batch_rebalance_layout_makes_transformers_sampler_yield_the_schedule():
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    ranks, per_rank, steps = 3, 4, 5
    n = ranks * per_rank * steps
    layout = batch_rebalance_layout(n)
    lengths = list(np.random.default_rng(0).integers(5, 500, size=n)[layout])  # dataset position p holds layout[p]
    seen = {}
    for r in range(ranks):
        sampler = BatchRebalanceSampler(lengths, effective_batch_size=ranks * per_rank, dp_size=ranks, grad_accum=1,
                                        rank=r)
        for k, batch in enumerate(sampler):
            seen.setdefault(k, []).extend(int(layout[p]) for p in batch)
    for k in range(steps):  # global batch k = schedule samples [k*B, (k+1)*B)
        assert sorted(seen[k]) == list(range(k * ranks * per_rank, (k + 1) * ranks * per_rank))


def test_fit_step_makes_the_first_compared_step_the_first_planned_one():
    # The loader stays one step ahead until a model is set: fitted at the end of step f, step f+1 is already
    # prepared without it, and f+2 is the first step planned with it. With warm-up w the first compared step
    # is w+1. Hand-worked: w=3 -> fit after 2, plan 4; w=6 -> fit after 5, plan 7; w=10 -> fit after 9, plan 11.
    for warmup, first_planned in [(3, 4), (6, 7), (10, 11)]:
        assert fit_step(warmup) + 2 == first_planned == warmup + 1
    # The fit drops its first timed step, so it needs 2: with w=2 the model comes at step 2 and plans step 4.
    assert fit_step(2) + 2 == 4 and fit_step(1) + 2 == 4


def test_placement_bound_is_set_by_a_sample_heavier_than_a_ranks_share():
    costs = np.array([1.0, 1.0, 1.0, 1.0, 6.0, 1.0, 1.0])
    bound = placement_bound(costs, [[0, 1, 2, 3], [4, 5, 6]], ranks=2)
    assert bound[0] == pytest.approx(0.0)  # 4 equal samples on 2 ranks: perfect balance possible
    assert bound[1] == pytest.approx(6.0 / 4.0 - 1.0)  # the 6.0 sample alone exceeds the share of 4.0


def test_reachable_cut_sums_none_slowest_rank_and_the_per_step_bound():
    costs = np.array([1.0, 1.0, 1.0, 3.0, 6.0, 1.0, 1.0])
    # step 0: none's loads 2 | 4, a perfect split gives 3; step 1: the 6.0 sample sets the step either way
    out = reachable_cut(costs, [[[0, 1], [2, 3]], [[4], [5, 6]]], ranks=2, step_constant=0.5)
    assert out["none_predicted_s"] == pytest.approx(4.5 + 6.5)
    assert out["bound_s"] == pytest.approx(3.5 + 6.5)
    assert out["ceiling"] == pytest.approx(1.0 - 10.0 / 11.0)
    assert reachable_cut(costs, [[[4], [5, 6]]], ranks=2)["ceiling"] == pytest.approx(0.0)


def test_summary_and_invariants():
    compute = np.array([[1.0, 3.0], [2.0, 2.0], [4.0, 1.0]])
    run = summarize_way(compute, np.array([10, 20, 30]), [3.0, 2.0, 1.0], [[0, 1], [2, 3], [4]], 5, warmup=1)
    assert run["slowest_rank_compute_s"] == 6.0 and run["mean_rank_compute_s"] == 4.5
    assert run["samples_trained"] == 3 and run["tokens_per_s"] == pytest.approx(50 / 6.0)
    other = dict(run, losses=[3.0, 2.0, 1.0 + 1e-3])
    inv = check_invariants({"none": run, "x": other})
    assert inv["same_samples"] and not inv["losses_equal"]
    moved = dict(run, samples_per_step=[[0, 1], [2], [3, 4]])
    assert not check_invariants({"none": run, "x": moved})["same_samples"]
    assert "none" in format_table({"none": run})


def test_report_says_what_share_of_the_reachable_cut_was_reached():
    result = {"gain": {"vs_none": 0.12, "vs_batch_rebalance": -0.01, "perfect_balance_vs_none": 0.21},
              "settings": {"warmup_steps": 6, "steps": 15},
              "invariants": {"same_samples": True, "losses_equal": True, "loss_rtol": 1e-4, "max_loss_rel_diff": 0.0},
              "placement_bound": {"compared_steps_bound_by_one_sample": 3, "compared_steps": 15, "ceiling": 0.16}}
    text = "\n".join(report_lines(result))
    # the headline: the cut, and its share of what any per-step placement could reach (0.12 / 0.16)
    assert text.splitlines()[1].startswith("slowest-rank compute: 12.0% lower than none (75% of the 16.0% "
                                           "reachable), 1.0% higher than batch_rebalance (steps 7..21")
    assert "16.0% below none; hf_dp_balance measured 12.0% (75% of it)" in text  # 0.12 / 0.16
    assert "3 of 15 compared steps" in text


def _fabricated_records(ranks=2, steps=4, per_rank=3, seed=0):
    """by_rank records of the three ways as the ranks return them (no processes): random compute, the same
    samples per step in every way (none's split differs), fitted models for the placement bound."""
    rng = np.random.default_rng(seed)
    n = ranks * per_rank * steps
    by_rank = {r: {} for r in range(ranks)}
    for way in WAYS:
        for r in range(ranks):
            by_rank[r][way] = {"compute": rng.uniform(0.5, 1.5, steps).tolist(), "losses": [2.0] * steps, "moved": 0,
                               "samples": [list(range(k * ranks * per_rank + r * per_rank,
                                                      k * ranks * per_rank + (r + 1) * per_rank)) for k in range(steps)]}
    models = {"cost_model": {"quadratic": 1e-7, "linear": 3e-4, "per_sample": 0.0, "constant": 0.0},
              "vision_cost_model": {"quadratic": 1e-8, "linear": 2e-5, "per_sample": 0.0, "constant": 0.01}}
    by_rank[0]["hf_dp_balance"].update(models)
    by_rank[0].update(tokens=rng.integers(50, 2000, n).tolist(), patches=[[[1, 4, 4]] if i % 2 else [] for i in range(n)])
    return by_rank


def test_all_steps_sums_are_the_per_step_maxima_and_the_headline_reports_them(tmp_path):
    from hf_dp_balance.apps.demo_analysis import assemble, plot

    ranks, steps, warmup = 2, 4, 2
    result = assemble(_fabricated_records(ranks, steps + warmup), ranks, steps, warmup, 3, 0, "long_tail", 1.0)
    for way, run in result["runs"].items():
        per_rank = np.array(run["per_rank_compute_s"])
        assert run["all_steps_slowest_rank_compute_s"] == pytest.approx(per_rank.max(axis=1).sum())
        assert run["all_steps_slowest_rank_compute_s"] == pytest.approx(sum(run["per_step_slowest_s"]))
        assert run["all_steps_mean_rank_compute_s"] == pytest.approx(per_rank.mean(axis=1).sum())
        assert run["all_steps_slowest_rank_compute_s"] == pytest.approx(
            run["warmup_slowest_rank_compute_s"] + run["slowest_rank_compute_s"])
    every = {w: result["runs"][w]["all_steps_slowest_rank_compute_s"] for w in WAYS}
    gain = result["gain_all_steps"]
    assert gain["vs_none"] == pytest.approx(1 - every["hf_dp_balance"] / every["none"])
    assert gain["vs_batch_rebalance"] == pytest.approx(1 - every["hf_dp_balance"] / every["batch_rebalance"])
    bound = result["placement_bound"]
    full = bound["all_steps"]  # the fitted costs price every step: the bound covers the warm-up too
    assert full["steps"] == steps + warmup == len(bound["per_step_excess"])
    assert full["bound_s"] <= full["none_predicted_s"] and bound["bound_s"] <= bound["none_predicted_s"]
    assert full["bound_s"] > bound["bound_s"] and full["none_predicted_s"] > bound["none_predicted_s"]
    text = report_lines(result)
    assert text[0].startswith(f"\nslowest-rank compute over all {steps + warmup} steps (warm-up included")
    share = round(100 * gain["vs_none"] / full["ceiling"]) if full["ceiling"] > 0 else None
    if share is not None:
        assert f"({share:.0f}% of the {100 * full['ceiling']:.1f}% reachable)" in text[0]
    assert text[1].startswith("slowest-rank compute: ") and f"steps {warmup + 1}..{warmup + steps} only" in text[1]
    assert any(line.startswith(f"over all {steps + warmup} steps: reachable") for line in text)
    plot(result, str(tmp_path / "demo.png"))
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_invariants_with_lookahead_compare_windows_after_the_warmup_and_nothing_else():
    def run(samples, losses):
        return {"samples_per_step": samples, "losses": losses}

    none = run([[0, 1], [2, 3], [4, 5], [6, 7]], [4.0, 3.0, 2.0, 1.0])
    # step 1 is warm-up; steps 1..2 (0-based) and 3 form windows of 2 from step index 1
    moved_in_window = run([[0, 1], [2], [3, 4, 5], [6, 7]], [4.0, 9.0, 9.0, 9.0])
    inv = check_invariants({"none": none, "hf_dp_balance": moved_in_window}, window=2, window_from=1,
                           windowed=["hf_dp_balance"])
    assert inv["same_samples"] and inv["losses_equal"] and inv["window"] == 2
    across_windows = run([[0, 1], [2, 3, 6], [4, 5], [7]], [4.0, 9.0, 9.0, 9.0])
    assert not check_invariants({"none": none, "hf_dp_balance": across_windows}, window=2, window_from=1,
                                windowed=["hf_dp_balance"])["same_samples"]
    warmup_differs = run([[0, 1], [2, 3], [4, 5], [6, 7]], [4.5, 3.0, 2.0, 1.0])
    assert not check_invariants({"none": none, "hf_dp_balance": warmup_differs}, window=2, window_from=1,
                                windowed=["hf_dp_balance"])["losses_equal"]
    # a way not in `windowed` is still held to every step
    assert not check_invariants({"none": none, "batch_rebalance": moved_in_window}, window=2, window_from=1,
                                windowed=["hf_dp_balance"])["same_samples"]


@pytest.mark.dist  # the demo command spawns its ranks
def test_demo_with_lookahead_keeps_every_window_s_samples(tmp_path):
    from hf_dp_balance.apps.cli import main

    out = tmp_path / "demo.json"
    code = main(["demo", "--steps", "4", "--warmup", "2", "--lookahead", "2", "--ranks", "2", "--samples-per-rank",
                 "4", "--json", str(out), "--plot", "", "--no-progress"])
    result = json.loads(out.read_text())
    inv = result["invariants"]
    assert code == 0 and inv["same_samples"] and inv["losses_equal"] and inv["window"] == 2, inv
    assert result["settings"]["lookahead_steps"] == 2
    # every sample of the run trained exactly once, whichever step of its window
    ours = sorted(i for s in result["runs"]["hf_dp_balance"]["samples_per_step"] for i in s)
    assert ours == sorted(i for s in result["runs"]["none"]["samples_per_step"] for i in s)
    # the compared steps must start a window: refused before anything starts
    assert main(["demo", "--warmup", "3", "--lookahead", "2", "--json", str(tmp_path / "no.json")]) == 2
    assert main(["demo", "--max-token-ratio", "0.5", "--json", str(tmp_path / "no.json")]) == 2
    assert not (tmp_path / "no.json").exists()


@pytest.mark.dist  # the demo command spawns its ranks
def test_demo_runs_three_ways_on_two_ranks(tmp_path):
    from hf_dp_balance.apps.cli import main

    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    code = main(["demo", "--steps", "2", "--warmup", "2", "--ranks", "2", "--samples-per-rank", "4",
                 "--json", str(out), "--plot", str(png), "--no-progress"])
    result = json.loads(out.read_text())
    assert code == 0
    assert set(result["runs"]) == set(WAYS)
    for way, run in result["runs"].items():
        for key in ("slowest_rank_compute_s", "mean_rank_compute_s", "samples_trained", "tokens_per_s",
                    "moved_samples", "losses"):
            assert key in run, (way, key)
        assert len(run["losses"]) == 4 and len(run["per_step_slowest_s"]) == 4
        assert run["slowest_rank_compute_s"] >= run["mean_rank_compute_s"] > 0
        assert run["samples_trained"] == 2 * 2 * 4  # compared steps x ranks x samples per rank
    none = result["runs"]["none"]
    assert result["gain"]["perfect_balance_vs_none"] == pytest.approx(
        1 - none["mean_rank_compute_s"] / none["slowest_rank_compute_s"])
    inv = result["invariants"]
    assert inv["same_samples"] and inv["losses_equal"], inv
    ids = result["runs"]["none"]["samples_per_step"]  # ids of samples, identical token content sharing one
    assert [len(s) for s in ids] == [8] * 4
    assert all(0 <= i < (k + 1) * 8 for k, s in enumerate(ids) for i in s)  # step k: samples k*8.. (or a twin)
    assert png.stat().st_size > 10_000
    for run in result["runs"].values():  # over every step, warm-up included: the sum of the per-step maxima
        assert run["all_steps_slowest_rank_compute_s"] == pytest.approx(sum(run["per_step_slowest_s"]))
    assert set(result["gain_all_steps"]) >= {"vs_none", "vs_batch_rebalance", "perfect_balance_vs_none"}
    ours = result["runs"]["hf_dp_balance"]
    # fitted at the end of step fit_step(2) = 2; the steps before are planned with the FLOP prior (whether a
    # step is applied depends on its gain: tests/integrations/test_callback.py checks the prior's warm-up)
    assert [r["step"] for r in ours["fit_reports"]][:1] == [2]
    assert len(ours["applied_steps"]) == 4


def test_the_report_says_what_the_gate_decided_and_a_rejected_fit_still_prices_the_bound():
    from hf_dp_balance.apps.demo_analysis import fit_lines, pricing_models

    decoder = {"quadratic": 1e-7, "linear": 1e-4, "per_sample": 0.0, "constant": 0.01}
    vision = {"quadratic": 1e-8, "linear": 1e-5, "per_sample": 0.0, "constant": 0.0}
    reports = [{"step": 5, "fitted": {"decoder": decoder, "vision": vision}, "hedged": True,
                "gate": {"adopt": False, "candidate_error": 0.036, "in_force_error": 0.029, "tokens_error": 0.185,
                         "reason": "predicts the held-out steps no better than the model in force, which stays"}},
               {"step": 10, "fitted": None, "hedged": True, "gate": None}]
    lines = fit_lines(reports)
    assert lines[0].startswith("fit at step 5: rejected, the model in force stays; held-out error 3.6% "
                               "(in force 2.9%, tokens 18.5%); plans hedged")
    assert lines[1] == "fit at step 10: no gate verdict (the fit failed)"
    # the prior stayed in force (no cost_model in the record): the reachable cut is priced by the last fit
    assert pricing_models({"cost_model": None, "vision_cost_model": None, "fit_reports": reports}) == (decoder, vision)
    assert pricing_models({"cost_model": None, "vision_cost_model": None}) == (None, None)
