"""val/loss is the cross-entropy alone, whatever the loss adds to it: z-loss, label smoothing's pull toward the
uniform target and a subclass's own term are each validated into a metric of their own (val/<name>), so val/loss
and val/ppl compare across runs; training still optimizes their sum."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from parallama.tokenizer import IGNORE_INDEX
from parallama.training.loss import CrossEntropy
from parallama.training.module import CausalLM


@dataclass
class WithLogitPenalty(CrossEntropy):
    """docs/customize.md's loss term, as a term of its own."""

    penalty: float = 1e-3

    def terms(self, logits, labels):
        labelled = labels.flatten() != IGNORE_INDEX
        per_token = logits.float().square().mean(-1).flatten()
        term = torch.where(labelled, per_token, 0).sum()
        return {**super().terms(logits, labels), "penalty": self.penalty * term}


def logged_validation(loss: dict | None):
    torch.manual_seed(0)
    model = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    module = CausalLM(model=model, optimizer={}, scheduler={}, loss=loss)
    module.configure_model()
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    logged = {}
    module.log = lambda name, value, **kwargs: logged.setdefault(name, float(value))
    with torch.no_grad():
        module.validation_step({"input_ids": ids, "labels": labels}, 0)
        module.on_validation_epoch_end()
        logits = module.model(ids)
    return module, logged, logits, labels


@pytest.mark.parametrize(
    "loss, extra",
    [
        (
            {"_target_": "parallama.training.loss.CrossEntropy", "z_loss": 1e-2, "label_smoothing": 0.1},
            {"z_loss", "label_smoothing"},
        ),
        ({"_target_": f"{__name__}.WithLogitPenalty", "z_loss": 1e-2}, {"z_loss", "penalty"}),
        (None, set()),
    ],
    ids=["z_loss-label_smoothing", "a-subclass-term", "plain"],
)
def test_val_loss_is_the_cross_entropy_and_each_term_has_its_own_name(loss, extra):
    module, logged, logits, labels = logged_validation(loss)
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
    assert set(logged) == {"val/loss", "val/ppl", *(f"val/{name}" for name in extra)}
    assert logged["val/loss"] == pytest.approx(cross_entropy, rel=1e-6)
    assert logged["val/ppl"] == pytest.approx(torch.tensor(cross_entropy).exp().item(), rel=1e-6)
    # the training loss is their sum
    total = module.loss_fn(logits, labels).item()
    assert total == pytest.approx(cross_entropy + sum(logged[f"val/{n}"] for n in extra), rel=1e-5)
    if "penalty" in extra:
        assert logged["val/penalty"] == pytest.approx(
            1e-3 * logits.square().mean(-1)[:, :-1].mean().item(), rel=1e-5
        )
