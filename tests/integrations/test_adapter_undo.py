"""Whatever `DPBalancer` changes on the user's objects is put back by one owner, the session, at `close()`."""

import torch

from hf_dp_balance.testing.spawn import run_ranks


class _Samples(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.items = [{"input_ids": torch.arange(2, 6 + i % 5), "labels": torch.arange(2, 6 + i % 5)} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _users_collate(samples):
    return samples


def _balance_and_close(rank, world):
    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    plain = torch.utils.data.DataLoader(_Samples(16), batch_size=2, collate_fn=_users_collate)
    shard = acc.prepare_data_loader(torch.utils.data.DataLoader(_Samples(16), batch_size=2, collate_fn=_users_collate))
    shard_device = shard.device
    balancer = DPBalancer(acc, model=model, model_config=tiny_config("text"),
                          config=DPBalanceConfig(min_gain=0.0, timeout_s=30), cost_model=CostModel(quadratic=0.0, linear=1.0))
    while_open = {"backward": "backward" in vars(acc), "forward": "forward" in vars(model),
                  "registered": any(obj is balancer.session for obj in acc._custom_objects)}
    loaders = [balancer.prepare(plain), balancer.prepare(shard)]
    while_open["shard_collate_deferred"] = shard.base_dataloader.collate_fn is not _users_collate
    while_open["shard_on_cpu"] = shard.device is None
    trained = [sum(1 for _ in loader) for loader in loaders]
    balancer.close()
    after = {"backward": "backward" in vars(acc), "forward": "forward" in vars(model),
             "registered": any(obj is balancer.session for obj in acc._custom_objects),
             "plain_collate": plain.collate_fn is _users_collate,
             "shard_collate": shard.base_dataloader.collate_fn is _users_collate,
             "shard_device": shard.device == shard_device, "undo_left": len(balancer.session.patches)}
    return while_open, trained, after


def test_close_puts_back_every_patch_the_balancer_made():
    for while_open, trained, after in run_ranks(_balance_and_close, 2, timeout=120, pg_timeout_s=40):
        assert while_open == {"backward": True, "forward": True, "registered": True,
                              "shard_collate_deferred": True, "shard_on_cpu": True}
        assert trained == [4, 4]  # 16 samples, 2 per micro-batch, 2 ranks: 4 micro-batches each
        assert after == {"backward": False, "forward": False, "registered": False, "plain_collate": True,
                         "shard_collate": True, "shard_device": True, "undo_left": 0}
