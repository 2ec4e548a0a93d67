"""The what-if simulator: hand-checked numbers, determinism, mixes, packing, clear errors."""

import json

import numpy as np
import pytest

from hf_dp_balance.apps.cli import main as cli_main
from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.apps.simulate import load_lengths
from hf_dp_balance.testing.mix import SampleShapes, draw_mix, mix_names, pack_fixed_length, truncate
from hf_dp_balance.apps.sim_model import BYTES_PER_TOKEN, SampleCost, load_cost
from hf_dp_balance.apps.sim_runs import simulate, simulate_packed


def _quadratic_cost(overhead=0.1):
    # cost = 0.01 * L^2 seconds: easy to check by hand.
    return SampleCost("hand", CostModel(quadratic=0.01, linear=0.0), None, overhead, "hand-checked")


def test_tiny_case_matches_hand_computation():
    # Lengths 6, 3, 4 in packs of 10: pack 0 = [6, 3] (9 tokens), pack 1 = [4]. DP 2, one step.
    samples = SampleShapes.text_only([6, 3, 4])
    pack_of = pack_fixed_length(samples.tokens, 10)
    assert pack_of.tolist() == [0, 0, 1]
    row = simulate_packed(samples, pack_of, 2, _quadratic_cost(), pack=10)
    # Costs 0.36, 0.09, 0.16: rank 0 = 0.45, rank 1 = 0.16 -> no balancing: 0.45 s + 0.1 s overhead.
    assert row["tgs_none"] == pytest.approx(13 / (2 * 0.55))
    # Ours moves the 3-token sample to rank 1 (7 tokens <= cap 10): 0.36 / 0.25 -> 0.36 + 0.1.
    assert row["tgs_ours"] == pytest.approx(13 / (2 * 0.46))
    assert row["moved_share_ours"] == pytest.approx(1 / 3)
    # The reference skips: the 6-token sample (0.36) outweighs the average rank (0.305).
    assert row["tgs_reference"] == pytest.approx(row["tgs_none"])
    assert row["applied_share_reference"] == 0.0
    assert row["tgs_reference_capped"] == pytest.approx(row["tgs_none"])
    # Lower bound: max(mean 0.305, heaviest 0.36) = 0.36; this step is single-sample bound.
    assert row["tgs_lower_bound"] == pytest.approx(13 / (2 * 0.46))
    assert row["single_sample_bound_share"] == 1.0
    assert row["gain_ours"] == pytest.approx(0.55 / 0.46 - 1)


def test_exchange_time_is_charged_when_not_overlapped():
    samples = SampleShapes.text_only([6, 3, 4])
    pack_of = pack_fixed_length(samples.tokens, 10)
    # 1000 B/s: moving the 3-token sample (3 * 48 B) takes 0.144 s.
    slow = dict(pack=10, bandwidth_gbs=1e-6)
    hidden = simulate_packed(samples, pack_of, 2, _quadratic_cost(), overlap=True, **slow)
    exposed = simulate_packed(samples, pack_of, 2, _quadratic_cost(), overlap=False, **slow)
    move = 3 * BYTES_PER_TOKEN / 1000.0
    assert hidden["tgs_ours"] == pytest.approx(13 / (2 * 0.46))
    assert exposed["tgs_ours"] == pytest.approx(13 / (2 * (0.46 + move)))
    assert exposed["tgs_none"] == pytest.approx(hidden["tgs_none"])  # nothing moves without balancing


def test_grad_accumulation_step_sums_micro_batches():
    # DP 2, GA 2: packs 0..3 -> (micro 0: rank 0, 1), (micro 1: rank 0, 1). Pack = one sample each.
    samples = SampleShapes.text_only([8, 2, 8, 2])
    pack_of = np.arange(4)
    row = simulate_packed(samples, pack_of, 2, _quadratic_cost(0.0), pack=10, ga=2)
    # Rank 0 holds both 8s (1.28 s), rank 1 both 2s (0.08 s); balanced: 0.68 s each.
    assert row["tgs_none"] == pytest.approx(20 / (2 * 1.28))
    assert row["tgs_ours"] == pytest.approx(20 / (2 * 0.68))


def _strip_timings(result):
    return [{k: v for k, v in r.items() if not k.startswith("plan_ms")} for r in result["results"]]


def test_deterministic_by_seed_and_seed_matters():
    kw = dict(pack=8192, steps=3, lookahead=2)
    a = simulate("qwen2vl-sft", [4, 8], "7b", seed=3, **kw)
    b = simulate("qwen2vl-sft", [4, 8], "7b", seed=3, **kw)
    c = simulate("qwen2vl-sft", [4, 8], "7b", seed=4, **kw)
    assert _strip_timings(a) == _strip_timings(b)
    assert _strip_timings(a) != _strip_timings(c)
    for row in a["results"]:
        assert row["tgs_ours"] >= row["tgs_none"] * (1 - 1e-12)
        assert row["tgs_lower_bound"] >= row["tgs_ours"] * (1 - 1e-9)
    json.dumps(a)  # the result is plain JSON


def test_mixes_are_deterministic_and_respect_their_bounds():
    for name in mix_names():
        s1 = draw_mix(name, 3000, np.random.default_rng(0))
        s2 = draw_mix(name, 3000, np.random.default_rng(0))
        assert np.array_equal(s1.tokens, s2.tokens) and np.array_equal(s1.item_patches, s2.item_patches)
        assert len(s1) == 3000 and s1.tokens.min() >= 1
    assert draw_mix("qwen2vl-sft-bounded", 20000, np.random.default_rng(1)).tokens.max() <= 8192
    assert draw_mix("internvl-sft", 20000, np.random.default_rng(1)).tokens.max() <= 8192
    outliers = draw_mix("qwen2vl-sft-outliers", 20000, np.random.default_rng(1)).tokens
    assert 0.005 < np.mean(outliers >= 16384) < 0.02  # the 1% tail
    text = draw_mix("text-sft", 2000, np.random.default_rng(1))
    assert text.item_patches.size == 0


def test_truncate_and_take_keep_items_with_their_samples():
    s = SampleShapes(np.array([10, 5, 7]), np.array([8, 8, 40, 4]), np.array([0, 2, 2, 4]))
    assert s.tokens.tolist() == [14, 5, 18]
    t = truncate(s, 10)  # sample 0: text clipped to 6; sample 2: keeps its first item (10 tokens), drops the last
    assert t.tokens.tolist() == [10, 5, 10]
    assert t.item_offsets.tolist() == [0, 2, 2, 3] and t.item_patches.tolist() == [8, 8, 40]
    assert t.text_tokens.tolist() == [6, 5, 0]
    taken = s.take([2, 0])
    assert taken.tokens.tolist() == [18, 14] and taken.item_patches.tolist() == [40, 4, 8, 8]


def test_packing_is_greedy_in_arrival_order():
    assert pack_fixed_length(np.array([5, 5, 1, 9, 10, 1]), 10).tolist() == [0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="sample 1 has 11 tokens > pack 10"):
        pack_fixed_length(np.array([3, 11]), 10)


def test_user_lengths_from_text_file_and_dataset(tmp_path):
    import datasets

    text = tmp_path / "lengths.txt"
    text.write_text("# lengths\n100\n2500\n\n40000\n")
    assert load_lengths(str(text)).tolist() == [100, 2500, 40000]
    bad = tmp_path / "bad.txt"
    bad.write_text("100\nabc\n")
    with pytest.raises(ValueError, match="line 2 is not a number"):
        load_lengths(str(bad))
    zero = tmp_path / "zero.txt"
    zero.write_text("100\n0\n")
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        load_lengths(str(zero))

    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"n_tokens": [300, 700, 5000], "input_ids": [[1, 2], [3], [4, 5, 6]]}).save_to_disk(str(path))
    assert load_lengths(f"dataset:{path}:n_tokens").tolist() == [300, 700, 5000]
    assert load_lengths(f"dataset:{path}:input_ids").tolist() == [2, 1, 3]
    with pytest.raises(ValueError, match="no column 'length'"):
        load_lengths(f"dataset:{path}:length")
    # A user's lengths run through the simulator (40000 is truncated to the pack).
    result = simulate(load_lengths(str(text)), [2], "7b", pack=32768, steps=2)
    assert result["results"][0]["tgs_ours"] >= result["results"][0]["tgs_none"]


def test_cost_presets_and_fitted_json(tmp_path):
    seven, big = load_cost("7b"), load_cost("72b")
    s = SampleShapes.text_only([4096, 32768])
    # A 32K sample costs ~60% more per token than a 4K one (attention = dense near 53K tokens).
    per_token = seven.costs(s) / s.tokens
    assert per_token[1] / per_token[0] == pytest.approx((1 + 32768 / 53333) / (1 + 4096 / 53333), rel=0.01)
    assert big.costs(s)[0] > 9 * seven.costs(s)[0]
    fitted = tmp_path / "cost.json"
    fitted.write_text(json.dumps({"model": {"quadratic": 1e-9, "linear": 1e-4, "per_sample": 0.0, "constant": 0.5}}))
    model = load_cost(str(fitted))
    assert model.step_overhead == pytest.approx(0.5) and model.vision is None
    assert model.costs(SampleShapes.text_only([1000]))[0] == pytest.approx(1e-3 + 0.1)
    with pytest.raises(ValueError, match="--cost 'nope'"):
        load_cost("nope")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp", "0,8"], "argument --dp: '0,8': each DP size must be an integer in 1..65536"),
        (["--dp", "8,x"], "comma-separated integers"),
        (["--mix", "nope"], "invalid choice"),
        (["--pack", "0"], "argument --pack: 0 must be >= 1"),
        (["--steps", "0"], "argument --steps: 0 must be >= 1"),
        (["--lookahead", "-1"], "argument --lookahead: -1 must be >= 0"),
        (["--cost", "missing.json"], "--cost 'missing.json'"),
        (["--lengths-from", "missing.txt"], "--lengths-from 'missing.txt': no such file"),
        (["--mix", "text-sft", "--lengths-from", "x.txt"], "not allowed with argument"),
    ],
)
def test_bad_arguments_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["simulate", "--no-progress", "--steps", "1", "--dp", "2"] + argv)
    assert exc.value.code not in (0, None)
    assert message in (capsys.readouterr().err + str(exc.value.code))


def test_cli_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    code = cli_main([
        "simulate", "--dp", "2,4", "--mix", "qwen2vl-sft-bounded", "--pack", "8192", "--steps", "2",
        "--lookahead", "2", "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ])
    assert code == 0
    data = json.loads(out_json.read_text())
    assert [r["dp"] for r in data["results"]] == [2, 4]
    for key in ("tgs_none", "tgs_reference", "tgs_ours", "gain_ours", "gain_reference",
                "single_sample_bound_share", "tgs_lookahead"):
        assert key in data["results"][0]
    assert data["settings"]["mix"] == "qwen2vl-sft-bounded" and data["settings"]["pack"] == 8192
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| DP |" in capsys.readouterr().out


@pytest.mark.parametrize("sync", ["step", "micro_batch"])
def test_grad_accumulation_with_lookahead_runs_and_bounds_hold(sync):
    result = simulate("qwen2vl-sft-outliers", [4], "7b", pack=16384, ga=2, steps=4, lookahead=2, sync=sync)
    row = result["results"][0]
    assert row["plan_failures_ours"] == 0 and row["over_cap_share_ours"] == 0.0
    assert row["over_cap_share_lookahead"] == 0.0
    assert row["tgs_ours"] >= row["tgs_none"] * (1 - 1e-12)
    if sync == "step":  # for DDP the per-step lower bound is exact for any within-step plan
        assert row["tgs_lower_bound"] >= row["tgs_ours"] * (1 - 1e-9)


# --------------------------------------------------------------------------- the whole step


def test_allreduce_is_a_ring_over_the_slowest_link():
    from hf_dp_balance.apps.sim_price import StepPrice

    price = StepPrice(params=1e9)  # bf16: 2 GB of gradients
    assert price.allreduce_s(1) == 0.0
    # 8 GPUs: one node, NVLink 3600 Gb/s = 450 GB/s: 2 * 7/8 * 2 GB / 450 GB/s
    assert price.allreduce_s(8) == pytest.approx(2 * 7 / 8 * 2e9 / 450e9)
    # 16 GPUs: two nodes, 400 Gb/s = 50 GB/s per GPU: 2 * 15/16 * 2 GB / 50 GB/s = 75 ms
    assert price.allreduce_s(16) == pytest.approx(0.075)
    assert StepPrice(params=1e9, grad_dtype="fp32").allreduce_s(16) == pytest.approx(0.15)
    assert StepPrice(params=1e9, gpus_per_node=16).allreduce_s(16) == pytest.approx(2 * 15 / 16 * 2e9 / 450e9)
    # Adam: 30 B per parameter at 3350 GB/s
    assert StepPrice.adam(1e9).optimizer_s == pytest.approx(30e9 / 3350e9)


def test_step_parts_hide_the_allreduce_behind_backward_and_the_exchange_behind_the_step():
    from hf_dp_balance.apps.sim_price import StepPrice

    kw = dict(params=1e9, optimizer_s=0.01, fixed_s=0.02)
    # overlapped: 75 ms all-reduce behind 2/3 of 60 ms compute (40 ms): 35 ms shows
    parts = StepPrice(**kw).parts(16, 0.06, 0.2, exchange_overlapped=True)
    assert parts["allreduce"] == pytest.approx(0.035)
    # the exchange (200 ms) overlaps a step of 60 + 35 + 10 + 20 = 125 ms: 75 ms shows
    assert parts["exchange"] == pytest.approx(0.075)
    exposed = StepPrice(allreduce_overlapped=False, **kw).parts(16, 0.06, 0.2, exchange_overlapped=False)
    assert exposed == pytest.approx({"compute": 0.06, "allreduce": 0.075, "optimizer": 0.01, "fixed": 0.02,
                                     "exchange": 0.2})


def test_whole_step_priced_in_a_hand_computed_run():
    from hf_dp_balance.apps.sim_price import StepPrice

    samples = SampleShapes.text_only([6, 3, 4])
    pack_of = pack_fixed_length(samples.tokens, 10)
    price = StepPrice(params=1e9, allreduce_overlapped=False, optimizer_s=0.02, fixed_s=0.1)
    row = simulate_packed(samples, pack_of, 2, _quadratic_cost(), pack=10, price=price, bandwidth_gbs=1e-6)
    allreduce = 2 * 1 / 2 * 2e9 / 450e9  # DP 2 inside a node
    rest = allreduce + 0.02 + 0.1
    # none: slowest rank 0.45 s; ours 0.36 s, its 3-token move (144 B at 1000 B/s = 0.144 s) overlaps the step
    # of 0.36 + rest and shows only beyond it
    assert row["tgs_none"] == pytest.approx(13 / (2 * (0.45 + rest)))
    shown = max(0.0, 0.144 - (0.36 + rest))
    assert row["tgs_ours"] == pytest.approx(13 / (2 * (0.36 + rest + shown)))
    assert row["step_parts_s_none"] == pytest.approx({"compute": 0.45, "allreduce": allreduce, "optimizer": 0.02,
                                                      "fixed": 0.1, "exchange": 0.0})
    assert row["allreduce_s"] == pytest.approx(allreduce)
    assert row["gb_moved_per_step_ours"] == pytest.approx(3 * BYTES_PER_TOKEN / 1e9)
    assert row["gb_moved_per_step_none"] == 0.0
    # not hidden, the exchange is 0.144 of a 0.36 + rest + 0.144 s step, and the gain shrinks by it
    assert row["exchange_share_ours"] == pytest.approx(0.144 / (0.36 + rest + 0.144))
    assert row["gain_ours_exchange_shown"] == pytest.approx((0.45 + rest) / (0.36 + rest + 0.144) - 1)


def test_published_setup_prints_the_reference_gains_beside_the_blog(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    code = cli_main(["simulate", "--setup", "published", "--dp", "16,256", "--steps", "1", "--no-progress",
                     "--json", str(out_json), "--inter-node-gbps", "200", "--optimizer-s", "0.05"])
    assert code == 0
    text = capsys.readouterr().out
    assert "| reference method, simulated | with its exchange shown | published (blog) |" in text
    assert "| 256 |" in text and "+3.3% |" in text
    data = json.loads(out_json.read_text())
    price = data["settings"]["step_price"]
    assert data["settings"]["setup"] == "published" and data["settings"]["pack"] == 32768
    assert price["allreduce_overlapped"] is False and price["inter_node_gbps"] == 200 and price["optimizer_s"] == 0.05
    assert price["params"] == pytest.approx(7.675e9)
    # 7.675B bf16 parameters, 2 * 255/256 * 15.35 GB at 25 GB/s, all of it on the step
    row = data["results"][1]
    assert row["allreduce_s"] == pytest.approx(2 * 255 / 256 * 7.675e9 * 2 / 25e9)
    assert row["step_parts_s_none"]["allreduce"] == pytest.approx(row["allreduce_s"])
    for key in ("gb_moved_per_step_reference", "exchange_share_ours", "gain_reference_exchange_shown"):
        assert key in row
    assert row["gb_moved_per_step_reference"] > row["gb_moved_per_step_ours"]  # the reference moves most samples
