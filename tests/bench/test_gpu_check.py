"""bench/gpu_check.py --tiny: the GPU check's code path on CPU, end to end (its numbers are not checked: tiny
models on shared cores; the fields, the invariants and the structure are)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["none", "batch_rebalance", "hf_dp_balance", "measured"]
CALIBRATION_FIELDS = {"per_rank_pack_mape", "per_rank_prior_pack_mape", "per_rank_prior_step_mape",
                      "step_time_prior_step_mape", "single_sample_mape", "quadratic_over_linear_fitted",
                      "quadratic_over_linear_fitted_with_prior", "quadratic_over_linear_prior", "effective_tflops",
                      "model"}
METHOD_FIELDS = {"slowest_s", "mean_s", "imbalance", "vs_none", "moved_per_step", "per_step_slowest_s",
                 "per_step_mean_s", "samples_per_step"}
HOST_FIELDS = {"plan_s", "batch_rebalance_sampler_s", "codec_slowest_rank_s", "moved_per_step", "moved_mib_per_step"}


def test_tiny_check_runs_every_method_on_the_same_samples(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert not (tmp_path / "gpu_check.json.part").exists() and result["wall_s"] > 0

    settings = result["settings"]
    assert settings["tiny"] is True and settings["ranks"] == [8, 32] and settings["steps"] >= 1
    assert settings["clock"] == "thread CPU time"

    assert set(result["calibration"]) == {"decoder", "vision"}
    for module, row in result["calibration"].items():
        assert set(row) == CALIBRATION_FIELDS, module
        for key in ("per_rank_pack_mape", "per_rank_prior_pack_mape", "step_time_prior_step_mape"):
            assert math.isfinite(row[key]) and row[key] >= 0, (module, key)
        assert row["quadratic_over_linear_prior"] > 0

    steps = settings["steps"]
    for ranks in ("8", "32"):
        run = result["virtual_dp"][ranks]
        assert list(run["methods"]) == METHODS
        for method, row in run["methods"].items():
            assert set(row) == METHOD_FIELDS, method
            assert len(row["per_step_slowest_s"]) == len(row["per_step_mean_s"]) == steps
            assert all(s >= m > 0 for s, m in zip(row["per_step_slowest_s"], row["per_step_mean_s"])), method
            assert math.isclose(row["slowest_s"], sum(row["per_step_slowest_s"]))
        assert run["methods"]["none"]["moved_per_step"] == 0
        assert run["methods"]["batch_rebalance"]["moved_per_step"] is None  # its ranks read their own samples
        # every method trained the same samples in every step, each exactly once
        reference = run["methods"]["none"]["samples_per_step"]
        assert len(reference) == steps
        for k, ids in enumerate(reference):
            assert len(ids) >= int(ranks) and len(set(ids)) == len(ids), (ranks, k)
        for method in METHODS[1:]:
            assert run["methods"][method]["samples_per_step"] == reference, (ranks, method)
        assert set(run["gains"]) == {"vs_none", "vs_batch_rebalance", "measured_vs_none", "share_of_measured_cut"}
        none, ours = run["methods"]["none"]["slowest_s"], run["methods"]["hf_dp_balance"]["slowest_s"]
        assert math.isclose(run["gains"]["vs_none"], 1 - ours / none)
        host = result["host"][ranks]
        assert set(host) == HOST_FIELDS and host["plan_s"] > 0 and host["codec_slowest_rank_s"] >= 0
    assert result["host"]["large"]["ranks"] == 4096 and result["host"]["large"]["samples"] > 4096
    assert result["host"]["large"]["plan_s"] > 0

    table = proc.stdout
    for needle in ("calibration", "batch_rebalance", "hf_dp_balance's slowest rank", "DP 4096", "plan_step ms"):
        assert needle in table, needle
