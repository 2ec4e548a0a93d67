"""TRL's SFTTrainer with DPBalanceCallback and PackedCollator on 2 real gloo ranks: balanced, same update as
unbalanced; the settings it needs are set by `sft_config` or refused with an error naming them."""

import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks

GA = 2


def _dataset(n: int):
    from hf_dp_balance.testing.data import build_synthetic_dataset

    return build_synthetic_dataset("qwen2_vl", n, seed=0, scale=1 / 64).with_format("torch")


def _sft_trainer(out_dir, balanced: bool, dataset, **overrides):
    import transformers
    from trl import SFTTrainer

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.integrations.trl import sft_config
    from hf_dp_balance.testing.models import build_tokenizer, make_model

    transformers.logging.set_verbosity_error()
    model = make_model("qwen2_vl", seed=0, dtype=torch.float64)
    settings = dict(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=GA,
                    max_steps=2, optim="sgd", learning_rate=0.5, report_to=[], logging_steps=1, save_strategy="no",
                    disable_tqdm=True, seed=0, data_seed=0, dataloader_drop_last=True, bf16=False,
                    dataset_kwargs={"skip_prepare_dataset": True})
    settings.update(overrides)
    make = settings.pop("make_args", sft_config)
    cfg = DPBalanceConfig(enabled=balanced, min_gain=0.0, timeout_s=60, max_token_ratio=3.0)
    callback = DPBalanceCallback(cfg, cost_model=CostModel(quadratic=1.0, linear=5.0))
    trainer = SFTTrainer(model=model, args=make(**settings), train_dataset=dataset,
                         processing_class=build_tokenizer("qwen2_vl"), data_collator=PackedCollator(model.config),
                         callbacks=[callback])
    return trainer, model


def _update(model, initial):
    return torch.cat([(p.detach() - initial[n]).reshape(-1) for n, p in model.named_parameters()])


def _balanced_and_unbalanced(rank, world, out_dir):
    from hf_dp_balance.testing.models import make_model

    torch.set_num_threads(1)
    dataset = _dataset(16)
    initial = {n: p.detach().clone() for n, p in make_model("qwen2_vl", seed=0, dtype=torch.float64).named_parameters()}
    out = {}
    for balanced in (True, False):
        trainer, model = _sft_trainer(f"{out_dir}/{balanced}", balanced, dataset)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        out[balanced] = {"update": _update(model, initial).numpy(), "moved": sum(h.get("dp_balance/moved_samples", 0)
                                                                                   for h in logs),
                         "applied": sum(h.get("dp_balance/applied", 0) for h in logs)}
    return out


def test_sft_trainer_balances_with_the_unbalanced_update(tmp_path):
    out = run_ranks(_balanced_and_unbalanced, 2, str(tmp_path), timeout=300, pg_timeout_s=120)
    on, off = torch.from_numpy(out[0][True]["update"]), torch.from_numpy(out[0][False]["update"])
    assert float((on - off).norm() / off.norm()) < 1e-5
    assert torch.equal(torch.from_numpy(out[1][True]["update"]), on)  # DDP: every rank holds the same weights
    assert out[0][True]["applied"] >= 1 and out[0][True]["moved"] > 0  # balancing moved samples
    assert out[0][False]["moved"] == 0


def _refused(rank, world, out_dir):
    from trl import SFTConfig

    torch.set_num_threads(1)
    trainer, _ = _sft_trainer(out_dir, True, _dataset(8), make_args=SFTConfig, dataset_kwargs=None)  # TRL's defaults
    try:
        trainer.train()
    except ValueError as exc:
        return str(exc)
    return None


def test_sft_trainer_with_trl_s_defaults_is_refused_naming_the_settings(tmp_path):
    for message in run_ranks(_refused, 2, str(tmp_path), timeout=200, pg_timeout_s=60):
        assert message is not None
        assert "remove_unused_columns=False" in message and "skip_prepare_dataset" in message, message
        assert "torch-formatted" not in message and "packing=True" not in message, message  # not this run's


def test_sft_config_sets_only_what_balancing_needs_and_checks_refuse_only_packed_collator_breakage():
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.trl import is_sft_config, sft_config, sft_setup_problems
    from hf_dp_balance.testing.models import tiny_config

    args = sft_config(output_dir="/tmp/unused", use_cpu=True, report_to=[], dataset_kwargs={"other": 1})
    assert is_sft_config(args) and args.remove_unused_columns is False
    assert args.dataset_kwargs == {"other": 1}  # TRL's preparation stays on (raw text, packing)
    config = tiny_config("qwen2_vl")
    packs = PackedCollator(config)
    problems = sft_setup_problems(args, _dataset(2), config, packs)  # a VLM's samples through TRL's truncation
    assert len(problems) == 1 and "skip_prepare_dataset" in problems[0] and "mm_token_type_ids" in problems[0]
    assert sft_setup_problems(args, _dataset(2), tiny_config("text"), packs) == []  # text: truncation is TRL's
    skip = sft_config(output_dir="/tmp/unused", use_cpu=True, report_to=[], dataset_kwargs={"skip_prepare_dataset": True})
    assert sft_setup_problems(skip, _dataset(2), config, packs) == []
    problems = sft_setup_problems(skip, _dataset(2).with_format(None), config, packs)
    assert len(problems) == 1 and "with_format('torch')" in problems[0]
    packing = sft_config(output_dir="/tmp/unused", use_cpu=True, report_to=[], packing=True)
    problems = sft_setup_problems(packing, _dataset(2), tiny_config("text"), packs)
    assert len(problems) == 1 and "packing=True" in problems[0] and "leave data_collator unset" in problems[0]
    # TRL's own collator: TRL prepares and collates, balancing splits its rows; nothing to refuse
    assert sft_setup_problems(packing, _dataset(2).with_format(None), config, None) == []
    with pytest.raises(ValueError, match="remove_unused_columns"):
        sft_config(output_dir="/tmp/unused", remove_unused_columns=True)
    assert sft_setup_problems(object(), None, None, packs) == []  # a stock Trainer's arguments: nothing to say


@pytest.mark.parametrize("model", ["tiny:text", "tiny:qwen2_vl"])
def test_the_recipe_trains_balanced_on_two_cpu_ranks(model, tmp_path):
    """tiny:text: TRL tokenizes and packs raw text itself; tiny:qwen2_vl: PackedCollator packs the samples."""
    import os
    import subprocess
    import sys

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "sft_trl.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", recipe,
           "--model", model, "--output_dir", str(tmp_path), "--use_cpu", "--max_steps", "4",
           "--per_device_train_batch_size", "4", "--report_to", "none", "--logging_steps", "1",
           "--synthetic_samples", "64", "--disable_tqdm", "true", "--save_strategy", "no", "--max_length", "256"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DP_BALANCE_WARMUP_STEPS="2", HF_DP_BALANCE_VERBOSE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    logs = [line for line in (done.stdout + done.stderr).splitlines() if "'dp_balance/fitted'" in line]
    assert len(logs) == 4 and "'dp_balance/fitted': '1'" in logs[-1]
    assert os.path.isdir(os.path.join(str(tmp_path), "final"))
    if model == "tiny:text":
        assert "input: packed rows with cu_seq_lens" in done.stdout + done.stderr  # TRL's packed rows, split


def _text_datasets(n: int):
    """Raw text (TRL tokenizes) and the same samples pre-tokenized, python format (TRL's collator takes lists)."""
    import datasets

    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import build_tokenizer

    tok = build_tokenizer("text")
    samples = [to_sample(r) for r in build_synthetic_dataset("text", n, seed=1, scale=1 / 16)]
    ids = [[int(t) for t in s["input_ids"][1:] if int(t) > 10] for s in samples]  # ordinary tokens only
    text = datasets.Dataset.from_dict({"text": [tok.decode(x) for x in ids]})
    tokens = datasets.Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples],
                                         "labels": [s["labels"].tolist() for s in samples]})
    return text, tokens


def _trl_own_preparation(rank, world, out_dir):
    """SFTConfig(packing=True) on raw text and padding_free=True on python-format tokens, TRL's collator."""
    import transformers
    from trl import SFTTrainer

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.integrations.trl import sft_config
    from hf_dp_balance.testing.models import build_tokenizer, make_model

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    text, tokens = _text_datasets(48)
    out = {}
    for name, dataset, extra in (("packing", text, {"packing": True, "max_length": 160}),
                                 ("padding_free", tokens, {"padding_free": True, "max_length": None})):
        for balanced in (True, False):
            model = make_model("text", seed=0, dtype=torch.float64)
            start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            args = sft_config(output_dir=f"{out_dir}/{name}{balanced}", use_cpu=True, per_device_train_batch_size=2,
                              gradient_accumulation_steps=GA, max_steps=2, optim="sgd", learning_rate=0.5,
                              report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                              data_seed=0, dataloader_drop_last=True, bf16=False, max_grad_norm=0.0, **extra)
            cfg = DPBalanceConfig(enabled=balanced, min_gain=0.0, timeout_s=60, warmup_steps=0)
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=build_tokenizer("text"),
                                 callbacks=[DPBalanceCallback(cfg, cost_model=CostModel(quadratic=1.0, linear=5.0))])
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            prepared = trainer.train_dataset
            out[name, balanced] = {
                "update": (torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start).numpy(),
                "losses": [h["loss"] for h in logs], "moved": sum(h.get("dp_balance/moved_samples", 0) for h in logs),
                "sequences_per_row": [len(x) for x in prepared["seq_lengths"]] if "seq_lengths" in prepared.column_names
                else None}
    return out


def test_trl_s_own_packing_and_padding_free_rows_balance_with_the_unbalanced_update(tmp_path):
    out = run_ranks(_trl_own_preparation, 2, str(tmp_path), timeout=400, pg_timeout_s=120)
    for name in ("packing", "padding_free"):
        on, off = out[0][name, True], out[0][name, False]
        update_on, update_off = torch.from_numpy(on["update"]), torch.from_numpy(off["update"])
        assert float((update_on - update_off).norm() / update_off.norm()) < 1e-5, name
        assert max(abs(a - b) for a, b in zip(on["losses"], off["losses"])) < 1e-5, name
        assert on["moved"] > 0 and off["moved"] == 0, name
        assert on["sequences_per_row"] == off["sequences_per_row"]  # TRL's packing is the same with balancing
    assert max(out[0]["packing", True]["sequences_per_row"]) > 1  # ... and on: rows of several sequences
    assert out[0]["padding_free", False]["sequences_per_row"] is None
