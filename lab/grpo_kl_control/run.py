"""TRL's GRPOTrainer on the default sentiment task (SmolLM2-135M-Instruct, offline), with a fixed beta or with
a klppo controller (`add_kl_control`: `--mode equilibrium`, its default with a target, or `tracking`). One run per call; writes `<out>/summary.json`. From the
repository root:

    python -m lab.grpo_kl_control.run --mode tracking --seed 0 --out results/grpo_kl_control/runs/tracking-0
"""

import argparse
import json
import os
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from klppo.data import load_heldout_texts, offline_prompts
from klppo.evaluation import heldout_perplexity
from klppo.integrations.trl import add_kl_control
from klppo.kl.tracking import tracking_stats
from klppo.models import OFFLINE_DEFAULT_MODEL, resolve_model_path
from klppo.rewards.sentiment import positive_sentiment_reward


class LogLines(TrainerCallback):
    """Appends each logged record to a JSON-lines file as it comes, so that a run cut short keeps its readings."""

    def __init__(self, path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fixed", "tracking", "equilibrium"], required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--kl_target", type=float, default=0.1, help="nats per token")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--batch", type=int, default=16, help="completions per optimizer step (num_generations 4 each prompt)"
    )
    p.add_argument("--tokens", type=int, default=12, help="max_completion_length")
    p.add_argument("--kwargs", default=None, help="kl_controller_kwargs (JSON), e.g. '{\"ki_growth\": 1}'")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    config = GRPOConfig(
        output_dir=a.out,
        beta=a.beta,
        num_generations=4,
        per_device_train_batch_size=a.batch,
        max_completion_length=a.tokens,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        temperature=1.0,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=a.seed,
        disable_tqdm=True,
        bf16=False,  # float32 (GRPOConfig's bf16 autocast is 4x slower or more on a CPU)
        gradient_checkpointing=False,
    )
    prompts = Dataset.from_dict({"prompt": offline_prompts("train")})
    trainer = GRPOTrainer(
        model=resolve_model_path(OFFLINE_DEFAULT_MODEL),
        reward_funcs=positive_sentiment_reward,
        args=config,
        train_dataset=prompts,
    )
    if a.mode != "fixed":
        extra = {"kl_controller_kwargs": json.loads(a.kwargs)} if a.kwargs else {}
        add_kl_control(trainer, kl_controller=a.mode, kl_target=a.kl_target, kl_target_unit="token", **extra)
    os.makedirs(a.out, exist_ok=True)
    trainer.add_callback(LogLines(os.path.join(a.out, "log.jsonl")))
    texts = load_heldout_texts(max_texts=32)
    tok = trainer.processing_class
    ppl_before = heldout_perplexity(trainer.model, tok, texts)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    ppl_after = heldout_perplexity(trainer.model, tok, texts)
    logs = [h for h in trainer.state.log_history if "kl" in h and "reward" in h]
    kls = [h["kl"] for h in logs]
    tracking = tracking_stats(kls, a.kl_target)
    rewards = [h["reward"] for h in logs]
    summary = dict(
        mode=a.mode,
        kwargs=a.kwargs,
        seed=a.seed,
        steps=a.steps,
        batch=a.batch,
        tokens=a.tokens,
        beta0=a.beta,
        kl_target=a.kl_target,
        lr=a.lr,
        reward_first5=sum(rewards[:5]) / 5,
        reward_last5=sum(rewards[-5:]) / 5,
        kl_second_half_mean=tracking.mean_ratio * a.kl_target,
        tracking_error=tracking.error,
        in_band=tracking.in_band,
        ppl_before=ppl_before,
        ppl_after=ppl_after,
        seconds_per_update=seconds / a.steps,
        device=str(trainer.args.device),
        kl=kls,
        reward=rewards,
        beta=[h.get("kl/coef", a.beta) for h in logs],
        peak=tracking.peak_ratio,
    )
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()
