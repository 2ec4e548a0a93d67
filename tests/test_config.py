import pytest

from hf_dp_balance.config import DPBalanceConfig


def test_env_values_parse_by_field_type():
    # Precedence (environment over explicit over TrainingArguments over defaults): test_callback.test_config_precedence
    cfg = DPBalanceConfig.from_env(environ={
        "HF_DP_BALANCE_VISION": "true", "HF_DP_BALANCE_WARMUP_STEPS": "7", "HF_DP_BALANCE_MAX_TOKEN_RATIO": "1.5",
        "HF_DP_BALANCE_MAX_TOKENS": "none", "HF_DP_BALANCE_SYNC": "micro_batch", "HF_DP_BALANCE_TIMING": "wall"})
    assert cfg.vision is True and cfg.warmup_steps == 7 and cfg.max_token_ratio == 1.5
    assert cfg.max_tokens is None and cfg.sync == "micro_batch" and cfg.timing == "wall"
    bounded = DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_MAX_PARTNERS": "32", "HF_DP_BALANCE_RANKS_PER_NODE": "8"})
    assert (bounded.max_partners, bounded.ranks_per_node) == (32, 8)
    assert (DPBalanceConfig().max_partners, DPBalanceConfig().ranks_per_node) == (64, 1)


def test_env_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="HF_DP_BALANCE_WARMUP_STEPS"):
        DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_WARMUP_STEPS": "many"})
    with pytest.raises(ValueError, match="HF_DP_BALANCE_VISION"):
        DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_VISION": "maybe"})


@pytest.mark.parametrize("kwargs,name", [
    ({"max_token_ratio": 0.9}, "max_token_ratio"), ({"sync": "ddp"}, "sync"),
    ({"min_gain": -0.1}, "min_gain"), ({"timeout_s": 0}, "timeout_s"), ({"max_tokens": 0}, "max_tokens"),
    ({"fit_mode": "median"}, "fit_mode"), ({"timing": "gpu"}, "timing"),
    ({"max_partners": -1}, "max_partners"), ({"max_partners": 4, "ranks_per_node": 8}, "max_partners"),
    ({"ranks_per_node": 0}, "ranks_per_node"),
    ({"heartbeat_s": 0}, "heartbeat_s"), ({"error_grace_s": -1}, "error_grace_s"), ({"on_fatal": "ignore"}, "on_fatal"),
])
def test_invalid_settings_are_rejected_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DPBalanceConfig(**kwargs)


def test_liveness_settings_are_fields_read_from_the_environment():
    cfg = DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_WATCHDOG": "off", "HF_DP_BALANCE_HEARTBEAT_S": "0.25",
                                            "HF_DP_BALANCE_ERROR_GRACE_S": "1.5", "HF_DP_BALANCE_ON_FATAL": "raise"})
    assert (cfg.watchdog, cfg.heartbeat_s, cfg.error_grace_s, cfg.on_fatal) == (False, 0.25, 1.5, "raise")
    default = DPBalanceConfig()
    assert (default.watchdog, default.heartbeat_s, default.error_grace_s, default.on_fatal) == (True, 1.0, 3.0, "exit")
