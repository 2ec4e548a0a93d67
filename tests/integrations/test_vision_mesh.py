"""Under a device mesh only the data-parallel slice is balanced: the vision tower's group and the loss
contract both go by the data-parallel size, not the world's. Real gloo ranks."""

import logging
import os

import torch

from hf_dp_balance.testing.spawn import run_ranks

GA = 2


def _config(**kw):
    from hf_dp_balance.config import DPBalanceConfig

    return DPBalanceConfig(**{"min_gain": 0.0, "timeout_s": 60, "warmup_steps": 100, **kw})


# --------------------------------------------------------------------------- the vision group is the dp slice


def _user_wrapper_under_mesh(rank, world):
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.vision_rows import qwen_row

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh["dp"].get_local_rank()
    model = make_model("qwen2_vl", seed=0)
    # tp peers hold the same images (their data-parallel index's); dp index 1 holds four, index 0 one
    items = [("image", 1, 8, 8)] + [("image", 1, 4, 4)] * 3 if dp_index == 1 else [("image", 1, 4, 4)]
    batch = qwen_row("qwen2_vl", items, seed=dp_index)

    def train_forward():
        loss = model(**batch).loss
        loss.backward()
        return float(loss), model._dp_balance_vision.pop_stats()[-1]

    result = {}
    balance_vision_encoder(model, group=mesh["dp"])  # alone, told the slice: a group of its own over it
    result["alone"] = (dist.get_process_group_ranks(model._dp_balance_vision.group), *train_forward())
    mine = CostModel(quadratic=1.0, linear=1.0)
    balance_vision_encoder(model, cost_model=mine)  # not told: every process, as the user's wrapper before a balancer
    result["before"] = dist.get_process_group_ranks(model._dp_balance_vision.group)
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    with DPBalancer(acc, model=model, config=_config(vision=True), cost_model=CostModel(1.0, 5.0),
                    data_parallel_group=mesh["dp"]) as balancer:
        vision = model._dp_balance_vision
        result.update(ranks=dist.get_process_group_ranks(vision.group), owner=vision is balancer.session.vision,
                      kept_model=vision.cost_model == mine, taken=train_forward())
    result["left"] = hasattr(model, "_dp_balance_vision")
    return result


def test_a_users_vision_wrapper_is_taken_over_on_the_data_parallel_slice():
    out = run_ranks(_user_wrapper_under_mesh, 4, timeout=300, pg_timeout_s=90)
    # mesh [[0, 1], [2, 3]] as (dp, tp): the data-parallel slices are 0/2 and 1/3
    for rank, o in enumerate(out):
        slice_ranks = [rank % 2, rank % 2 + 2]
        assert o["alone"][0] == slice_ranks, o["alone"]  # given mesh["dp"]: a group of the slice
        assert o["before"] == [0, 1, 2, 3]  # not told the mesh: every process
        assert o["ranks"] == slice_ranks, o["ranks"]  # taken over by the balancer: its slice only
        assert o["owner"] and o["kept_model"] and not o["left"], o
        for loss, stats in (o["alone"][1:], o["taken"]):
            assert stats["applied"] and stats["items"] == 5, stats  # 1 + 4 images per slice, not 10 of the world
    for a, b in ((0, 1), (2, 3)):  # tp peers computed the same thing
        assert out[a]["alone"][1:] == out[b]["alone"][1:] and out[a]["taken"] == out[b]["taken"]


def _trainer_takes_over(rank, world, out_dir):
    """Trainer under a 2 (dp) x 2 (tp) mesh, the callback without `vision`, a model the user wrapped himself."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = balance_vision_encoder(make_model("qwen2_vl", seed=0))  # every process: it cannot know the mesh
    before = dist.get_process_group_ranks(model._dp_balance_vision.group)
    cb = DPBalanceCallback(_config(vision=False), cost_model=CostModel(1.0, 5.0), data_parallel_group=mesh["dp"])
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            vision = model._dp_balance_vision
            seen.append((dist.get_process_group_ranks(vision.group), vision is cb.session.vision,
                         [s["items"] for s in vision.pop_stats()]))

    data = [to_sample(r) for r in build_synthetic_dataset("qwen2_vl", 16, seed=1, scale=1 / 32)]
    args = TrainingArguments(output_dir=os.path.join(out_dir, "vlm"), use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=GA, max_steps=2, report_to=[], save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PackedCollator(model.config),
                      callbacks=[cb, Watch()])
    trainer.train()
    return {"before": before, "seen": seen, "left": hasattr(model, "_dp_balance_vision")}


def test_trainer_takes_a_users_vision_wrapper_over_on_the_data_parallel_slice(tmp_path):
    out = run_ranks(_trainer_takes_over, 4, str(tmp_path), timeout=400, pg_timeout_s=120)
    for rank, o in enumerate(out):
        assert o["before"] == [0, 1, 2, 3]
        assert len(o["seen"]) == 2 and not o["left"], o
        for ranks, owned, items in o["seen"]:
            assert ranks == [rank % 2, rank % 2 + 2] and owned, (ranks, owned)  # the session's, over the slice
            assert len(items) == GA and all(n > 0 for n in items), items  # it balanced every micro-batch
    for a, b in ((0, 1), (2, 3)):  # tp peers balanced the same images
        assert [s[2] for s in out[a]["seen"]] == [s[2] for s in out[b]["seen"]]


# --------------------------------------------------------------------------- the loss contract: the dp size


class _Plain(torch.nn.Module):
    """A model whose forward takes no num_items_in_batch: its loss is what the loop computes."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, labels):
        return self.inner(input_ids=input_ids, labels=labels)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _loss_contract_one_dp_rank(rank, world, out_dir):
    """A 1 (dp) x 2 (tp) mesh: two processes, one data-parallel rank, so no sample can move. A per-rank loss
    mean is then exact under Trainer and a loop's own loss needs no warning: counting the world's two
    processes would refuse / warn."""
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.runtime.logs import get_logger
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.runs import text_trainer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    lines = _Lines()
    get_logger("hf_dp_balance").addHandler(lines)
    out = {}
    cb = DPBalanceCallback(_config(), cost_model=CostModel(1.0, 5.0), data_parallel_group=mesh["dp"])
    trainer, _ = text_trainer(os.path.join(out_dir, "trainer"), max_steps=2, n=32, callback=cb,
                              gradient_accumulation_steps=GA, average_tokens_across_devices=False)
    try:
        trainer.train()
        out["trainer"] = ("trained", trainer.state.global_step)
    except ValueError as exc:
        out["trainer"] = ("refused", str(exc))
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    with DPBalancer(acc, model=_Plain(make_model("text", seed=0)), config=_config(), cost_model=CostModel(1.0, 5.0),
                    data_parallel_group=mesh["dp"]) as balancer:
        out["data_parallel"] = balancer.data_parallel.size
    out["warnings"] = [line for line in lines.lines if "num_items_in_batch" in line]
    return out


def test_the_loss_contract_counts_data_parallel_ranks_not_processes_under_both_front_ends(tmp_path):
    for o in run_ranks(_loss_contract_one_dp_rank, 2, str(tmp_path), timeout=300, pg_timeout_s=90):
        assert o["trainer"] == ("trained", 2), o["trainer"]  # the world's 2 processes would refuse it
        assert o["data_parallel"] == 1 and o["warnings"] == [], o  # the world's 2 would warn about the loop's loss
