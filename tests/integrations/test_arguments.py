"""`dp_balance_*` TrainingArguments fields: command line, environment overrides, validation."""

import dataclasses
import typing

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_dp_balance.integrations.arguments import DPBalanceArguments, DPBalanceTrainingArguments, argument_name
from hf_dp_balance.config import FATAL_CHOICES, DPBalanceConfig
from hf_dp_balance.core.choices import FIT_MODES, SYNC_CHOICES, TIMING_CHOICES


def _parse(argv, tmp_path):
    parser = HfArgumentParser(DPBalanceTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "true", *argv])
    return args


def test_arguments_match_the_config_field_for_field():
    # Written out by hand (help texts), so this is what keeps the two from drifting: names, types, defaults.
    config_fields = dataclasses.fields(DPBalanceConfig)
    arg_fields = {f.name: f for f in dataclasses.fields(DPBalanceArguments)}
    assert list(arg_fields) == [argument_name(f.name) for f in config_fields]  # same fields, same order
    config_types, arg_types = typing.get_type_hints(DPBalanceConfig), typing.get_type_hints(DPBalanceArguments)
    for f in config_fields:
        name = argument_name(f.name)
        assert arg_types[name] == config_types[f.name], name
        assert arg_fields[name].default == f.default, name
        help_text = arg_fields[name].metadata["help"]
        assert f"HF_DP_BALANCE_{f.name.upper()}" in help_text
        assert len(help_text.split()) > 6, f"{name} lacks a real help text: {help_text!r}"
    assert DPBalanceArguments().to_dp_balance_config(environ={}) == DPBalanceConfig()
    for name, choices in (("sync", SYNC_CHOICES), ("fit_mode", FIT_MODES), ("timing", TIMING_CHOICES),
                          ("on_fatal", FATAL_CHOICES)):
        assert arg_fields[argument_name(name)].metadata["choices"] == list(choices)


def test_command_line_parses_into_training_arguments(tmp_path):
    args = _parse(["--dp_balance", "--dp_balance_vision", "true", "--dp_balance_warmup_steps", "8",
                   "--dp_balance_max_token_ratio", "1.5", "--dp_balance_max_tokens", "4096",
                   "--dp_balance_sync", "micro_batch", "--dp_balance_refit_every", "50",
                   "--dp_balance_cost_model_path", "/x/cost.json"], tmp_path)
    assert isinstance(args, TrainingArguments)
    cfg = args.to_dp_balance_config(environ={})
    assert cfg == DPBalanceConfig(enabled=True, vision=True, warmup_steps=8, max_token_ratio=1.5, max_tokens=4096,
                                  sync="micro_batch", refit_every=50, cost_model_path="/x/cost.json")
    # Trainer's own options still parse beside ours.
    assert args.use_cpu is True and args.output_dir == str(tmp_path)


def test_switch_is_on_unless_turned_off(tmp_path):
    # The default agrees with DPBalanceConfig.enabled: adding the callback is what asks for balancing.
    assert _parse([], tmp_path).to_dp_balance_config(environ={}) == DPBalanceConfig()
    for off in (["--dp_balance", "False"], ["--no_dp_balance"]):
        args = _parse(off, tmp_path)
        assert args.dp_balance is False
        assert args.to_dp_balance_config(environ={}) == DPBalanceConfig(enabled=False)


def test_bad_values_name_the_field(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="max_token_ratio"):
        _parse(["--dp_balance_max_token_ratio", "0.5"], tmp_path)
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        _parse(["--dp_balance_sync", "sometimes"], tmp_path)
    args = _parse([], tmp_path)
    monkeypatch.setenv("HF_DP_BALANCE_WARMUP_STEPS", "many")
    with pytest.raises(ValueError, match="HF_DP_BALANCE_WARMUP_STEPS"):
        args.to_dp_balance_config()


def test_arguments_alone_parse_next_to_other_dataclasses(tmp_path):
    parser = HfArgumentParser((TrainingArguments, DPBalanceArguments))
    training, balance = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--dp_balance", "--dp_balance_fit_mode", "step_max"])
    assert balance.to_dp_balance_config(environ={}).fit_mode == "step_max"
    assert not hasattr(training, "dp_balance")


def test_liveness_settings_parse_from_the_command_line(tmp_path):
    args = _parse(["--dp_balance_watchdog", "false", "--dp_balance_heartbeat_s", "0.5",
                   "--dp_balance_error_grace_s", "2", "--dp_balance_on_fatal", "raise"], tmp_path)
    cfg = args.to_dp_balance_config(environ={})
    assert cfg == DPBalanceConfig(watchdog=False, heartbeat_s=0.5, error_grace_s=2.0, on_fatal="raise")
    with pytest.raises(SystemExit):
        _parse(["--dp_balance_on_fatal", "ignore"], tmp_path)
