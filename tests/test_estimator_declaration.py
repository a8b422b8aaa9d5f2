"""An estimator is declared in one place, its `register_kl_estimator` call: an estimator defined in this file alone,
with what its gradient follows (`KLGradient`), is read by `divergence_followed` and `kl_optimum_of`, and a bandit
trained with it lands on the optimum it declares."""

from __future__ import annotations

import pytest
import torch

from klppo.kl import KLGradient, divergence_followed, kl_estimators, register_kl_estimator, unregister_kl_estimator
from klppo.kl.estimator_registry import REVERSE_KL
from klppo.kl.optimum import REVERSE, KLOptimum, kl_optimum_of

BETA = 0.5


@pytest.fixture
def twice_k2():
    """`d ** 2`, twice `k2`: in the loss its expected gradient is twice the per-token reverse KL's, so at coefficient
    beta it trains toward the tilt at 2 beta, `ref * exp(r / (2 beta)) / Z`. Only the loss is declared."""

    @register_kl_estimator(
        "twice_k2",
        formula="d^2",
        loss=KLGradient(
            REVERSE_KL,
            True,
            "{name} as a loss: gradient 2 d * s, twice the per-token gradient of KL(pi||ref).",
            terms={"path": 2.0},
        ),
        off_policy_loss=KLGradient("neither KL direction", False, "{name} off-policy has no importance weight."),
    )
    def kl_twice_k2(log_ratio, old_log_ratio=None, log_ratio_clamp=40.0):
        d = log_ratio if log_ratio_clamp is None else log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        return d.square()

    yield "twice_k2"
    unregister_kl_estimator("twice_k2")
    assert "twice_k2" not in kl_estimators() and "twice_k2+" not in kl_estimators()


def test_the_declaration_is_what_divergence_and_optimum_read(twice_k2):
    info = divergence_followed(twice_k2, "loss")
    assert (info.divergence, info.unbiased) == (REVERSE_KL, True) and info.message.startswith("twice_k2 as a loss")
    assert not divergence_followed(twice_k2, "loss", off_policy=True).unbiased
    assert divergence_followed(twice_k2, "reward").divergence.startswith("unknown")  # not declared
    assert kl_optimum_of("loss", twice_k2) == KLOptimum(REVERSE, 2.0, per_token=True)
    assert kl_optimum_of("loss", twice_k2, 3.0) == KLOptimum(REVERSE, 6.0, per_token=True)
    assert kl_optimum_of("reward", twice_k2) is None and kl_optimum_of("both", twice_k2) is None
    # its twin: the value of `twice_k2`, the gradient of k2 (the tilt at beta in the loss), the reward as declared
    assert kl_optimum_of("loss", twice_k2 + "+") == KLOptimum(REVERSE, 1.0, per_token=True)
    assert divergence_followed(twice_k2 + "+", "reward").divergence.startswith("unknown")
    with pytest.raises(ValueError, match="terms are seq, path, fpath"):
        KLGradient(REVERSE_KL, True, "", terms={"sequence": 1.0})
    with pytest.raises(TypeError, match="KLGradient"):
        register_kl_estimator("bad", formula="d", loss={"path": 1.0})


@pytest.mark.slow
@pytest.mark.numerics
def test_a_bandit_trained_with_it_lands_on_the_optimum_it_declares(twice_k2, tmp_path):
    """`twice_k2` in the loss at beta = 0.5: the trained policy lands on the tilt at 2 beta (the optimum its
    declaration gives), measured exactly from its logits, and away from the tilt at beta (what `k2` would train
    toward)."""
    from klppo.models import TINY_MODEL, resolve_model_path
    from klppo.testing.bandit import bandit_trainer, kl, one_token_state, tilted

    trainer = bandit_trainer(
        resolve_model_path(TINY_MODEL),
        tmp_path,
        kl_mode="loss",
        kl_estimator=twice_k2,
        kl_coef=BETA,
        max_steps=60,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
    )
    start = one_token_state(trainer)
    declared = kl_optimum_of("loss", twice_k2).exact(start["ref"], start["reward"], BETA)
    assert torch.allclose(declared, tilted(start["ref"], start["reward"], 2 * BETA), atol=1e-12)
    other = tilted(start["ref"], start["reward"], BETA)
    assert kl(declared, other) > 0.1  # the two candidates differ
    trainer.train()
    end = one_token_state(trainer)
    # measured on seed 0: 0.108 from the declared optimum at the start, 0.010 at the end, 0.150 from the other;
    # seed 1 holds the same bounds
    assert kl(end["logp"], declared) < 0.25 * kl(start["logp"], declared)
    assert kl(end["logp"], declared) < 0.25 * kl(end["logp"], other)
