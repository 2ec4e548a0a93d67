import pytest

from hf_dp_balance.config import DPBalanceConfig


def test_env_values_parse_by_field_type():
    # Precedence (environment over explicit over TrainingArguments over defaults): test_callback.test_config_precedence
    cfg = DPBalanceConfig.from_env(environ={
        "HF_DP_BALANCE_VISION": "true", "HF_DP_BALANCE_WARMUP_STEPS": "7", "HF_DP_BALANCE_MAX_TOKEN_RATIO": "1.5",
        "HF_DP_BALANCE_MAX_TOKENS": "none", "HF_DP_BALANCE_SYNC": "micro_batch", "HF_DP_BALANCE_TIMING": "wall"})
    assert cfg.vision is True and cfg.warmup_steps == 7 and cfg.max_token_ratio == 1.5
    assert cfg.max_tokens is None and cfg.sync == "micro_batch" and cfg.timing == "wall"


def test_env_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="HF_DP_BALANCE_WARMUP_STEPS"):
        DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_WARMUP_STEPS": "many"})
    with pytest.raises(ValueError, match="HF_DP_BALANCE_VISION"):
        DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_VISION": "maybe"})


@pytest.mark.parametrize("kwargs,name", [
    ({"max_token_ratio": 0.9}, "max_token_ratio"), ({"sync": "ddp"}, "sync"),
    ({"min_gain": -0.1}, "min_gain"), ({"timeout_s": 0}, "timeout_s"), ({"max_tokens": 0}, "max_tokens"),
    ({"fit_mode": "median"}, "fit_mode"), ({"timing": "gpu"}, "timing"),
])
def test_invalid_settings_are_rejected_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DPBalanceConfig(**kwargs)
