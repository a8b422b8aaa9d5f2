"""The klppo side of `benchmarks/bench.py`, run in a fresh process per measurement.

One job, printing one JSON object (also written to `--out`):

    python benchmarks/bench_klppo.py train --model-path DIR --prompts prompts.json --workload a

`train` runs `warmup + updates` PPO updates of `KLPPOTrainer` on a workload and reports the same
fields as `benchmarks/bench_peer.py` (see there for the peer's phase definitions):

  a: the peer's layout: policy, a separately loaded frozen reference, a value model and a reward
     model, both `AutoModelForSequenceClassification(num_labels=1)` built from the base
     (`critic="separate"`; the value model is the sequence classifier's backbone + its `score`).
  b: klppo's economical default: a LoRA policy, the reference is the policy with its adapter
     disabled (`ref_model=None`), `critic="shared"` (a value head on the policy), and the reward
     is the function `klppo.rewards.sentiment.positive_sentiment_reward` (VADER, no model).

Phase times are klppo's own `time/*` metrics from `trainer.state.log_history`. `time/update_wall` is
measured the way the peer's `time/update` is: the wall time between consecutive `on_step_end`
callbacks (the first from `on_train_begin`), so it includes what klppo's `time/update` leaves out
(logging). The two sides are compared on `time/update_wall`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

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
from compile_counts import CompileCounter, per_step


def train(args) -> dict:
    """Time `warmup + updates` PPO updates of `KLPPOTrainer` on the workload."""
    import transformers

    from klppo.models import load_tokenizer

    transformers.logging.set_verbosity_error()
    resolve_device(args)
    torch.manual_seed(args.seed)
    rss_start = peak_rss_mb()
    setup_start = time.perf_counter()
    tokenizer = load_tokenizer(args.model_path)
    trainer, critic = build_trainer(args, tokenizer)
    setup_s = time.perf_counter() - setup_start
    wall = UpdateClock(args)
    trainer.add_callback(wall)
    compiles = CompileCounts()
    trainer.add_callback(compiles)
    profiler = UpdateProfiler(args.warmup) if args.profile else None
    if profiler is not None:
        trainer.add_callback(profiler)
    rss_setup = peak_rss_mb()
    try:
        trainer.train()
    finally:
        if profiler is not None:
            profiler.stop()
    logs = [h for h in trainer.state.log_history if "time/update" in h]
    per_update = [
        {**{k: float(v) for k, v in log.items() if k.startswith("time/")}, "time/update_wall": seconds}
        for log, seconds in zip(logs, wall.seconds)
    ]
    measured = per_update[args.warmup :]
    layout = (
        "separate policy, reference, value and reward models (critic='separate')"
        if args.workload == "a"
        else "LoRA policy, adapter-disabled reference, shared value head, sentiment reward function"
    )
    extra = {"profile": profiler.account(len(measured))} if profiler is not None else {}
    return {
        **extra,
        "side": "klppo",
        "implementation": "klppo.KLPPOTrainer",
        "workload": args.workload,
        "layout": layout,
        **timing_record(args, per_update, "time/update_wall", setup_s),
        "decoding": {
            "cache": "static" if trainer.sampler.static_caches is not None else "dynamic",
            "compile_config": str(trainer.sampler.generation_config.compile_config)
            if trainer.sampler.static_caches is not None
            else None,
        },
        "compiles_per_update": compiles.per_update(),
        "kl_share": statistics.median(u.get("time/kl", 0.0) / u["time/update"] for u in measured),
        "generated_length": [h.get("objective/response_length") for h in logs],
        **memory_record(args, rss_start, rss_setup),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "settings": workload_settings(
            args, lora=args.workload == "b", kl_estimator="k1", kl_controller="fixed", critic=critic
        ),
        "versions": versions(),
    }


class UpdateClock(TrainerCallback):
    """Wall time of each PPO update, between `on_step_end` callbacks (the first from `on_train_begin`); on a GPU
    each boundary waits for the queued kernels first."""

    def __init__(self, args):
        self.args = args
        self.seconds: list[float] = []

    def on_train_begin(self, *a, **k):
        synchronize(self.args)
        self.last = time.perf_counter()

    def on_step_end(self, *a, **k):
        synchronize(self.args)
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


class CompileCounts(TrainerCallback):
    """Graphs compiled, CUDA graphs recorded and eager warm-ups of CUDA graph trees in each update
    (`compile_counts.CompileCounter`)."""

    def __init__(self):
        self.counter, self.snapshots = None, []

    def on_train_begin(self, *a, **k):
        self.counter = CompileCounter()

    def on_step_end(self, *a, **k):
        self.snapshots.append(self.counter.snapshot())

    def per_update(self) -> list[dict]:
        return per_step(self.snapshots)


class UpdateProfiler(TrainerCallback):
    """`torch.profiler` over the updates after `warmup`: CPU time of klppo's `klppo/*` ranges (its phases, and
    the PPO epochs' forward, backward, gradient clipping and optimizer step) and the top operators."""

    def __init__(self, warmup: int):
        self.warmup, self.profile, self.stopped = warmup, None, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup and self.profile is None:
            self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profile.__enter__()

    def on_train_end(self, *a, **k):
        self.stop()

    def stop(self):
        if self.profile is not None and not self.stopped:
            self.profile.__exit__(None, None, None)
            self.stopped = True

    def account(self, updates: int) -> dict:
        """Seconds per update of each `klppo/*` range (inclusive) and of the 12 operators with the most self
        CPU time (`aten::*` and the like, exclusive)."""
        if self.profile is None or updates < 1:
            raise SystemExit("--profile needs at least one measured update (--updates >= 1 after --warmup)")
        events = self.profile.key_averages()
        ranges = {e.key: e.cpu_time_total / 1e6 / updates for e in events if e.key.startswith("klppo/")}
        ops = sorted((e for e in events if not e.key.startswith("klppo/")), key=lambda e: -e.self_cpu_time_total)
        top = {e.key: e.self_cpu_time_total / 1e6 / updates for e in ops[:12]}
        return {"updates": updates, "ranges_s": ranges, "top_ops_self_s": top}


def build_trainer(args, tokenizer):
    """`(trainer, critic)`: workload (a) is TRL's four-model layout, (b) klppo's efficient default."""
    from datasets import Dataset

    from klppo import KLPPOConfig, KLPPOTrainer

    if args.workload == "a":
        kwargs = {
            "ref_model": load_causal_lm(args),
            "value_model": load_scalar_head(args, tokenizer.pad_token_id),
            "reward_funcs": load_scalar_head(args, tokenizer.pad_token_id),
        }
        critic = "separate"
    else:
        from klppo.rewards.sentiment import positive_sentiment_reward

        kwargs = {"reward_funcs": positive_sentiment_reward, "peft_config": lora_config(args)}
        critic = "shared"
    config = KLPPOConfig(
        output_dir=tempfile.mkdtemp(prefix="klppo-bench-"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=args.num_mini_batches,
        num_ppo_epochs=args.num_ppo_epochs,
        response_length=args.response_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        kl_coef=args.kl_coef,
        kl_estimator="k1",
        kl_controller="fixed",
        critic=critic,
        max_steps=args.warmup + args.updates,
        stop_token=None,
        missing_eos_penalty=None,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        num_sample_generations=0,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        seed=args.seed,
        **(json.loads(args.config) if getattr(args, "config", None) else {}),
    )
    dataset = Dataset.from_dict({"prompt": repeated_prompts(args)})
    trainer = KLPPOTrainer(
        model=load_causal_lm(args), args=config, processing_class=tokenizer, train_dataset=dataset, **kwargs
    )
    return trainer, critic


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    jobs = parser.add_subparsers(dest="job", required=True)
    run = jobs.add_parser("train", help="time PPO updates of KLPPOTrainer")
    add_workload_arguments(run)
    run.add_argument("--profile", action="store_true", help="torch.profiler over the measured updates")
    run.add_argument(
        "--config",
        default=None,
        help='JSON: KLPPOConfig keywords for this side, e.g. \'{"cache_implementation": "dynamic"}\'',
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    emit(train(args), args.out)


if __name__ == "__main__":
    main()
