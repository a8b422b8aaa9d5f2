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
# the weight-sync tests: 3 updates at a high learning rate, so that the weights move far from the reference's
SYNC_SETTINGS = dict(
    response_length=4,
    use_vllm=True,
    per_device_train_batch_size=16,
    rollout_forward_batch_size=16,
    learning_rate=1e-2,
    stop_token="eos",
)


def release(trainer):
    """The engine freed and accelerate's state reset: the next test's trainer starts as in a fresh process."""
    from accelerate.state import AcceleratorState

    trainer.sampler.shutdown()
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()


def vllm_trainer(name: str, tmp_path, peft_config=None, **overrides):
    """`bandit_trainer`'s setup on a tiny vLLM-compatible model, with a LoRA adapter when `peft_config` is given."""
    from klppo import KLPPOTrainer

    trainer = bandit_trainer(resolve_model_path(name), tmp_path, **overrides) if peft_config is None else None
    if trainer is not None:
        return trainer
    from datasets import Dataset

    from klppo.testing import klppo_config
    from klppo.testing.bandit import PROMPT, two_token_reward

    base = dict(
        output_dir=str(tmp_path / "bandit"),
        per_device_train_batch_size=16,
        num_ppo_epochs=1,
        lr_scheduler_type="constant",
        kl_coef=0.5,
        critic="shared",
        lam=1.0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        temperature=1.0,
    )
    base.update(overrides)
    prompts = Dataset.from_dict({"prompt": [PROMPT] * base["per_device_train_batch_size"]})
    return KLPPOTrainer(
        model=resolve_model_path(name),
        args=klppo_config(**base),
        train_dataset=prompts,
        reward_funcs=two_token_reward,
        peft_config=peft_config,
    )


def engine_agreement(trainer) -> tuple[float, float]:
    """`(agree, moved)`: the largest gap between the engine's log-probs of the tokens it samples and the trainer's
    forward at its weights now, and between the engine's and the reference's."""
    rollout = trainer.rollout(trainer.prompt_batch(["The day was"] * 16))
    keep = rollout.response_mask.bool()
    agree = float((rollout.logp - rollout.sampling_logp).abs()[keep].max())
    moved = float((rollout.ref_logp - rollout.sampling_logp).abs()[keep].max())
    return agree, moved


def spy_on_merges(monkeypatch) -> dict:
    """Count the LoRA layers the sync holds merged at once (`merged_lora` blocks open together, by their layers)."""
    from contextlib import contextmanager

    import klppo.ppo.generation.vllm as engine_module
    from klppo.ppo.generation.static_cache import mergeable_lora_layers

    merged_lora, counts = engine_module.merged_lora, {"open": 0, "most": 0}

    @contextmanager
    def counted(module, buffers=None):
        layers = len(mergeable_lora_layers(module) or ())
        with merged_lora(module, buffers):
            counts["open"] += layers
            counts["most"] = max(counts["most"], counts["open"])
            try:
                yield
            finally:
                counts["open"] -= layers

    monkeypatch.setattr(engine_module, "merged_lora", counted)
    return counts


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_engine_decodes_the_trainers_weights_after_every_update(tmp_path, monkeypatch, tied, lora):
    """After 3 updates (a sync before each rollout), the engine's processed log-probs of the tokens it sampled
    equal the trainer's forward at the same weights in float32 (a few 1e-6; the bound 1e-4), while the same tokens
    under the initial weights (the reference) are far off: the engine holds the updated weights, not the first."""
    name = "klppo:tiny-llama-vllm" + ("-tied" if tied else "")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    merged = spy_on_merges(monkeypatch)
    trainer = vllm_trainer(name, tmp_path, peft_config, max_steps=3, **SYNC_SETTINGS)
    trainer.train()
    syncs = [h["time/weight_sync"] for h in trainer.state.log_history if "time/weight_sync" in h]
    assert len(syncs) == 3
    # the adapter merged one decoder layer at a time: at most that layer's 3 LoRA layers' copies alive at once
    assert merged["most"] == (3 if lora else 0) and merged["open"] == 0
    agree, moved = engine_agreement(trainer)
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
    release(trainer)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_compiled_engine_decodes_the_trainers_weights_after_every_update(tmp_path, lora):
    """The same agreement with the engine's model compiled (`vllm_enforce_eager: false`, vLLM's default on a GPU):
    the sync writes into the tensors the compiled model reads, not into copies it no longer reads."""
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = vllm_trainer(
        "klppo:tiny-llama-vllm-tied",
        tmp_path,
        peft_config,
        max_steps=3,
        experimental={"vllm_enforce_eager": False},
        **SYNC_SETTINGS,
    )
    from vllm.config import CompilationMode

    assert trainer.sampler.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    trainer.train()
    agree, moved = engine_agreement(trainer)
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
    release(trainer)


@pytest.mark.parametrize("stop_token", ["eos", None], ids=["stop-at-eos", "fixed-length"])
def test_the_engine_and_the_trainer_agree_at_another_temperature(tmp_path, stop_token):
    """The same agreement at temperature 0.7 (every other sync test samples at 1.0): the engine's processed
    log-probs are taken after the temperature, as the trainer scores them. Fixed-length (`stop_token: None`): EOS
    is never sampled, and the engine's log-probs are over the other tokens, as the trainer's (unmasked, they would
    differ by log(1 - p(EOS)), about 1e-3 on this 1,024-token model)."""
    trainer = vllm_trainer(
        "klppo:tiny-llama-vllm",
        tmp_path,
        max_steps=3,
        **{**SYNC_SETTINGS, "temperature": 0.7, "stop_token": stop_token},
    )
    trainer.train()
    agree, moved = engine_agreement(trainer)
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
    suppressed = trainer.sampler.suppressed_ids
    assert (suppressed is None) == (stop_token is not None)
    if suppressed is not None:
        rollout = trainer.rollout(trainer.prompt_batch(["The day was"] * 16))
        assert rollout.response_mask.all() and not torch.isin(rollout.responses, suppressed).any()
    release(trainer)


def test_a_response_ends_at_the_stop_token_and_one_without_it_pays_the_missing_eos_penalty(tmp_path):
    """vLLM's semantics of a stop token as `generate`'s: the stop token is kept as the response's last token (its
    log-prob is trained), nothing follows it, and a response that never reaches it runs to `response_length` and
    pays `missing_eos_penalty`. The policy's LM head is scaled 1e5-fold, so that sampling is greedy in effect and
    the stop token can be picked from one rollout as the second token of one prompt's response and of none of the
    other's: in the next rollout the first prompt's responses stop there and the other's do not."""
    from klppo.ppo import update

    settings = {**SYNC_SETTINGS, "missing_eos_penalty": 1.0, "experimental": {"vllm_max_model_length": 32}}
    trainer = vllm_trainer("klppo:tiny-llama-vllm", tmp_path, max_steps=1, **settings)
    trainer.setup_optimisation()
    with torch.no_grad():
        trainer.model.policy.lm_head.weight.mul_(1e5)
    batch = trainer.prompt_batch(["The day was"] * 4 + ["Once upon a time there"] * 4)
    first = trainer.rollout(batch)
    assert (first.responses[:4] == first.responses[0]).all() and (first.responses[4:] == first.responses[4]).all()
    stop = int(first.responses[0, 1])
    assert stop != int(first.responses[0, 0]) and stop not in first.responses[4:].flatten().tolist(), first.responses
    trainer.sampler.stop_token_id = stop
    rollout = trainer.rollout(batch)
    lengths = rollout.response_mask.sum(dim=1).tolist()
    stopped = [bool((row[:n] == stop).any()) for row, n in zip(rollout.responses, lengths)]
    for row, n, ends in zip(rollout.responses, lengths, stopped):
        if ends:  # the stop token last, padding after it
            assert int(row[n - 1]) == stop and stop not in row[: n - 1].tolist()
            assert (row[n:] == trainer.processing_class.pad_token_id).all()
        else:
            assert n == trainer.args.response_length
    assert stopped[:4] == [True] * 4 and stopped[4:] == [False] * 4, (stopped, rollout.responses)
    assert lengths[:4] == [2] * 4
    keep = rollout.response_mask.bool()
    assert float((rollout.logp - rollout.sampling_logp).abs()[keep].max()) < 1e-4

    def scores(penalty):
        return update.compute_rewards(
            rollout,
            trainer.reward_funcs,
            trainer.reward_weights,
            trainer.reward_func_names,
            trainer.processing_class,
            stop,
            False,
            penalty,
            trainer.accelerator,
            log=False,
        ).scores

    paid = scores(None) - scores(1.0)
    assert paid.tolist() == [0.0] * 4 + [1.0] * 4
    assert trainer.compute_rewards(rollout).scores.tolist() == scores(1.0).tolist()
    release(trainer)


def test_the_trl_shaped_trainer_trains_on_vllm_rollouts_and_writes_its_completions_table(tmp_path):
    """TRL 1.12's `PPOTrainer` (`klppo.trl_compat`) with `use_vllm`: its update runs `generate_completions`
    (TRL's greedy table of the eval prompts) at the first update by default, through the policy's own `generate`
    beside the engine."""
    from datasets import Dataset

    from klppo.models import load_tokenizer
    from klppo.testing.bandit import two_token_reward
    from klppo.trl_compat import PPOConfig, PPOTrainer

    prompts = Dataset.from_dict({"prompt": ["The day was", "My friend said", "A letter came", "It rained"]})
    path = resolve_model_path("klppo:tiny-llama-vllm")
    args = PPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
        num_ppo_epochs=1,
        response_length=4,
        total_episodes=4,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=1,
        use_vllm=True,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=load_tokenizer(path),
        model=path,
        reward_funcs=two_token_reward,
        train_dataset=prompts,
        eval_dataset=prompts,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert any("time/weight_sync" in h for h in trainer.state.log_history)
    table = trainer.generate_completions()
    assert list(table.columns) == ["query", "model response", "score"] and len(table) == 4
    release(trainer)


def test_a_prompt_longer_than_the_engine_takes_stops_the_run_with_the_fix(tmp_path):
    """The engine's longest sequence is the datasets' longest prompt plus response_length; a longer prompt given
    later (here through `vllm_max_model_length` set short) is refused with the setting that fixes it, instead of
    vLLM cutting the response at its limit and the cut being trained on as sampled."""
    trainer = vllm_trainer(
        "klppo:tiny-llama-vllm", tmp_path, max_steps=1, experimental={"vllm_max_model_length": 12}, **SYNC_SETTINGS
    )
    trainer.train()
    with pytest.raises(ValueError, match="vllm_max_model_length to at least"):
        trainer.rollout(trainer.prompt_batch(["one two three four five six seven eight nine ten"]))
    release(trainer)


def test_an_engine_too_short_for_the_datasets_or_an_adapter_it_cannot_decode_is_refused_at_the_start(tmp_path):
    """Refused before the engine starts, each with its fix: `vllm_max_model_length` shorter than the datasets'
    longest prompt plus response_length (the run would stop at that prompt mid-run), and a PEFT adapter other than
    LoRA (IA3 here: the engine decodes base weights with LoRA merged into copies, and would decode the base model)."""
    from accelerate.state import AcceleratorState
    from peft import IA3Config

    with pytest.raises(ValueError, match="vllm_max_model_length is 6.*needs"):
        vllm_trainer("klppo:tiny-llama-vllm", tmp_path, experimental={"vllm_max_model_length": 6}, **SYNC_SETTINGS)
    AcceleratorState._reset_state(reset_partial_state=True)
    ia3 = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    with pytest.raises(ValueError, match="use_vllm with a IA3 adapter.*LoraConfig"):
        vllm_trainer("klppo:tiny-llama-vllm", tmp_path, ia3, **SYNC_SETTINGS)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_an_engine_that_fails_to_start_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    """The rank's environment variables the engine set and its directory are taken out again when vLLM fails to
    start, so that a corrected retry in the same process starts clean (vLLM is stopped before it starts a process
    group here: the group's teardown is the one `shutdown` runs after every test)."""
    import os

    from accelerate.state import AcceleratorState

    from klppo.ppo.generation.vllm import VLLMEngine

    made = []

    def fail(self, LLM, dtype, kwargs):
        made.append(self._dir.name)
        assert os.environ.get("RANK") == "0"
        raise RuntimeError("vLLM failed to start")

    before = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    monkeypatch.setattr(VLLMEngine, "_start", fail)
    with pytest.raises(RuntimeError, match="vLLM failed to start"):
        vllm_trainer("klppo:tiny-llama-vllm", tmp_path, **SYNC_SETTINGS)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert made and not os.path.exists(made[0])
    assert {name: os.environ.get(name) for name in before} == before
    assert not torch.distributed.is_initialized()


def test_sleep_mode_frees_the_engine_between_rollouts_and_the_sync_wakes_it(tmp_path, monkeypatch):
    """Sleep mode (a GPU's; on a CPU vLLM's sleep does nothing, so the calls are recorded here, not run): before
    each sync the weights wake, before each generation the KV cache, after it the engine sleeps at level 2; an
    engine asleep refuses to decode until the next sync. The rank's environment the engine set is taken out at
    shutdown."""
    import os

    before = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    trainer = vllm_trainer("klppo:tiny-llama-vllm", tmp_path, max_steps=2, **SYNC_SETTINGS)
    engine, calls = trainer.sampler, []
    monkeypatch.setattr(engine.llm, "sleep", lambda level: calls.append(("sleep", level)), raising=False)
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags: calls.append(("wake", tuple(tags))), raising=False)
    engine.sleeps = True
    trainer.train()
    cycle = [("wake", ("weights",)), ("wake", ("kv_cache",)), ("sleep", 2)]
    assert calls == cycle * 2
    with pytest.raises(RuntimeError, match="sleeping without a weight sync"):
        engine.generate(trainer.prompt_batch(["The day was"]), trainer.kl_plan)
    release(trainer)
    assert {name: os.environ.get(name) for name in before} == before


@pytest.mark.parametrize("case", ["reference reset", "resume"])
def test_the_engine_decodes_the_trainers_weights_after_a_reference_reset_and_a_resume(tmp_path, case):
    """LoRA. A reference reset at update 2 (the adapter merged into the reference, a fresh adapter trained after
    it), or a resume in a new trainer from the checkpoint of update 2, as in a new process (its engine starts from
    the base model's files): after update 3 the engine decodes the trainer's weights (bound 1e-4), not the
    reference's."""
    from peft import LoraConfig

    settings = SYNC_SETTINGS
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    name = "klppo:tiny-llama-vllm"
    if case == "reference reset":
        trainer = vllm_trainer(name, tmp_path, lora, max_steps=3, ref_reset_steps=2, **settings)
        trainer.train()
        assert trainer.reference_resets == 1
    else:
        saving = dict(save_strategy="steps", save_steps=2, **settings)
        first = vllm_trainer(name, tmp_path, lora, max_steps=2, **saving)
        first.train()
        release(first)
        trainer = vllm_trainer(name, tmp_path, lora, max_steps=3, **saving)
        trainer.train(resume_from_checkpoint=True)
        assert trainer.state.global_step == 3
    agree, moved = engine_agreement(trainer)
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
    release(trainer)


def test_a_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    """Full fine-tuning, 4 updates, saved after update 2: a new trainer resumed from that checkpoint (its engine
    started from the base model's files, then synced) ends with the same weights, coefficient and per-update logs as
    the run that was never interrupted. The engine's per-sequence seeds come from torch's generator, which the
    checkpoint restores, so even its sampling stream repeats."""
    settings = dict(SYNC_SETTINGS, learning_rate=3e-3, kl_coef=0.1, kl_target=0.5, kl_controller="adaptive")
    saving = dict(save_strategy="steps", save_steps=2, max_steps=4, **settings)
    whole = vllm_trainer("klppo:tiny-llama-vllm", tmp_path / "whole", **saving)
    whole.train()
    weights = {name: p.detach().clone() for name, p in whole.model.named_parameters()}
    logs = [h for h in whole.state.log_history if "kl/value" in h]
    coef = whole.kl_controller.state_dict()
    release(whole)
    resumed = vllm_trainer("klppo:tiny-llama-vllm", tmp_path / "resumed", **saving)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "bandit" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert resumed.kl_controller.state_dict() == coef
    again = [h for h in resumed.state.log_history if "kl/value" in h]
    for a, b in zip(logs[2:], again[-2:]):
        for key in ("objective/scores", "kl/value", "kl/coef", "sampling/logp_diff_max"):
            assert a[key] == b[key], (key, a[key], b[key])
    release(resumed)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype, drift, ratio", [("bfloat16", 1e-3, 1e-3), ("float16", 1e-4, 5e-5)])
def test_a_half_precision_engine_under_a_float32_trainer_is_measured_and_the_bandit_lands(
    tmp_path, dtype, drift, ratio
):
    """The engine in bfloat16 or float16 (`vllm_dtype`), the trainer in float32: the logged ratios move away from 1
    on every rollout (the float32 engine's stay within 1e-5 of it), and the one-token bandit still lands on pi*
    within the float32 engine's bound."""
    trainer = one_token_bandit(tmp_path, experimental={"vllm_dtype": dtype})
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sampling/is_ratio_max" in h]
    assert len(logs) == 120
    assert all(h["sampling/logp_diff_max"] > drift for h in logs)
    assert all(h["sampling/is_ratio_max"] > 1 + ratio and h["sampling/is_ratio_min"] < 1 - ratio for h in logs)
    end = one_token_state(trainer)
    assert kl(end["logp"], tilted(end["ref"], end["reward"], BETA)) < 0.02
    release(trainer)


def test_a_tied_head_left_packed_from_the_old_embedding_is_caught(tmp_path, monkeypatch):
    """Negative control of the test above: on a CPU vLLM keeps a packed copy of a tied LM head, made from the
    embedding at load time; a sync that does not repack it leaves the engine's head at the first weights, and the
    engine's log-probs then miss the trainer's by far more than the bound."""
    from klppo.ppo.generation import vllm as engine_module

    original = engine_module._reload
    monkeypatch.setattr(engine_module, "_reload", lambda worker, weights, repack: original(worker, weights, False))
    trainer = bandit_trainer(resolve_model_path("klppo:tiny-llama-vllm-tied"), tmp_path, max_steps=3, **SYNC_SETTINGS)
    trainer.train()
    agree, _ = engine_agreement(trainer)
    assert agree > 1e-2
    release(trainer)


def one_token_bandit(tmp_path, **overrides):
    return bandit_trainer(
        resolve_model_path("klppo:tiny-llama-vllm"),
        tmp_path,
        kl_mode="reward",
        kl_estimator="k1",
        use_vllm=True,
        **overrides,
    )


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
def test_a_drifting_vllm_engine_is_measured_and_its_kl_reading_corrected(tmp_path, monkeypatch):
    """The engine made to sample at a temperature 5% above the trainer's for 40 updates of the one-token bandit,
    then 50% above for one rollout (4096 responses): the drift is logged on every rollout; the plain KL reading
    misses KL(pi || ref) by more than 0.05 nats, the corrected one (what the controller reads) by less than half that
    (the same test on generate, with why 50%: `tests/test_generation.py`)."""
    from klppo.ppo.generation.vllm import VLLMEngine

    original, drift = VLLMEngine.sampling_params, {"factor": 1.05}

    def drifted(self, seed):
        params = original(self, seed)
        params.temperature = self.args.temperature * drift["factor"]
        return params

    monkeypatch.setattr(VLLMEngine, "sampling_params", drifted)
    trainer = one_token_bandit(tmp_path, max_steps=40)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sampling/logp_diff_max" in h]
    assert len(logs) == 40 and all(h["sampling/logp_diff_max"] > 1e-3 for h in logs)
    drift["factor"] = 1.5
    from test_generation import kl_readings

    corrected, plain, exact = kl_readings(trainer, prompts=4096)
    assert abs(plain - exact) > 0.05, (corrected, plain, exact)
    assert abs(corrected - exact) < 0.5 * abs(plain - exact), (corrected, plain, exact)
    release(trainer)


@pytest.mark.numerics
def test_the_bandit_on_a_drifting_vllm_engine_lands_with_the_correction(tmp_path, monkeypatch):
    """The engine sampling at a temperature 30% above the trainer's for all 120 updates of the one-token bandit: with
    the correction (on by default) it lands on pi* within the bound of the undrifted test (the same test on
    generate: `tests/test_generation.py`, with its ablation)."""
    from klppo.ppo.generation.vllm import VLLMEngine

    original = VLLMEngine.sampling_params

    def drifted(self, seed):
        params = original(self, seed)
        params.temperature = self.args.temperature * 1.3
        return params

    monkeypatch.setattr(VLLMEngine, "sampling_params", drifted)
    trainer = one_token_bandit(tmp_path)
    trainer.train()
    assert all(h["sampling/logp_diff_max"] > 1e-2 for h in trainer.state.log_history if "sampling/logp_diff_max" in h)
    end = one_token_state(trainer)
    assert kl(end["logp"], tilted(end["ref"], end["reward"], BETA)) < 0.02
    release(trainer)


def launch_ranks(tmp_path, launcher: list[str], options: tuple = (), fails: bool = False):
    """`tests/vllm_ranks_worker.py` on 2 CPU ranks under `launcher` with the worker's `options`; returns each rank's
    record, or with `fails` the launcher's stderr (it must fail)."""
    import json
    import os
    import subprocess
    import sys

    for name in ("klppo:tiny-llama-vllm", "klppo:tiny-llama-vllm-tied"):  # built once here, not by both ranks at once
        resolve_model_path(name)
    worker = os.path.join(os.path.dirname(__file__), "vllm_ranks_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # a test before set them
        env.pop(name, None)
    cmd = [sys.executable, "-m", *launcher, worker, str(tmp_path), *options]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    if fails:
        assert proc.returncode != 0
        return proc.stderr
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def assert_ranks_synced(ranks: list[dict]) -> None:
    """Each rank's engine decodes its trainer's weights after 3 updates (its log-probs equal its forward's within
    1e-4, far from the reference's), both ranks synced before every rollout and hold one coefficient, their
    responses to one prompt differ (each engine draws its own stream), and they trained on different prompts."""
    assert [r["world"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["gap"] < 1e-4 and r["moved"] > 100 * max(r["gap"], 1e-5), r
        assert r["syncs"] == 3
    assert ranks[0]["coef"] == ranks[1]["coef"]
    assert ranks[0]["responses"] != ranks[1]["responses"]
    assert len(ranks[0]["prompts"]) == len(ranks[1]["prompts"]) == 24
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])  # each rank decodes its own share of the data


def test_two_cpu_ranks_each_decode_with_their_own_engine(tmp_path):
    """`accelerate launch` with the shipped DDP config (2 processes; torch's elastic agent starts them), full
    fine-tuning: each rank's engine decodes its trainer's weights; a prompt too long for the engine on one rank
    stops the rollout on both (one rank alone would leave the other waiting in the next collective)."""
    import os

    from test_trainer_distributed import free_port

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "accelerate")
    launcher = ["accelerate.commands.launch", "--config_file", os.path.join(config, "multi_gpu.yaml")]
    launcher += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port())]
    ranks = launch_ranks(tmp_path, launcher)
    assert_ranks_synced(ranks)
    assert not any(r["sharded"] for r in ranks)
    for r in ranks:  # handed over layer by layer as under sharding, with nothing to gather
        assert r["gathers"] == r["engine_syncs"] * (r["layers"] + 1) and r["gathers_at_once"] == 1, r
    assert all(r["refused"] for r in ranks)  # rank 1's long prompt: both ranks refuse the rollout


@pytest.mark.parametrize(
    "engine, options",
    [("fsdp2", ("tied",)), ("fsdp2", ("lora",)), ("zero3", ()), ("zero3", ("lora", "head"))],
    ids=["fsdp2-full-tied", "fsdp2-lora", "zero3-full", "zero3-lora-with-head"],
)
def test_sharded_weights_are_gathered_one_layer_at_a_time_into_each_ranks_engine(tmp_path, engine, options):
    """`accelerate launch` with the shipped FSDP2 config (2 processes, float32; FSDP turned on for CPU ranks as
    `tests/test_fsdp2.py` does) or the shipped ZeRO-3 CPU config, each rank holding a shard of every decoder weight:
    every sync gathers one decoder layer at a time and then the rest (a LoRA adapter merged while its layer is
    whole, on the LM head too), and each rank's engine decodes its trainer's weights after 3 updates, tied
    embeddings and untied."""
    ranks = launch_ranks(tmp_path, sharded_launcher(engine), options)
    assert_ranks_synced(ranks)
    for r in ranks:
        assert r["sharded"]
        assert r["gathers_at_once"] == 1
        assert r["gathers"] == r["engine_syncs"] * (r["layers"] + 1), r  # each layer, then the rest


def test_a_lora_on_a_tied_head_is_refused_under_sharding(tmp_path):
    """FSDP2, the tied model, a LoRA on its LM head: merging it would change the embedding that the head shares, so
    the engine refuses it at the start, before the weights are sharded (by the parameters' identity, which shows
    the sharing where a sharded storage would not)."""
    stderr = launch_ranks(tmp_path, sharded_launcher("fsdp2"), ("lora", "head", "tied"), fails=True)
    assert "cannot be merged into copies of its base weights" in stderr


def sharded_launcher(engine: str) -> list[str]:
    """`accelerate launch` with the shipped FSDP2 config (2 processes, float32) or ZeRO-3 CPU config."""
    import os

    from test_trainer_distributed import free_port

    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "accelerate")
    launcher = ["accelerate.commands.launch", "--main_process_port", str(free_port())]
    if engine == "fsdp2":
        return launcher + [
            "--config_file",
            os.path.join(configs, "fsdp.yaml"),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
        ]
    import deepspeed  # noqa: F401  (installed by `scripts/setup.sh vllm`: missing, this fails)

    return launcher + ["--config_file", os.path.join(configs, "deepspeed_zero3_cpu.yaml")]
