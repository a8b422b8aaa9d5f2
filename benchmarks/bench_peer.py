"""The peer side of `benchmarks/bench.py`: TRL 1.12's `trl.experimental.ppo.PPOTrainer`, timed.

Runs inside the peer's own environment (trl==1.12.0, the last TRL with a PPO trainer: the peer venv,
or the interpreter and PYTHONPATH given to `bench.py` by `--peer-python`/`--peer-pythonpath`) and
imports nothing from klppo. `benchmarks/bench.py` calls this script; to run it by hand:

    ~/.cache/klppo/bench-peer-venv/bin/python benchmarks/bench_peer.py \
        --model-path MODEL_DIR --prompts prompts.json --workload a --warmup 1 --updates 3 \
        [--dtype bfloat16] [--device cuda]

`--dtype bfloat16` loads every model in bf16 and sets `PPOConfig(bf16=True)`, as TRL 1.12's PPO
examples do with `--dtype bfloat16 --bf16`.

It trains `warmup + updates` PPO updates and prints one JSON object (also written to `--out`):
per-update wall times and phase times, their medians over the measured updates, tokens per second
and peak memory.

Workloads (the same architecture TRL was written for):
  a: policy, frozen reference, value model and reward model, four separate models; the value and
     reward models are `AutoModelForSequenceClassification(num_labels=1)` built from the base.
  b: the most economical layout the peer has: a LoRA policy whose reference is the same model with
     the adapter disabled (TRL's `peft_config` + `ref_model=None` path). The peer has no shared
     value head and no reward-function path, so the value and reward models stay separate.

Phases. TRL's `train()` is one long function, so phases are timed by wrapping the module-level
functions it calls (`batch_generation`, `forward`, `selective_log_softmax`, `get_reward`) and the
trainer's `log`; update boundaries come from the `on_step_end` callback.
  time/generation     `batch_generation` (sampling, with per-step scores kept).
  time/score_policy   log-probs of the sampled tokens from the generation scores (no extra forward).
  time/score_ref      the reference forward (or the adapter-disabled policy) + its log-softmax.
  time/score_value    `get_reward(value_model, ...)`: the critic's forward over the rollout.
  time/reward         `get_reward(reward_model, ...)`.
  time/kl_rewards_gae the inline code between the last reward call and the first training forward,
                      less the `gc.collect()` TRL runs there: EOS filter, masks, the KL estimate and
                      KL penalty, GAE, whitening. TRL's KL is a few inline tensor ops that cannot be
                      timed alone: this window is an upper bound on the peer's KL cost.
  time/gc             TRL's explicit `gc.collect()` calls (two per update).
  time/optimise       from the first training forward of the update to its `log` call: the PPO
                      epochs (forwards, losses, backward, optimizer steps) and the epoch statistics.
  time/update         between consecutive `on_step_end` callbacks (the first from `on_train_begin`):
                      the whole update, including data loading, logging and TRL's clean-up.

Tokens per second: response positions per second of update, `batch * response_length / time`,
the same definition `bench.py` uses for klppo (the peer generates exactly `response_length`
tokens: no stop token is set on either side).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections import defaultdict

import torch

from bench_workload import (  # this script's folder is on sys.path
    add_workload_arguments,
    emit,
    load_causal_lm,
    load_scalar_head,
    lora_config,
    memory_record,
    peak_rss_mb,
    repeated_prompts,
    resolve_device,
    synchronize,
    timing_record,
    versions,
    workload_settings,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    return parser.parse_args(argv)


class PhaseClock:
    """Accumulates wall time per phase for the current update; `end_update` closes one."""

    def __init__(self, args):
        self.args = args
        self.updates: list[dict] = []
        self.phases: dict[str, float] = defaultdict(float)
        self.update_start = None
        self.last_rollout_end = None  # end of the last reward-model call of this update
        self.optimise_start = None
        self.last_call = None  # name of the last rollout function timed
        self.gc_in_window = 0.0  # gc.collect() time between the reward call and the first training forward
        self.generated = 0
        self.response_positions = 0

    def add(self, name, seconds):
        self.phases[name] += seconds

    def start(self):
        synchronize(self.args)
        self.update_start = time.perf_counter()

    def end_update(self):
        synchronize(self.args)  # on a GPU: the update's queued kernels are part of it
        now = time.perf_counter()
        record = dict(self.phases)
        record["time/update"] = now - self.update_start
        record["generated_length"] = self.generated
        record["response_positions"] = self.response_positions
        self.updates.append(record)
        self.phases = defaultdict(float)
        self.update_start = now
        self.last_rollout_end = self.optimise_start = self.last_call = None
        self.gc_in_window = 0.0


def install_timers(ppo_module, clock: PhaseClock, reward_model):
    """Wrap the functions `PPOTrainer.train` looks up in its module, so each call is timed."""
    batch_generation = ppo_module.batch_generation
    forward = ppo_module.forward
    selective_log_softmax = ppo_module.selective_log_softmax
    get_reward = ppo_module.get_reward

    def timed_batch_generation(model, queries, *args, **kwargs):
        t0 = time.perf_counter()
        query_responses, logits = batch_generation(model, queries, *args, **kwargs)
        clock.add("time/generation", time.perf_counter() - t0)
        clock.generated = query_responses.shape[1] - queries.shape[1]
        clock.response_positions += query_responses.shape[0] * clock.generated
        clock.last_call = "generation"
        return query_responses, logits

    def timed_forward(model, *args, **kwargs):
        t0 = time.perf_counter()
        if torch.is_grad_enabled():  # a PPO-epoch forward
            if clock.optimise_start is None:
                clock.optimise_start = t0
                if clock.last_rollout_end is not None:
                    window = t0 - clock.last_rollout_end - clock.gc_in_window
                    clock.add("time/kl_rewards_gae", window)
            return forward(model, *args, **kwargs)
        out = forward(model, *args, **kwargs)  # the only no-grad `forward` in a rollout: the reference
        clock.add("time/score_ref", time.perf_counter() - t0)
        clock.last_call = "ref_forward"
        return out

    def timed_selective_log_softmax(logits, index):
        if torch.is_grad_enabled():
            return selective_log_softmax(logits, index)
        t0 = time.perf_counter()
        out = selective_log_softmax(logits, index)
        phase = "time/score_policy" if clock.last_call == "generation" else "time/score_ref"
        clock.add(phase, time.perf_counter() - t0)
        return out

    def timed_get_reward(model, *args, **kwargs):
        t0 = time.perf_counter()
        out = get_reward(model, *args, **kwargs)
        t1 = time.perf_counter()
        if model is reward_model:
            clock.add("time/reward", t1 - t0)
            clock.last_rollout_end = t1
        else:
            clock.add("time/score_value", t1 - t0)
        clock.last_call = "get_reward"
        return out

    class TimedGC:
        """Stands in for the `gc` module inside TRL's trainer module: times `gc.collect()`."""

        def __getattr__(self, name):
            return getattr(gc, name)

        def collect(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = gc.collect(*args, **kwargs)
            seconds = time.perf_counter() - t0
            clock.add("time/gc", seconds)
            if clock.last_rollout_end is not None and clock.optimise_start is None:
                clock.gc_in_window += seconds
            return out

    ppo_module.gc = TimedGC()
    ppo_module.batch_generation = timed_batch_generation
    ppo_module.forward = timed_forward
    ppo_module.selective_log_softmax = timed_selective_log_softmax
    ppo_module.get_reward = timed_get_reward


def main(argv=None):
    args = parse_args(argv)
    import transformers
    import trl
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    resolve_device(args)
    torch.manual_seed(args.seed)
    rss_start = peak_rss_mb()
    setup_start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    clock = PhaseClock(args)
    trainer = build_trainer(args, tokenizer, clock)
    setup_s = time.perf_counter() - setup_start
    rss_setup = peak_rss_mb()
    trainer.train()
    layout = (
        "separate policy, reference, value and reward models"
        if args.workload == "a"
        else "LoRA policy, adapter-disabled reference, separate value and reward models"
    )
    result = {
        "side": "peer",
        "implementation": f"trl {trl.__version__} trl.experimental.ppo.PPOTrainer",
        "workload": args.workload,
        "layout": layout,
        **timing_record(args, clock.updates, "time/update", setup_s),
        "generated_length": [u["generated_length"] for u in clock.updates],
        **memory_record(args, rss_start, rss_setup),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "settings": workload_settings(args, lora=args.workload == "b"),
        "versions": versions(),
    }
    emit(result, args.out)
    return result


def build_trainer(args, tokenizer, clock: PhaseClock):
    """TRL's `PPOTrainer` on the workload, its phases timed into `clock`."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    prompts = repeated_prompts(args)
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    reward_model = load_scalar_head(args, tokenizer.pad_token_id)
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="klppo-bench-peer-"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=args.num_mini_batches,
        num_ppo_epochs=args.num_ppo_epochs,
        response_length=args.response_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        kl_coef=args.kl_coef,
        total_episodes=len(prompts),
        stop_token=None,
        missing_eos_penalty=None,
        num_sample_generations=0,
        bf16=args.dtype == "bfloat16",
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        seed=args.seed,
    )
    install_timers(ppo_module, clock, reward_model)

    class UpdateClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start()

        def on_step_end(self, *a, **k):
            clock.end_update()

    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=load_causal_lm(args),
        ref_model=load_causal_lm(args) if args.workload == "a" else None,
        reward_model=reward_model,
        value_model=load_scalar_head(args, tokenizer.pad_token_id),
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=[UpdateClock()],
        peft_config=lora_config(args) if args.workload == "b" else None,
    )
    log_call = trainer.log

    def timed_log(logs, *a, **k):
        if clock.optimise_start is not None:
            clock.add("time/optimise", time.perf_counter() - clock.optimise_start)
        return log_call(logs, *a, **k)

    trainer.log = timed_log
    return trainer


if __name__ == "__main__":
    main()
