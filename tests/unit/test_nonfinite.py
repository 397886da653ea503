"""A NaN/inf step never reaches the weights: stopped with the term and tensor named, or skipped."""

from __future__ import annotations

import pytest
import torch

from tether.models.hf import load_model
from tether.trainer.nonfinite import NonFiniteError, NonFiniteGuard
from tether.trainer.step import train_on_batch

from tests.unit.test_packing import mixed_batch, model_dir, settings  # noqa: F401  (model_dir is a fixture)

NAN_LOSS = '''
import torch

def nan_when_told(inp, params):
    scale = float("nan") if open(__file__ + ".flag").read() == "nan" else 1.0
    loss = -(inp.logprobs * inp.advantages * inp.weights()).sum() * scale
    return loss, {"pg_loss": float(loss.detach())}
'''


@pytest.fixture()
def nan_loss(tmp_path):
    path = tmp_path / "losses.py"
    path.write_text(NAN_LOSS)

    def set_flag(value: str) -> str:
        (tmp_path / "losses.py.flag").write_text(value)
        return f"{path}:nan_when_told"

    return set_flag


def setup(model_dir, lr=0.1):  # noqa: F811
    model = load_model(str(model_dir), "float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return model, optimizer, scheduler


def weights(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def test_a_nan_loss_stops_training_naming_the_rollout_term_and_tensor(model_dir, nan_loss):  # noqa: F811
    model, optimizer, scheduler = setup(model_dir)
    before = weights(model)
    with pytest.raises(NonFiniteError) as err:
        train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(policy_loss=nan_loss("nan")), 0, 1,
                       guard=NonFiniteGuard(0), what="rollout 3")
    text = str(err.value)
    assert text.startswith("rollout 3, optimizer step 1/1: non-finite step (loss terms: loss=nan, pg_loss=nan")
    assert "first non-finite tensor: the gradient of model.embed_tokens.weight" in text
    assert "nothing was saved or pushed" in text
    assert torch.equal(weights(model), before)


def test_bad_steps_are_skipped_up_to_the_limit_in_a_row(model_dir, nan_loss):  # noqa: F811
    model, optimizer, scheduler = setup(model_dir)
    guard, before = NonFiniteGuard(2), weights(model)
    for k in range(2):
        out = train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(policy_loss=nan_loss("nan")), 0, 1,
                             guard=guard, what=f"rollout {k}")
        assert out["train/skipped_steps"] == 1.0 and out["train/optimizer_steps"] == 0.0
        assert f"rollout {k}, optimizer step 1/1: non-finite step" in out["warnings"][0]
        assert f"the step was skipped ({k + 1} in a row" in out["warnings"][0]
    assert torch.equal(weights(model), before)
    good = train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(policy_loss=nan_loss("ok")), 0, 1,
                          guard=guard, what="rollout 2")
    assert "warnings" not in good and not torch.equal(weights(model), before) and guard.in_a_row == 0
    for k in (3, 4):
        train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(policy_loss=nan_loss("nan")), 0, 1,
                       guard=guard, what=f"rollout {k}")
    with pytest.raises(NonFiniteError, match="3 in a row, more than train.skip_nonfinite_steps=2"):
        train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(policy_loss=nan_loss("nan")), 0, 1,
                       guard=guard, what="rollout 5")


def test_weights_that_overflow_in_the_optimizer_are_caught(model_dir):  # noqa: F811
    model, optimizer, scheduler = setup(model_dir, lr=float("inf"))
    with pytest.raises(NonFiniteError, match="rollout 0: the weights became non-finite after the optimizer step"):
        train_on_batch(model, optimizer, scheduler, mixed_batch(), settings(), 0, 1, what="rollout 0")
