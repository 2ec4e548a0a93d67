"""Under FSDP the forward spans of the sharded units are each rank's own compute, without the all-gather waits.

Real FSDP2 (`fully_shard` per decoder layer, then the root) and FSDP1 (`FullyShardedDataParallel`, the decoder
layer class as its wrap policy) on 2 gloo processes with a tiny random-weight Qwen2:
rank 1's input is 16x rank 0's, so rank 0 waits for rank 1 at every layer's all-gather. On rank 0 the recorder's
`unit_events` spans (`timed_parts`: the layers, and the root's embeddings, final norm, rotary and lm_head) stay
close to its own compute (the thread CPU time of the same forward without FSDP) and far below its wall-clock
forward; a span around
the whole model (`forward_events`, the DDP timing) is not, so the test tells the two apart. The hooks are gone
after `remove`, and `timing="auto"` picks `unit_events` for this model on an accelerator with micro-batch sync.
"""

import pytest

from hf_dp_balance.testing.spawn import run_ranks

SHORT, LONG = 128, 2048  # tokens of rank 0 and rank 1
STEPS = 5


def _hook_counts(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _sharded_decoder(rank, world, flavour="fsdp2"):
    """(sharded model, the same model unsharded, this rank's batch); `flavour` fsdp2 (`fully_shard` per layer,
    then the root) or fsdp1 (`FullyShardedDataParallel` with a wrap policy on the decoder layer class)."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from hf_dp_balance.testing.models import make_model

    model = make_model("text", seed=0, text_config=dict(num_hidden_layers=4, hidden_size=128, intermediate_size=384,
                                                        num_attention_heads=4, num_key_value_heads=2))
    plain = copy.deepcopy(model)  # the same model without FSDP: this rank's own compute
    if flavour == "fsdp1":
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                                         device_id=torch.device("cpu"), use_orig_params=True)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    tokens = SHORT if rank == 0 else LONG
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 500, (1, tokens), generator=gen)
    return model, plain, {"input_ids": ids, "labels": ids.clone()}


def _spans_under_fsdp(rank, world, flavour="fsdp2"):
    import time

    from hf_dp_balance.runtime.fitter import resolve_timing
    from hf_dp_balance.runtime.recorder import StepClock, StepRecorder

    model, plain, batch = _sharded_decoder(rank, world, flavour)
    own = []
    for _ in range(STEPS):  # thread CPU time of the forward without FSDP (no collective, no hook)
        cpu = time.thread_time()
        plain(**batch)
        own.append(time.thread_time() - cpu)
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")
             for n, m in model.named_modules()}
    before = _hook_counts(model)
    out = {"auto": resolve_timing("auto", "cuda", "micro_batch", model),
           "auto_ddp": resolve_timing("auto", "cuda", "step", model)}
    rows = []
    for timing in ("unit_events", "forward_events"):
        recorder = StepRecorder(StepClock(timing, "cpu"), micro_batches=False)
        recorder.install(model)
        if timing == "unit_events":
            out["parts"] = [names[id(m)] for m in recorder.parts]
            out["installed"] = _hook_counts(model) - before
        for _ in range(STEPS):
            recorder.begin()
            wall, cpu = time.perf_counter(), time.thread_time()
            loss = model(**batch).loss
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            loss.backward()  # the backward's all-gathers run no forward hook: nothing is counted there
            rows.append({"timing": timing, "span": recorder.end() / 3.0, "wall": wall, "cpu": cpu})
            model.zero_grad()
        recorder.remove()
    out["left"] = _hook_counts(model) - before
    out["own"] = min(own)
    out["rows"] = rows
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", ["fsdp2", "fsdp1"])
def test_unit_spans_exclude_the_all_gather_waits_of_fsdp(flavour):
    results = run_ranks(_spans_under_fsdp, 2, flavour, timeout=200)
    fast, slow = results
    assert fast["auto"] == "unit_events" and fast["auto_ddp"] == "forward_events"
    assert fast["parts"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                             "model.layers.3", "model.norm", "model.rotary_emb", "lm_head"]
    assert fast["installed"] > 0 and fast["left"] == 0 and slow["left"] == 0  # every hook removed

    def stat(result, timing, key):  # the least preempted of the steps (2 cores shared with other work)
        return min(r[key] for r in result["rows"] if r["timing"] == timing)

    span, wall, cpu = (stat(fast, "unit_events", k) for k in ("span", "wall", "cpu"))
    own = fast["own"]
    detail = (f"rank 0: unit spans {span:.4f} s, forward wall {wall:.4f} s, forward thread CPU {cpu:.4f} s, "
              f"thread CPU without FSDP {own:.4f} s")
    assert wall > 3.0 * cpu, detail  # the setup: rank 0's forward waits for rank 1 at every layer
    assert span < 0.4 * wall, detail  # the spans exclude those waits ...
    assert 0.6 * own <= span <= 3.0 * own, detail  # ... and cover rank 0's own compute
    whole = stat(fast, "forward_events", "span")
    assert whole > 0.8 * stat(fast, "forward_events", "wall"), f"a span around the model holds the waits: {whole:.4f}"
    # The spans see the ranks' real difference in compute (16x the tokens on rank 1).
    assert stat(slow, "unit_events", "span") > 4.0 * span, (detail, stat(slow, "unit_events", "span"))


def test_unit_events_refuses_a_model_without_fsdp_units():
    from hf_dp_balance.runtime.fitter import resolve_timing
    from hf_dp_balance.runtime.recorder import StepClock, StepRecorder, sharded_units
    from hf_dp_balance.testing.models import make_model

    model = make_model("text", seed=0)
    assert sharded_units(model) == []
    assert resolve_timing("auto", "cuda", "micro_batch", model) == "wall"  # ZeRO-3 / not sharded: step times
    assert resolve_timing("auto", "cuda", "micro_batch") == "wall"
    recorder = StepRecorder(StepClock("unit_events", "cpu"))
    with pytest.raises(ValueError, match="unit_events"):
        recorder.install(model)
    assert _hook_counts(model) == 0


def _vision_parts_under_fsdp(rank, world):
    """A tiny Qwen2-VL sharded per vision block, the tower, per decoder layer and the root: the parts and
    the tower's share of one step's spans."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.runtime.fitter import CostModelFitter
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.recorder import StepClock, StepRecorder
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import make_model

    model = make_model("qwen2_vl", seed=0)
    batch = PackedCollator(model.config)(make_samples("qwen2_vl", ("image", "text"), seed=5))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.visual.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.model.visual, mesh=mesh)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = {id(m): n for n, m in model.named_modules()}
    recorder = StepRecorder(StepClock("unit_events", "cpu"), micro_batches=False)
    recorder.install(model)
    fitter = CostModelFitter(DPBalanceConfig(warmup_steps=10**6), rank=rank, world=world, timing="unit_events",
                             sync="micro_batch")
    parts = [names[id(m)] for m in recorder.parts]
    recorder.begin()
    model(**batch).loss.backward()
    elapsed = recorder.end()
    fitter.record(recorder.lengths, elapsed, recorder.patches, recorder.vision_s)
    recorder.remove()
    return {"parts": parts, "parts_left": len(recorder.parts), "elapsed": elapsed, "vision_s": recorder.vision_s,
            "patches": list(recorder.patches), "fit_mode": fitter.fit_mode,
            "micro": fitter.fits_micro_batches, "decoder_s": fitter.records[-1].decoder_s}


@pytest.mark.timeout(240)
def test_unit_spans_attribute_the_sharded_vision_tower():
    got = run_ranks(_vision_parts_under_fsdp, 2, timeout=200)[0]
    visual = [p for p in got["parts"] if p.startswith("model.visual")]
    assert visual[0] == "model.visual.patch_embed" and "model.visual.blocks.0" in visual
    assert "model.visual.merger" in visual and "model.language_model.layers.0" in got["parts"]
    assert "model.visual" not in got["parts"] and "model" not in got["parts"]  # no unit that holds units
    assert got["parts_left"] == 0  # remove() forgets them
    assert got["patches"] and 0.0 < got["vision_s"] < got["elapsed"]
    assert abs(got["decoder_s"] - (got["elapsed"] - got["vision_s"])) < 1e-12
    assert got["fit_mode"] == "per_rank" and not got["micro"]  # each rank's own compute: the per-rank fit


def test_unit_events_is_a_setting_the_per_rank_fit_follows():
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.fitter import CostModelFitter, resolve_timing

    config = DPBalanceConfig.from_env(environ={"HF_DP_BALANCE_TIMING": "unit_events"})
    assert config.timing == "unit_events"
    fitter = CostModelFitter(config, timing=resolve_timing(config.timing, "cuda", "micro_batch"), sync="micro_batch")
    assert fitter.timing == "unit_events" and fitter.fit_mode == "per_rank" and not fitter.fits_micro_batches
    assert fitter.warmup_steps == 5  # every rank's compute is seen: the per-rank warm-up
    assert resolve_timing("auto", "cpu", "micro_batch") == "thread_cpu"  # on CPU the thread clock stays


def test_only_unit_events_fits_with_the_prior_as_a_distribution():
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.fitter import CostModelFitter

    config = DPBalanceConfig()
    assert CostModelFitter(config, timing="unit_events").shape_prior
    assert not CostModelFitter(config, timing="forward_events").shape_prior  # DDP keeps its measured fit
    assert not CostModelFitter(config, timing="thread_cpu").shape_prior
    assert not CostModelFitter(config.replace(fit_mode="step_max"), timing="unit_events").shape_prior


def test_the_fitter_fits_unit_events_with_the_prior_as_a_distribution():
    """CostModelFitter under unit_events lands on `fit_ranks(..., shape_prior=True)`'s model, bit for bit, and
    not on the penalty-row fit's."""
    import numpy as np

    from hf_dp_balance.testing.mix import draw_mix, pack_fixed_length, truncate
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel, features_of
    from hf_dp_balance.runtime.fitter import CostModelFitter, fit_ranks

    rng = np.random.default_rng(3)
    lengths = truncate(draw_mix("text-sft", 2000, rng), 4096).tokens
    lengths = lengths[lengths > 0]
    pack = pack_fixed_length(lengths, 4096)
    packs = [lengths[pack == k].tolist() for k in range(10)]
    truth = CostModel(2e-9, 1e-4, 1e-3, 0.0)
    times = [truth.step_cost(p) * f for p, f in zip(packs, rng.lognormal(0.0, 0.03, len(packs)))]
    prior = CostModel(4e-9, 1e-4, 0.0, 0.0)
    fitter = CostModelFitter(DPBalanceConfig(warmup_steps=len(packs), refit_every=0), timing="unit_events",
                             prior=prior)
    for step, (p, t) in enumerate(zip(packs, times), start=1):
        fitter.end_step(step, p, t)
    feats = np.stack([features_of(p) for p in packs])[:, None, :]
    secs = np.asarray(times)[:, None]
    shaped = fit_ranks(feats, secs, "per_rank", prior, estimate_speeds=True, shape_prior=True)[0].model
    penalty = fit_ranks(feats, secs, "per_rank", prior, estimate_speeds=True)[0].model
    # the fit the fitter made (whether its gate adopted it over the prior or kept the prior: attention is a few
    # percent of these packs, so 9 held-out steps barely tell the two apart)
    fitted = CostModel.from_dict(fitter.fit_reports[-1]["fitted"]["decoder"])
    assert np.array_equal(fitted.coefficients, shaped.coefficients)
    assert fitter.decoder is None or np.array_equal(fitter.decoder.coefficients, shaped.coefficients)
    assert not np.array_equal(shaped.coefficients, penalty.coefficients)
