"""Turn balancing on from the command line: `dp_balance_*` fields for `TrainingArguments`.

`DPBalanceArguments` is a dataclass whose fields mirror `DPBalanceConfig`
one for one (generated from it, so the two never drift): `enabled` becomes
`dp_balance`, every other field `<name>` becomes `dp_balance_<name>`, with the
config field's docstring as `--help` text. `DPBalanceTrainingArguments`
inherits from both `TrainingArguments` and `DPBalanceArguments`, so one
`HfArgumentParser(DPBalanceTrainingArguments)` gives `--dp_balance`,
`--dp_balance_warmup_steps 8`, ... next to Trainer's own options.

`to_dp_balance_config()` builds the `DPBalanceConfig`, with every
`HF_DP_BALANCE_<FIELD>` environment variable applied on top (they reach every
rank through `torchrun` / `accelerate launch`, whose config files reject
unknown keys).

The command-line switch `dp_balance` defaults to False (it is an option the
user turns on); everything else defaults to the `DPBalanceConfig` default.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Dict, Mapping, Optional

from transformers import TrainingArguments

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.choices import FIT_MODES, SYNC_CHOICES, TIMING_CHOICES

ARG_PREFIX = "dp_balance"

# Fields whose command-line default differs from the config default, and why:
# `enabled` is an opt-in switch on the command line (`--dp_balance`).
_CLI_DEFAULTS = {"enabled": False}
_CHOICES = {"sync": SYNC_CHOICES, "fit_mode": FIT_MODES, "timing": TIMING_CHOICES}


def argument_name(config_field: str) -> str:
    """`enabled` -> `dp_balance`; any other config field `x` -> `dp_balance_x`."""
    return ARG_PREFIX if config_field == "enabled" else f"{ARG_PREFIX}_{config_field}"


@functools.lru_cache(maxsize=1)
def _field_docs() -> Dict[str, str]:
    """Attribute docstrings of DPBalanceConfig (the string literal under each field), read from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(DPBalanceConfig))
    except (OSError, TypeError):  # source not shipped: help falls back to the field name
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _build_arguments_class():
    hints = typing.get_type_hints(DPBalanceConfig)
    docs = _field_docs()
    specs = []
    for f in dataclasses.fields(DPBalanceConfig):
        default = _CLI_DEFAULTS.get(f.name, f.default)
        env = f"HF_DP_BALANCE_{f.name.upper()}"
        help_text = f"{docs.get(f.name, f.name)} (config field `{f.name}`; environment {env} overrides)"
        metadata = {"help": help_text}
        if f.name in _CHOICES:
            metadata["choices"] = list(_CHOICES[f.name])
        specs.append((argument_name(f.name), hints[f.name], dataclasses.field(default=default, metadata=metadata)))
    namespace = {
        "__doc__": "Data-parallel compute balancing options (`--dp_balance ...`); mirrors `DPBalanceConfig`.",
        "__module__": __name__,
        "to_dp_balance_config": _to_dp_balance_config,
        "__post_init__": _validate,
    }
    return dataclasses.make_dataclass("DPBalanceArguments", specs, namespace=namespace)


def config_from_arguments(args, environ: Optional[Mapping[str, str]] = None) -> DPBalanceConfig:
    """`DPBalanceConfig` from any object carrying `dp_balance_*` attributes, environment applied on top.

    Missing attributes keep the config default; an invalid value raises `ValueError`
    naming the field (from `DPBalanceConfig`'s own checks).
    """
    values = {}
    for f in dataclasses.fields(DPBalanceConfig):
        name = argument_name(f.name)
        if hasattr(args, name):
            values[f.name] = getattr(args, name)
    try:
        base = DPBalanceConfig(**values)
    except ValueError as exc:
        raise ValueError(f"invalid --dp_balance arguments: {exc}") from None
    return DPBalanceConfig.from_env(base, environ)


def _to_dp_balance_config(self, environ: Optional[Mapping[str, str]] = None) -> DPBalanceConfig:
    """The `DPBalanceConfig` these arguments describe, `HF_DP_BALANCE_*` environment variables applied on top."""
    return config_from_arguments(self, environ)


def _validate(self) -> None:
    # Fail at parse time, not at the first training step.
    config_from_arguments(self, environ={})


DPBalanceArguments = _build_arguments_class()


@dataclasses.dataclass
class DPBalanceTrainingArguments(TrainingArguments, DPBalanceArguments):
    """`TrainingArguments` plus the `dp_balance_*` options; use with `HfArgumentParser` and `DPBalanceCallback`."""

    def __post_init__(self):
        TrainingArguments.__post_init__(self)
        DPBalanceArguments.__post_init__(self)


__all__ = ["DPBalanceArguments", "DPBalanceTrainingArguments", "argument_name", "config_from_arguments"]
