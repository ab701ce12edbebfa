"""Multi-token prediction pieces that need no process group: step targets and their masks
(document boundaries of packed sequences), config rules. Parity of the MTP losses across
layouts and placements is in tests/test_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glm5_train.model.config import GLM5Config
from glm5_train.model.mtp import shifted_targets

EOD = 0


def test_step_targets_shift_labels_and_stop_at_the_sequence_end():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[6, 7, 8, 9, 10, 11]])  # labels[i] = token i + 1
    for step in (1, 2, 3):
        targets, mask = shifted_targets(labels, None, tokens, step, eod_token_id=None)
        n = 6 - step
        # Step k at position i predicts token i + k + 1 = labels[i + k].
        assert targets[0, :n].tolist() == labels[0, step:].tolist()
        assert mask[0].tolist() == [1.0] * n + [0.0] * step


def test_no_prediction_crosses_a_document_boundary():
    # Two packed documents: [5 6 7 EOD] [8 9 ...]; labels are the next tokens.
    tokens = torch.tensor([[5, 6, 7, EOD, 8, 9, 10, 11]])
    labels = torch.tensor([[6, 7, EOD, 8, 9, 10, 11, 12]])
    loss_mask = torch.ones(1, 8)
    # Position i counts for step k when i + k < 8 and no EOD lies in tokens[i .. i + k]: the
    # predicted token (labels[i + k]) is then in position i's document (EOD ends document 1).
    expected = {
        1: [1, 1, 0, 0, 1, 1, 1, 0],
        2: [1, 0, 0, 0, 1, 1, 0, 0],
        3: [0, 0, 0, 0, 1, 0, 0, 0],
    }
    for step, want in expected.items():
        _, mask = shifted_targets(labels, loss_mask, tokens, step, eod_token_id=EOD)
        assert mask[0].tolist() == [float(v) for v in want], (step, mask[0].tolist())


def test_step_masks_respect_the_loss_mask():
    tokens = torch.arange(1, 9)[None]
    labels = tokens + 1
    loss_mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.float32)
    _, mask = shifted_targets(labels, loss_mask, tokens, 2, eod_token_id=EOD)
    # Position i uses labels[i + 2], so it inherits loss_mask[i + 2].
    assert mask[0].tolist() == [1, 1, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("changes,message", [
    ({"mtp_num_steps": 3, "num_nextn_predict_layers": 0}, "needs an MTP layer"),
    ({"mtp_num_steps": 1, "num_nextn_predict_layers": 2}, "every MTP parameter set"),
    ({"mtp_num_steps": -1}, "must be >= 0"),
    ({"mtp_loss_weight": -0.1}, "mtp_loss_weight"),
])
def test_contradictory_mtp_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(GLM5Config(), **changes).validate()


def test_mtp_off_builds_no_mtp_sets():
    assert GLM5Config().mtp_sets == 1
    assert dataclasses.replace(GLM5Config(), mtp_num_steps=0).mtp_sets == 0


def test_launcher_refuses_a_layout_without_the_mtp_layer(capsys):
    """The error comes before any process starts, naming the value, the rule and the fix."""
    from launch.local import _main_or_error

    assert _main_or_error(["parallel=pp2_vpp2",
                           "parallel.pipeline_model_parallel_layout='Et|t|tt|L'"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pipeline_model_parallel_layout='Et|t|tt|L' has 0 'm'" in err
    assert "write 1 'm'" in err


def test_launcher_refuses_an_unknown_placement(capsys):
    from launch.local import _main_or_error

    assert _main_or_error(["parallel=pp2_vpp2", "parallel.mtp_placement=middle"]) == 2
    assert "parallel.mtp_placement='middle'" in capsys.readouterr().err
