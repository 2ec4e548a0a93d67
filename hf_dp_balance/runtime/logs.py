"""The library's loggers live under transformers' root logger, so Trainer's verbosity (`log_level`) applies.

`get_logger(__name__)` gives `transformers.hf_dp_balance....`: its level follows
`transformers.utils.logging.set_verbosity_*` (what Trainer calls), and its records reach transformers'
handler. `set_verbose(True)` shows the library's INFO lines whatever transformers' verbosity is
(`--dp_balance_verbose`). Without transformers, plain `logging` loggers of the same name.
"""

from __future__ import annotations

import logging

_ROOT = "hf_dp_balance"


def _prefix() -> str:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger()  # configures transformers' root logger (its handler) once
        return "transformers."
    except ImportError:
        return ""


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (e.g. `hf_dp_balance.runtime.loader`) under transformers' root logger."""
    return logging.getLogger(_prefix() + name)


def set_verbose(enabled: bool) -> None:
    """INFO for the library's loggers (True), or their level from transformers' verbosity again (False)."""
    logging.getLogger(_prefix() + _ROOT).setLevel(logging.INFO if enabled else logging.NOTSET)


__all__ = ["get_logger", "set_verbose"]
