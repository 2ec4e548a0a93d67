"""hf_dp_balance: give every data-parallel rank the same real compute.

Public names are imported lazily so that `import hf_dp_balance` stays cheap
(the planner and cost model are pure numpy; torch / transformers load only
when a name that needs them is used).
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    # functional core
    "plan_balance": "planner",
    "plan_step": "planner",
    "Plan": "planner",
    "StepPlan": "planner",
    "CostModel": "cost",
    "fit_cost_model": "cost",
    "FitReport": "cost",
    "FitResult": "cost",
    "features_of": "cost",
    "PackedCollator": "samples",
    "sample_features": "samples",
    "split_packed": "samples",
    "register_varlen_attention": "attention",
    "plan_lookahead": "lookahead",
    # shell
    "BalancedLoader": "loader",
    "balance_vision_encoder": "vision",
    "DPBalanceCallback": "callback",
    # configuration
    "DPBalanceConfig": "config",
    "DPBalanceArguments": "arguments",
    "DPBalanceTrainingArguments": "arguments",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_dp_balance' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # cache: later look-ups skip __getattr__
    return value


def __dir__():
    return __all__
