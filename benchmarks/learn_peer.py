"""The peer side of `benchmarks/learn_vs_peer.py`: TRL 1.12's PPO trained on klppo's default task.

Runs inside the peer's virtual environment (`benchmarks/bench.py` creates it; this script also needs
`vaderSentiment` there) and imports nothing from klppo. The task is klppo's `configs/default.yaml`:
SmolLM2-135M-Instruct, LoRA r=16 / alpha=32 on every attention and MLP projection with the
adapter-disabled reference, 32 sampled sequences of 12 tokens per update (8 x 4 mini-batches), one PPO
epoch, temperature 1, no stop token, and the reward VADER's compound score of the completion alone. TRL's
layout keeps its own value model (`AutoModelForSequenceClassification`, num_labels=1, from the base) and a
fixed KL coefficient (k1 in the reward).

The reward reaches the peer as a sequence-classification-shaped module, `VaderRewardModel`: TRL's
`get_reward` runs `model.<base_model_prefix>(...)` and reads `model.score(hidden_states[-1])` at the last
response position. Here the "backbone" passes the token ids through and `score` decodes the response
(`skip_special_tokens`, as klppo decodes completions) and returns its VADER score at every position. The
prompt / response split is the `context_length` TRL passes to `get_reward`, handed to the module by a
wrapper around that function.

    PEER/bin/python benchmarks/learn_peer.py --model-path DIR --prompts prompts.json --learning-rate 5e-4 \
        --seed 0 --out run.json

Writes `{"settings": ..., "log_history": trainer.state.log_history}` (per update: `objective/scores`, the
mean raw reward; `objective/kl`; `policy/approxkl_avg`; `policy/clipfrac_avg`; ...).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from types import SimpleNamespace

import torch
from torch import nn


class _TokenEcho(nn.Module):
    """A stand-in backbone: its last "hidden state" is the token ids, so `score` can read the text."""

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(hidden_states=(input_ids[..., None].to(torch.float64),))


class VaderRewardModel(nn.Module):
    """VADER's compound score of the response text, shaped like a sequence-classification reward model."""

    base_model_prefix = "backbone"

    def __init__(self, tokenizer):
        super().__init__()
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.backbone = _TokenEcho()
        self.tokenizer = tokenizer
        self.analyzer = SentimentIntensityAnalyzer()
        self.context_length: int | None = None  # set before each call by `pass_context_length`

    def texts(self, token_ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(token_ids[:, self.context_length :].tolist(), skip_special_tokens=True)

    def score(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ids = hidden_states[..., 0].round().long()
        values = [self.analyzer.polarity_scores(t)["compound"] for t in self.texts(ids)]
        scores = torch.tensor(values, dtype=torch.float32, device=hidden_states.device)
        return scores[:, None, None].expand(ids.shape[0], ids.shape[1], 1)


def pass_context_length(ppo_module, reward_model: VaderRewardModel) -> None:
    """Wrap the `get_reward` TRL's trainer calls so the reward module knows where the response starts."""
    get_reward = ppo_module.get_reward

    def with_context(model, query_responses, pad_token_id, context_length):
        if model is reward_model:
            model.context_length = context_length
        return get_reward(model, query_responses, pad_token_id, context_length)

    ppo_module.get_reward = with_context


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of prompt strings (klppo's training prompts)")
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--kl-coef", type=float, default=0.07)
    parser.add_argument("--updates", type=int, default=36)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def check_reward(reward_model, tokenizer, prompts: list[str]) -> None:
    """The module's score equals VADER on the decoded response, through TRL's own `get_reward`."""
    from trl.experimental.utils import get_reward

    queries = [tokenizer(p)["input_ids"] for p in prompts[:4]]
    responses = [tokenizer(" what a wonderful, lovely day")["input_ids"], tokenizer(" this is awful")["input_ids"]] * 2
    width = max(map(len, queries))
    rows = [
        [tokenizer.pad_token_id] * (width - len(q)) + q + r[:5] + [tokenizer.pad_token_id] * (5 - len(r[:5]))
        for q, r in zip(queries, responses)
    ]
    reward_model.context_length = width
    _, scores, _ = get_reward(reward_model, torch.tensor(rows), tokenizer.pad_token_id, width)
    expected = [reward_model.analyzer.polarity_scores(t)["compound"] for t in reward_model.texts(torch.tensor(rows))]
    assert torch.allclose(scores, torch.tensor(expected)), (scores, expected)


def main(argv=None):
    args = parse_args(argv)
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(args.prompts) as f:
        prompts = json.load(f)
    reward_model = VaderRewardModel(tokenizer)
    check_reward(reward_model, tokenizer, prompts)
    pass_context_length(ppo_module, reward_model)
    ids = [tokenizer(p)["input_ids"][-args.max_prompt_length :] for p in prompts]
    dataset = Dataset.from_dict({"input_ids": ids})
    value_model = AutoModelForSequenceClassification.from_pretrained(args.model_path, num_labels=1, dtype=torch.float32)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"],
    )
    # TRL's rollout batch is per_device_train_batch_size * gradient_accumulation_steps, split into
    # num_mini_batches: 32 sequences per update in mini-batches of 8, as klppo's 8 x 4.
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="klppo-learn-peer-"),
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        num_mini_batches=4,
        num_ppo_epochs=1,
        response_length=12,
        temperature=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        kl_coef=args.kl_coef,
        total_episodes=32 * args.updates,
        stop_token=None,
        missing_eos_penalty=None,
        num_sample_generations=0,
        local_rollout_forward_batch_size=32,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32),
        ref_model=None,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=dataset,
        eval_dataset=dataset,
        peft_config=lora,
    )
    trainer.train()
    record = {
        "side": "peer",
        "settings": {**vars(args), "trl": __import__("trl").__version__, "threads": torch.get_num_threads()},
        "log_history": trainer.state.log_history,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
