"""recipes/accelerate_loop.py as its docstring starts it: torchrun, 2 CPU ranks, tiny Qwen2-VL, balanced."""

import json
import os
import subprocess
import sys

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes",
                      "accelerate_loop.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_the_custom_loop_recipe_balances_on_two_cpu_ranks(tmp_path):
    out = str(tmp_path / "loop")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", RECIPE, "--model", "tiny:qwen2_vl", "--output_dir", out,
           "--cpu", "--synthetic_samples", "32", "--max_steps", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"recipe failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    logs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    assert all(h["dp_balance/steps"] == 1 for h in logs)  # each log sees its own step's statistics
    assert sum(h["dp_balance/moved_samples"] for h in logs) > 0
    assert all(h["dp_balance/imbalance_after"] <= h["dp_balance/imbalance_before"] + 1e-9 for h in logs)
    assert os.path.isfile(os.path.join(out, "final", "model.safetensors"))
