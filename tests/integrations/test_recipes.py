"""recipes/sft_vlm.py as its docstring starts it: torchrun, 2 CPU ranks, a tiny model, balancing on; and resume.

The resumed run must end on the same weights as the uninterrupted one. For Qwen2-VL that needs the
recipe's `from_pretrained(checkpoint)` (transformers 5.24 writes legacy key names into checkpoints and
Trainer's own resume keeps the fresh weights: tests/integrations/test_checkpoint_resume.py).
"""

import os
import subprocess
import sys

import pytest
import torch

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes", "sft_vlm.py")


def _torchrun(out_dir, *extra, balance=("--dp_balance", "--dp_balance_warmup_steps", "2"), batch="4", samples="64",
              save=("--save_strategy", "steps", "--save_steps", "4"), timeout=300, env_extra=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", RECIPE,
           "--model", "tiny:qwen2_vl", "--data", "synthetic", "--synthetic_samples", samples, "--output_dir", out_dir,
           "--use_cpu", "--max_steps", "8", "--per_device_train_batch_size", batch, *save,
           "--report_to", "none", "--logging_steps", "1", "--seed", "0", "--disable_tqdm", "true", *balance, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **(env_extra or {}))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"recipe failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _weights(path):
    from transformers import Qwen2VLForConditionalGeneration

    return {k: v.detach().clone() for k, v in Qwen2VLForConditionalGeneration.from_pretrained(path).state_dict().items()}


def _max_rel_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def test_recipe_trains_on_two_cpu_ranks_and_resumes_from_the_checkpoint_s_weights(tmp_path):
    import json

    from hf_dp_balance.testing.models import make_model

    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    _torchrun(full)
    _torchrun(resumed, "--resume_from_checkpoint", os.path.join(full, "checkpoint-4"))

    state = json.load(open(os.path.join(full, "checkpoint-8", "trainer_state.json")))
    logged = [h for h in state["log_history"] if "loss" in h]
    assert len(logged) == 8 and all("dp_balance/imbalance_before" in h for h in logged)
    assert max(int(h["dp_balance/fitted"]) for h in logged) == 1  # the callback fitted its cost model

    final, half = _weights(os.path.join(full, "final")), _weights(os.path.join(full, "checkpoint-4"))
    fresh = {k: v.detach() for k, v in make_model("qwen2_vl", seed=0).state_dict().items()}
    assert _max_rel_diff(final, half) > 1e-4  # steps 5..8 moved the weights, so the comparison below can fail
    assert _max_rel_diff(half, fresh) > 1e-4
    # same samples per step, only their placement may differ: equal up to float summation order
    assert _max_rel_diff(_weights(os.path.join(resumed, "final")), final) < 1e-4
    # the resumed history: steps 1..4 restored from the checkpoint, then 5..8 trained again, same losses
    again = [h for h in json.load(open(os.path.join(resumed, "checkpoint-8", "trainer_state.json")))["log_history"]
             if "loss" in h]
    assert [h["step"] for h in again] == list(range(1, 9))
    assert [float(h["loss"]) for h in again] == pytest.approx([float(h["loss"]) for h in logged], rel=1e-4)


def test_gradient_checkpointing_recipe_with_text_only_rows_finishes_and_equals_the_unbalanced_run(tmp_path):
    """Under --gradient_checkpointing Trainer wraps DDP with find_unused_parameters=False; a rank
    whose packed row has no image used to leave the vision tower without gradients and every rank waited
    (620951a: this balanced run dies at step 6 with a gloo timeout). With a fixed cost model the plans are
    deterministic; batch 2 makes balancing leave text-only rows. The collator's dummy image keeps the tower
    in every backward, contributing exactly zero."""
    import json

    from hf_dp_balance.core.cost import CostModel

    cost = str(tmp_path / "cost.json")
    CostModel.default_decoder().save(cost)
    balanced, plain = str(tmp_path / "balanced"), str(tmp_path / "plain")
    quick = dict(batch="2", save=("--save_strategy", "steps", "--save_steps", "8"), timeout=120,
                 env_extra={"HF_DP_BALANCE_TIMEOUT_S": "30"})
    _torchrun(balanced, "--gradient_checkpointing", balance=("--dp_balance", "--dp_balance_cost_model_path", cost),
              **quick)
    _torchrun(plain, "--gradient_checkpointing", balance=(), **quick)

    def logged(out):
        state = json.load(open(os.path.join(out, "checkpoint-8", "trainer_state.json")))
        return [h for h in state["log_history"] if "loss" in h]

    assert sum(float(h["dp_balance/moved_samples"]) for h in logged(balanced)) > 0  # balancing really moved samples
    assert len(logged(balanced)) == 8
    assert [h["loss"] for h in logged(balanced)] == pytest.approx([h["loss"] for h in logged(plain)], rel=1e-4)
    assert _max_rel_diff(_weights(os.path.join(balanced, "final")), _weights(os.path.join(plain, "final"))) < 1e-4
