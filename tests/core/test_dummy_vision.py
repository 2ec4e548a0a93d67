"""The dummy visual segment of PackedCollator, on real tiny models of every VLM family (float64).

A row without images gets it; the real samples' logits, loss and gradients are those of the row without it
(1e-6 relative), the target count (Trainer's num_items_in_batch) is unchanged, and every vision-tower
parameter gets a gradient tensor, all zeros.
"""

import pytest
import torch

from hf_dp_balance.core.dummy_vision import dummy_vision_sample
from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.core.packing import PackedCollator, family_of
from hf_dp_balance.testing.data import make_samples
from hf_dp_balance.testing.models import make_model

torch.set_num_threads(1)

VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")


def _vision_params(model):
    return {n: p for n, p in model.named_parameters() if "visual" in n or "vision" in n or "multi_modal" in n}


@pytest.fixture(scope="module")
def setup():
    cache = {}

    def get(family):
        if family not in cache:
            model = make_model(family, seed=0, dtype=torch.float64)
            samples = make_samples(family, ("text", "image", "text"), seed=3)
            samples = [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples]
            cache[family] = model, samples
        return cache[family]

    return get


def _run(model, batch):
    """(summed loss, real tokens' logits, grads by name) of one forward/backward of `batch`."""
    model.zero_grad()
    targets = int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
    out = model(**batch, num_items_in_batch=torch.tensor(targets))
    (out.loss * targets).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return (out.loss * targets).detach(), out.logits.detach(), grads


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_text_only_row_gets_the_dummy_and_trains_exactly_as_without_it(family, setup):
    model, samples = setup(family)
    text_only = [samples[0], samples[2]]
    with_dummy = PackedCollator(model.config)(text_only)
    plain = PackedCollator(model.config, dummy_vision=False)(text_only)
    dummy = dummy_vision_sample(model.config, family_of(model.config))
    n_real, n_dummy = plain["input_ids"].shape[1], dummy["input_ids"].numel()

    assert "pixel_values" not in plain and "pixel_values" in with_dummy
    assert with_dummy["input_ids"].shape[1] == n_real + n_dummy
    assert (with_dummy["labels"][0, n_real:] == IGNORE_INDEX).all()
    positions = with_dummy["position_ids"][0, 0] if family != "internvl" else with_dummy["position_ids"][0]
    assert positions[n_real] == 0  # its own segment: the packed mask keeps it apart
    for key in plain:  # the real part of the row is untouched
        assert torch.equal(with_dummy[key][..., :n_real], plain[key]), key
    # the target count Trainer turns into num_items_in_batch
    assert int((with_dummy["labels"][..., 1:] != -100).sum()) == int((plain["labels"][..., 1:] != -100).sum())

    loss_d, logits_d, grads_d = _run(model, with_dummy)
    loss_p, logits_p, grads_p = _run(model, plain)
    assert loss_d.item() == pytest.approx(loss_p.item(), rel=1e-6)
    torch.testing.assert_close(logits_d[:, :n_real], logits_p, rtol=1e-6, atol=1e-12)
    vision = _vision_params(model)
    assert vision and not set(vision) & set(grads_p)  # without the dummy the tower gets no gradient at all
    assert set(grads_d) == {n for n, _ in model.named_parameters()}  # with it: every parameter has one
    for name, grad in grads_d.items():
        if name in vision:
            assert torch.count_nonzero(grad) == 0, name
        else:
            torch.testing.assert_close(grad, grads_p[name], rtol=1e-6, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_row_with_an_image_gets_no_dummy(family, setup):
    model, samples = setup(family)
    batch = PackedCollator(model.config)(samples)
    plain = PackedCollator(model.config, dummy_vision=False)(samples)
    assert batch.keys() == plain.keys() and all(torch.equal(batch[k], plain[k]) for k in batch)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_dummy_encoded_beside_a_real_image_leaves_its_embeddings_unchanged(family, setup):
    """Vision balancing may send a rank's dummy to a rank with real images: one tower call encodes both.
    Qwen's vision attention is per image (cu_seqlens from the grids), InternVL encodes each tile alone."""
    model, samples = setup(family)
    image, dummy = samples[1], dummy_vision_sample(model.config, family)
    inner = model.model
    with torch.no_grad():
        if family == "internvl":
            alone = inner.get_image_features(image["pixel_values"])
            both = inner.get_image_features(torch.cat([image["pixel_values"], dummy["pixel_values"].double()]))
            alone, both = alone.pooler_output, both.pooler_output
        else:
            alone = inner.get_image_features(image["pixel_values"], image["image_grid_thw"]).pooler_output
            both = inner.get_image_features(torch.cat([image["pixel_values"], dummy["pixel_values"].double()]),
                                            torch.cat([image["image_grid_thw"], dummy["image_grid_thw"]])).pooler_output
    alone = torch.cat(list(alone)) if isinstance(alone, (list, tuple)) else alone
    both = torch.cat(list(both)) if isinstance(both, (list, tuple)) else both
    assert both.shape[0] > alone.shape[0]
    torch.testing.assert_close(both[: alone.shape[0]], alone, rtol=1e-12, atol=1e-12)


def test_text_models_get_no_dummy():
    model = make_model("text", seed=0)
    samples = make_samples("text", ("text",), seed=0)
    assert dummy_vision_sample(model.config, "text") is None
    assert PackedCollator(model.config)(samples)["input_ids"].shape[1] == samples[0]["input_ids"].numel()
