"""Rollouts through vLLM (`use_vllm`), in `.venv-vllm` (`bash scripts/setup.sh vllm`): the engine decodes the
trainer's weights after every update (tied and untied embeddings, LoRA and full fine-tuning), the known-answer
bandit trained on its rollouts lands on its optimum, and an engine made to drift lands only with the correction.
Marked `vllm`: the README's test command runs them in their own pass; elsewhere they skip.

One engine per test process at a time (vLLM's CPU backend sizes its KV cache from the run: a few hundred MiB)."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("vllm")

from klppo.models import resolve_model_path  # noqa: E402
from klppo.testing.bandit import bandit_trainer, kl, one_token_state, tilted  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BETA = 0.5


def release(trainer):
    trainer.sampler.shutdown()
    del trainer.sampler.llm
    gc.collect()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_engine_decodes_the_trainers_weights_after_every_update(tmp_path, tied, lora):
    """After 3 updates (a sync before each rollout), the engine's processed log-probs of the tokens it sampled
    equal the trainer's forward at the same weights in float32 (a few 1e-6; the bound 1e-4), while the same tokens
    under the initial weights (the reference) are far off: the engine holds the updated weights, not the first."""
    name = "klppo:tiny-llama-vllm" + ("-tied" if tied else "")
    overrides = dict(response_length=4, max_steps=3, use_vllm=True, per_device_train_batch_size=16,
                     rollout_forward_batch_size=16, learning_rate=1e-2, stop_token="eos")  # fmt: skip
    if lora:
        from peft import LoraConfig

        overrides["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_config = overrides.pop("peft_config", None)
    trainer = bandit_trainer(resolve_model_path(name), tmp_path, **overrides)
    if peft_config is not None:  # rebuilt with the adapter: the bandit helper takes no peft_config
        from klppo import KLPPOTrainer

        trainer = KLPPOTrainer(model=resolve_model_path(name), args=trainer.args, train_dataset=trainer.train_dataset,
                               reward_funcs=trainer.reward_funcs, peft_config=peft_config)  # fmt: skip
    trainer.train()
    syncs = [h["time/weight_sync"] for h in trainer.state.log_history if "time/weight_sync" in h]
    assert len(syncs) == 3
    rollout = trainer.rollout(trainer.prompt_batch(["The day was"] * 16))
    keep = rollout.response_mask.bool()
    agree = float((rollout.logp - rollout.sampling_logp).abs()[keep].max())
    moved = float((rollout.ref_logp - rollout.sampling_logp).abs()[keep].max())
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
    release(trainer)


def test_a_tied_head_left_packed_from_the_old_embedding_is_caught(tmp_path, monkeypatch):
    """Negative control of the test above: on a CPU vLLM keeps a packed copy of a tied LM head, made from the
    embedding at load time; a sync that does not repack it leaves the engine's head at the first weights, and the
    engine's log-probs then miss the trainer's by far more than the bound."""
    from klppo.ppo.generation import vllm as engine_module

    original = engine_module._reload
    monkeypatch.setattr(engine_module, "_reload", lambda worker, weights, repack: original(worker, weights, False))
    trainer = bandit_trainer(resolve_model_path("klppo:tiny-llama-vllm-tied"), tmp_path, response_length=4,
                             max_steps=3, use_vllm=True, per_device_train_batch_size=16, rollout_forward_batch_size=16,
                             learning_rate=1e-2, stop_token="eos")  # fmt: skip
    trainer.train()
    rollout = trainer.rollout(trainer.prompt_batch(["The day was"] * 16))
    keep = rollout.response_mask.bool()
    assert float((rollout.logp - rollout.sampling_logp).abs()[keep].max()) > 1e-2
    release(trainer)


def one_token_bandit(tmp_path, **overrides):
    return bandit_trainer(resolve_model_path("klppo:tiny-llama-vllm"), tmp_path, kl_mode="reward", kl_estimator="k1",
                          use_vllm=True, **overrides)  # fmt: skip


@pytest.mark.numerics
def test_the_bandit_trained_on_vllm_rollouts_lands_on_the_optimum(tmp_path):
    """The one-token bandit (reward 1 for token ids divisible by 4, k1 in the reward) on vLLM's rollouts lands on
    pi* = ref exp(r / beta) / Z within the generate engine's bound (test_convergence: KL(pi || pi*) < 0.02)."""
    trainer = one_token_bandit(tmp_path)
    start = one_token_state(trainer)
    opt = tilted(start["ref"], start["reward"], BETA)
    assert kl(start["logp"], opt) > 0.1
    trainer.train()
    end = one_token_state(trainer)
    assert kl(end["logp"], tilted(end["ref"], end["reward"], BETA)) < 0.02
    release(trainer)


@pytest.mark.numerics
def test_a_drifting_vllm_engine_lands_only_with_the_correction(tmp_path, monkeypatch):
    """The engine made to sample at a temperature 20% above the trainer's: with the truncated importance-sampling
    correction the bandit lands within the bound; without it, it measurably misses."""
    from klppo.ppo.generation.vllm import VLLMEngine

    original = VLLMEngine.sampling_params

    def drifted(self, seed):
        params = original(self, seed)
        params.temperature = self.args.temperature * 1.2
        return params

    monkeypatch.setattr(VLLMEngine, "sampling_params", drifted)
    ends = {}
    for correction in (True, False):
        trainer = one_token_bandit(tmp_path / str(correction),
                                   experimental={"vllm_importance_sampling_correction": correction})
        trainer.train()
        end = one_token_state(trainer)
        ends[correction] = kl(end["logp"], tilted(end["ref"], end["reward"], BETA))
        assert all(h["sampling/logp_diff_max"] > 1e-3 for h in trainer.state.log_history if "sampling/logp_diff_max" in h)
        release(trainer)
    assert ends[True] < 0.02, ends
    assert ends[False] > 2 * ends[True] and ends[False] > 0.02, ends
