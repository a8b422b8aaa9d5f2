"""Compiled decoding, compiled once: with a static cache, the decoding step compiles at the first rollout and never
again, whatever the run does after it.

transformers compiles `generate`'s decoding step only on accelerators; `CompileConfig._compile_all_devices` makes it
compile on a CPU too, and a counting backend (which runs the traced graph as it is) counts the compilations. After
the first rollout, `torch.compiler.set_stance("fail_on_recompile")` turns any recompilation into an error, so a run
that finishes has compiled exactly once. A negative control shows that the detector fires: a rollout that decodes in
the other mode (`module.training`) recompiles, and the stance stops it. And the compiled step decodes with the
weights of the update it is in: its log-probs after 3 updates equal a scoring forward's at the trained weights.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from klppo import KLPPOTrainer
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.testing import klppo_config

GRAPHS: list[int] = []


def counting_backend(gm, example_inputs, **kwargs):
    """Dynamo backend that records each compiled graph and runs it as traced."""
    GRAPHS.append(len(gm.graph.nodes))
    return gm.forward


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


class FailOnRecompileAfterFirstUpdate(TrainerCallback):
    """From the end of the first update (its rollout, and its evaluation when there is one) on, a recompilation
    raises."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            torch.compiler.set_stance("fail_on_recompile")


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_path(TINY_MODEL)


@pytest.fixture
def prompts():
    # widths from 2 to 20 tokens (clipped at max_prompt_length): rollout batches have widths of their own
    texts = [
        "Hi",
        "The day was",
        "My friend said that the weather",
        "A letter came for you this morning, and",
        "It rained",
        "Our team lost the final game of the season after",
        "Food",
        "The old man and the sea were",
    ]
    return Dataset.from_dict({"prompt": [t for t in texts for _ in range(3)]})


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    GRAPHS.clear()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


def compiled_trainer(tiny_path, prompts, tmp_path, peft: bool = True, **overrides) -> KLPPOTrainer:
    from peft import LoraConfig

    args = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_ppo_epochs=2,
        max_steps=4,
        response_length=5,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        max_prompt_length=12,
        cache_implementation="static",
        experimental={"generation_compile_config": {"backend": counting_backend}},
        critic="shared",
        kl_coef=0.1,
    )
    args.update(overrides)
    trainer = KLPPOTrainer(
        model=tiny_path,
        args=klppo_config(**args),
        train_dataset=prompts,
        reward_funcs=length_reward,
        peft_config=LoraConfig(r=4, target_modules="all-linear") if peft else None,
        eval_dataset=prompts.select(range(3)) if args.get("eval_strategy") == "steps" else None,
    )
    assert trainer.sampler.static_caches is not None
    trainer.sampler.generation_config.compile_config._compile_all_devices = True  # compile on the CPU, as on a GPU
    trainer.add_callback(FailOnRecompileAfterFirstUpdate())
    return trainer


def trained_weight(trainer) -> torch.Tensor:
    name, param = next(
        (n, p)
        for n, p in trainer.model.named_parameters()
        if p.requires_grad and "lora_B" in n or p.requires_grad and "q_proj" in n
    )
    return param


def run_and_count(trainer) -> None:
    """Train with the stance armed after the first update; the decoding step compiled once, and the weights it
    decodes with changed in between (so the compiled step did not freeze them)."""
    weight = trained_weight(trainer)
    before = weight.detach().clone()
    trainer.train()
    assert trainer.state.global_step == trainer.args.max_steps
    assert len(GRAPHS) == 1, f"the decoding step compiled {len(GRAPHS)} times"
    assert not torch.equal(before, weight)


CASES = {
    "lora, shared critic, KL in the reward": dict(),
    "lora, separate critic, KL in the loss": dict(critic="separate", kl_mode="loss", kl_estimator="k2"),
    "lora, KL in both, target and controller": dict(kl_mode="both", kl_estimator="k2", kl_target=0.5),
    "evaluation of fewer prompts than a rollout between updates": dict(eval_strategy="steps", eval_steps=1),
    "reference resets": dict(ref_reset_steps=2),
    "several mini-batches and accumulation": dict(
        num_mini_batches=2, per_device_train_batch_size=2, gradient_accumulation_steps=2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_decoding_step_compiles_once_per_run(tiny_path, prompts, tmp_path, case):
    run_and_count(compiled_trainer(tiny_path, prompts, tmp_path, **CASES[case]))


@pytest.mark.parametrize("workload", ["a", "b"])
def test_the_benchmark_workloads_in_bf16_compile_once(tiny_path, prompts, tmp_path, workload):
    """The GPU benchmark's layouts in bf16: (a) full fine-tuning with a separate critic and a frozen reference, (b)
    LoRA with a shared critic; the model loaded in bf16 and `bf16=True` (the mixed-precision path)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16)
    overrides = dict(bf16=True, critic="separate" if workload == "a" else "shared")
    trainer = compiled_trainer(model, prompts, tmp_path, peft=workload == "b", **overrides)
    run_and_count(trainer)


def test_a_resumed_run_compiles_once(tiny_path, prompts, tmp_path):
    """A save, then a resume in a new trainer (as in a new process): the resumed run compiles once, at its first
    rollout, and nothing after it."""
    first = compiled_trainer(tiny_path, prompts, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    assert len(GRAPHS) == 1
    torch.compiler.set_stance("default")
    torch._dynamo.reset()
    GRAPHS.clear()
    resumed = compiled_trainer(tiny_path, prompts, tmp_path, max_steps=5, save_strategy="steps", save_steps=2)
    resumed.remove_callback(FailOnRecompileAfterFirstUpdate)

    class ArmAfterFirstResumedUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                torch.compiler.set_stance("fail_on_recompile")

    resumed.add_callback(ArmAfterFirstResumedUpdate())
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 5 and len(GRAPHS) == 1


def test_a_rollout_in_the_other_mode_is_caught(tiny_path, prompts, tmp_path, monkeypatch):
    """Negative control: once armed, a rollout whose policy decodes in train mode (where the others decode in eval
    mode) needs a new graph, and the stance refuses it. Without the stance, the same rollout compiles a second
    graph."""
    trainer = compiled_trainer(tiny_path, prompts, tmp_path, max_steps=1)
    trainer.train()
    assert len(GRAPHS) == 1
    batch = trainer.prompt_batch(list(prompts["prompt"][:4]))
    from klppo.ppo.generation.hf import GenerateEngine as RolloutSampler

    original = RolloutSampler.sampling_form

    def train_mode(self, policy):
        form = original(self, policy)

        class TrainMode:
            def __enter__(self_):
                form.__enter__()
                policy.train()

            def __exit__(self_, *exc):
                return form.__exit__(*exc)

        return TrainMode()

    monkeypatch.setattr(RolloutSampler, "sampling_form", train_mode)
    with pytest.raises(Exception, match="fail_on_recompile|[Rr]ecompil"):
        trainer.rollout(batch)
    torch.compiler.set_stance("default")
    trainer.rollout(batch)
    assert len(GRAPHS) == 2


def test_the_static_cache_is_as_long_as_the_longest_prompt(tiny_path, prompts, tmp_path, caplog):
    """Each decoding step attends over the whole static cache, so the cache holds the longest prompt of the run's
    datasets plus the response, not `max_prompt_length` plus the response. A batch wider than that (prompts from
    outside the datasets) grows every cache to `max_prompt_length` once, with a warning, and the step compiles again
    for it; the responses still come."""
    from klppo.ppo.prompts import longest_prompt

    trainer = compiled_trainer(tiny_path, prompts, tmp_path, max_steps=1, max_prompt_length=24)
    tokenizer = trainer.processing_class
    widths = [len(tokenizer(text)["input_ids"]) for text in prompts["prompt"]]
    assert max(widths) < 24  # the fixture's prompts are narrower than max_prompt_length
    caches = trainer.sampler.static_caches
    assert caches.prompt_width == max(widths) and caches.max_len == max(widths) + 5
    assert longest_prompt([prompts], tokenizer, 3) == 3  # clipped, as collation clips
    tokenized = Dataset.from_dict({"input_ids": [[5, 6, 7], [5] * 30]})  # pre-tokenized rows: their lengths
    assert longest_prompt([tokenized, None], tokenizer, 24) == 24 and longest_prompt([tokenized], tokenizer, 99) == 30
    trainer.train()
    assert len(GRAPHS) == 1
    (size,) = caches.caches
    assert caches.caches[size].get_max_length() == max(widths) + 5
    torch.compiler.set_stance("default")
    wide = trainer.prompt_batch(["one two three four five six seven eight nine ten eleven twelve thirteen"] * 4)
    assert wide.input_ids.shape[1] == 24
    with caplog.at_level("WARNING", logger="klppo.ppo.generation.static_cache"):
        rollout = trainer.rollout(wide)
    assert "grow to max_prompt_length + response_length = 29" in caplog.text
    assert caches.max_len == 29 and caches.caches[size].get_max_length() == 29
    assert rollout.responses.shape == (4, 5) and len(GRAPHS) == 2


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_compiled_step_decodes_with_the_updated_weights(tiny_path, prompts, tmp_path, peft):
    """After 3 updates with the compiled static cache (and, with LoRA, the merged copies it decodes from), the
    log-probs the compiled step gives the tokens it samples equal a scoring forward at the trained weights (float32,
    a few 1e-6; the bound 1e-4), while the same tokens under the initial weights (the reference) are far off: the
    compiled step holds the updated weights, not the ones it was traced with."""
    from dataclasses import replace

    trainer = compiled_trainer(tiny_path, prompts, tmp_path, peft=peft, max_steps=3, learning_rate=1e-2)
    run_and_count(trainer)
    engine, batch = trainer.sampler, trainer.prompt_batch(list(prompts["prompt"][:4]))
    plan = replace(trainer.kl_plan, read_while_decoding=True)  # the compiled step's own log-probs, read at each step
    with engine.generating(trainer.model_wrapped):
        sampled = engine.generate(batch, plan)
    assert len(GRAPHS) == 1  # the same compiled step decoded them
    scored = trainer.score(sampled.sequences)
    keep = sampled.sequences.response_mask.bool()
    decoded = sampled.generated.logp
    agree = float((scored.logp - decoded).abs()[keep].max())
    moved = float((scored.ref_logp - decoded).abs()[keep].max())
    assert agree < 1e-4, agree
    assert moved > 100 * max(agree, 1e-5), (moved, agree)
