"""The stock Trainer callback, keeping what a test asserts on: the loader it installed and every step's stats."""

from __future__ import annotations

from hf_dp_balance.integrations.callback import DPBalanceCallback


class StatsKeepingCallback(DPBalanceCallback):
    """`DPBalanceCallback` as users get it; `kept` is the loader it installed, `packed_input` that loader's
    reading of the user's rows, `stats` a copy of every step's stats (the callback pops them for its logs;
    `kept.pop_stats()` after training adds the steps it did not log)."""

    def _install_loader(self, train_dataloader, model, args):
        loader = super()._install_loader(train_dataloader, model, args)
        self.packed_input, self.stats, take = loader.packed_input, [], loader.pop_stats

        def pop_stats():
            out = take()
            self.stats.extend(out)
            return out

        loader.pop_stats = pop_stats
        self.kept = loader
        return loader
