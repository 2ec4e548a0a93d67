"""hf_dp_balance: give every data-parallel rank the same real compute.

Public names are imported lazily so that `import hf_dp_balance` stays cheap
(the planner and cost model are pure numpy; torch / transformers load only
when a name that needs them is used).
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    # functional core
    "plan_balance": "core.planner",
    "plan_step": "core.planner",
    "Plan": "core.planner",
    "StepPlan": "core.planner",
    "CostModel": "core.cost",
    "fit_cost_model": "core.fitting",
    "FitReport": "core.fitting",
    "FitResult": "core.fitting",
    "features_of": "core.cost",
    "PackedCollator": "core.packing",
    "sample_features": "core.packing",
    "split_packed": "core.unpacking",
    "register_varlen_attention": "runtime.attention",
    "plan_lookahead": "core.lookahead",
    # shell
    "BalancedLoader": "runtime.loader",
    "balance_vision_encoder": "runtime.vision",
    "DPBalanceCallback": "integrations.callback",
    "DPBalancer": "integrations.accelerate",
    # configuration
    "DPBalanceConfig": "config",
    "DPBalanceArguments": "integrations.arguments",
    "DPBalanceTrainingArguments": "integrations.arguments",
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
