"""The loss normalisation each front end declares, and what balancing does with it (no processes)."""

import pytest

from hf_dp_balance.integrations.loss_contract import (GLOBAL_TOKEN_MEAN, LOOP_DEFINED, PER_RANK_MEAN,
                                                      loop_normalisation, trainer_normalisation, verdict)


def test_trainer_is_a_global_token_mean_only_with_average_tokens_and_loss_kwargs():
    assert trainer_normalisation(True, True, False).kind == GLOBAL_TOKEN_MEAN
    assert trainer_normalisation(True, False, True).kind == GLOBAL_TOKEN_MEAN  # compute_loss_func gets the count
    assert trainer_normalisation(False, True, False).kind == PER_RANK_MEAN
    assert trainer_normalisation(True, False, False).kind == PER_RANK_MEAN


def test_a_per_rank_mean_is_refused_naming_the_setting_unless_opted_in():
    norm = trainer_normalisation(False, True, False)
    with pytest.raises(ValueError, match=r"average_tokens_across_devices=False.*allow_per_rank_loss_mean"):
        verdict(norm, 2, allow_per_rank=False)
    assert "differs from the unbalanced run" in verdict(norm, 2, allow_per_rank=True)
    assert verdict(norm, 1, allow_per_rank=False) is None  # one rank: nothing moves
    assert verdict(trainer_normalisation(True, True, False), 8, allow_per_rank=False) is None


def test_a_loop_whose_model_takes_num_items_in_batch_is_exact_else_it_is_told_what_to_divide_by():
    from hf_dp_balance.testing.models import make_model

    assert loop_normalisation(make_model("text").forward).kind == GLOBAL_TOKEN_MEAN
    plain = loop_normalisation(lambda input_ids, labels: None)
    assert plain.kind == LOOP_DEFINED
    assert "batch['num_items_in_batch']" in verdict(plain, 2, allow_per_rank=False)
