"""A custom Accelerate loop whose collator already packs, balanced by DPBalancer with the packed-input hook."""

import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks

GA = 2


def _train(acc, family, samples, balanced, hook, layout):
    """The synced gradient of every optimizer step (flat, float64) and the step stats."""
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.runtime.packed_input import PackedInput
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.packed_users import UserCollator

    model = make_model(family, seed=0, dtype=torch.float64)
    config = model.config
    user_collator = UserCollator(config, family, layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, enabled=balanced)
    grads, kinds = [], []
    # explicit: the user's own collator goes to PackedInput (prepare defers the loader's collate);
    # auto: prepare finds the user's collator itself (`DPBalanceConfig.input`, the Trainer callback's rule)
    explicit = {"packed_input": PackedInput(config, collate_fn=user_collator)} if hook == "explicit" else {}
    with DPBalancer(acc, model=model, config=cfg, cost_model=CostModel(quadratic=1.0, linear=5.0),
                    **explicit) as balancer:
        loader = balancer.prepare(torch.utils.data.DataLoader(samples, batch_size=3, collate_fn=user_collator))
        assert isinstance(balancer.session.loaders[0].packed_input, PackedInput)
        for batch in loader:
            kinds.append(sorted(k for k in batch if k.startswith(("cu_seq_lens", "max_length"))))
            with acc.accumulate(model):
                acc.backward(model(**batch).loss)
                if acc.sync_gradients:
                    grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
                optimizer.step()
                optimizer.zero_grad()
        moved = sum(s.moved_samples for s in balancer.step_stats)
    return torch.stack(grads).numpy(), moved, kinds


def _balanced_and_unbalanced(rank, world, family, hook, layout):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample

    torch.set_num_threads(1)
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=family != "text")])
    samples = [to_sample(r) for r in build_synthetic_dataset(family, 12 * world, seed=1, scale=1 / 32)]
    on, moved, kinds = _train(acc, family, samples, True, hook, layout)
    off, _, _ = _train(acc, family, samples, False, hook, layout)
    return {"on": on, "off": off, "moved": moved, "kinds": kinds}


@pytest.mark.parametrize("family,hook,layout", [("text", "auto", "flash"), ("qwen2_vl", "explicit", "flash"),
                                               ("text", "auto", "seq2seq_left")])
def test_a_packing_collator_in_the_accelerate_loop_gives_the_unbalanced_gradients(family, hook, layout):
    """Packed rows with cu_seq_lens, and transformers' DataCollatorForSeq2Seq's left-padded rows."""
    out = run_ranks(_balanced_and_unbalanced, 2, family, hook, layout, timeout=300, pg_timeout_s=60)
    on, off = torch.from_numpy(out[0]["on"]), torch.from_numpy(out[0]["off"])
    assert on.shape == off.shape and on.shape[0] == 2
    assert float(((on - off).norm(dim=1) / off.norm(dim=1)).max()) < 1e-5
    assert out[0]["moved"] > 0  # balancing moved samples, so the equality above could have failed
    flash = ["cu_seq_lens_k", "cu_seq_lens_q", "max_length_k", "max_length_q"] if layout == "flash" else []
    assert all(k == flash for r in out for k in r["kinds"])  # cu_seq_lens in, cu_seq_lens out
