"""`hf-dp-balance demo --input packed`: the balanced way receives none's fixed-length packs (the user's setup)."""

import json

import pytest


@pytest.mark.dist  # the demo command spawns its ranks
def test_demo_balances_the_packs_none_trains(tmp_path):
    from hf_dp_balance.apps.cli import main

    out = tmp_path / "demo.json"
    code = main(["demo", "--steps", "2", "--warmup", "2", "--ranks", "2", "--samples-per-rank", "4", "--input",
                 "packed", "--json", str(out), "--plot", "", "--no-progress"])
    result = json.loads(out.read_text())
    inv = result["invariants"]
    assert code == 0 and inv["same_samples"] and inv["losses_equal"], inv
    assert result["settings"]["input"] == "packed"
    ours, none = result["runs"]["hf_dp_balance"], result["runs"]["none"]
    assert ours["samples_trained"] == none["samples_trained"] == 2 * 2 * 4
    # (whether samples move depends on the cost model fitted from this machine's timings: not asserted)
    assert len(ours["applied_steps"]) == len(ours["losses"]) == 4  # warm-up planned with the prior, then the fit
