"""The library's log lines follow transformers' verbosity (what Trainer sets from `log_level`)."""

import logging

from transformers.utils import logging as hf_logging

from hf_dp_balance.runtime import loader, step_rows, vision, watchdog
from hf_dp_balance.runtime.logs import set_verbose


def test_runtime_loggers_follow_transformers_verbosity_and_verbose():
    before = hf_logging.get_verbosity()
    try:
        hf_logging.set_verbosity_warning()
        for module in (loader, step_rows, vision, watchdog):
            assert module.logger.name.startswith("transformers.hf_dp_balance.runtime.")
            assert not module.logger.isEnabledFor(logging.INFO)
        hf_logging.set_verbosity_info()  # Trainer(log_level="info")
        assert loader.logger.isEnabledFor(logging.INFO)
        hf_logging.set_verbosity_error()
        set_verbose(True)  # --dp_balance_verbose: INFO whatever transformers' verbosity
        assert loader.logger.isEnabledFor(logging.INFO) and not logging.getLogger("transformers").isEnabledFor(logging.INFO)
        set_verbose(False)
        assert not loader.logger.isEnabledFor(logging.INFO)
    finally:
        set_verbose(False)
        hf_logging.set_verbosity(before)
