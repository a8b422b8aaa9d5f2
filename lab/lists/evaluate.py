"""One yardstick for every arm of the list task: the reward and the KL to the reference of a trained LoRA adapter
(or of the reference itself), on the held-out prompts of `klppo:list-prompts`.

For each of the 5 held-out prompts, `--samples` responses are drawn at the config's temperature and length; the
reward is `list_items_reward`, and the KL is exact per token (the full-vocabulary KL of the policy's next-token
distribution to the reference's, at every response position of the sampled sequence), summed over the response:
its mean is KL(pi || ref) per sequence, the quantity the runs' target (8 nats) names. Writes JSON to `--out`.

    python -m lab.lists.evaluate --adapter outputs/lists --out outputs/lists/heldout.json
"""

import argparse
import json
import os

import torch
import yaml
from peft import PeftModel

from klppo.data import list_prompts
from klppo.models import load_causal_lm, load_tokenizer, resolve_model_path
from klppo.rewards import list_items_reward

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lists.yaml")


@torch.no_grad()
def evaluate(adapter, samples, seed, config=CONFIG):
    with open(config) as f:
        c = yaml.safe_load(f)
    path = resolve_model_path(c["model_name_or_path"])
    tok = load_tokenizer(path)
    model = load_causal_lm(path, dtype="float32").eval()
    if adapter:
        model = PeftModel.from_pretrained(model, adapter).eval()
    rewards, kls, lengths = [], [], []
    torch.manual_seed(seed)
    for prompt in list_prompts("eval"):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].repeat(samples, 1)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=c["temperature"],
            top_k=0,
            top_p=1.0,
            max_new_tokens=c["response_length"],
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        response = out[:, ids.shape[1] :]
        # the response up to and including the first eos
        ended = (response == tok.eos_token_id).int().cumsum(1)
        mask = (ended == 0) | ((ended == 1) & (response == tok.eos_token_id))
        full_mask = torch.cat([torch.ones_like(ids), mask.long()], 1)
        logits = model(input_ids=out, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].float()
        if adapter:
            with model.disable_adapter():
                ref_logits = model(input_ids=out, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].float()
        else:
            ref_logits = logits
        logp = torch.log_softmax(logits / c["temperature"], -1)
        ref_logp = torch.log_softmax(ref_logits / c["temperature"], -1)
        kl_token = (logp.exp() * (logp - ref_logp)).sum(-1)
        kls += (kl_token * mask).sum(1).tolist()
        lengths += mask.sum(1).tolist()
        texts = tok.batch_decode([r[m.bool()] for r, m in zip(response, mask)], skip_special_tokens=True)
        rewards += list_items_reward([prompt] * samples, texts)
    n = len(rewards)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return dict(
        adapter=adapter,
        samples=n,
        seed=seed,
        reward=mean(rewards),
        kl_sequence=mean(kls),
        response_length=mean(lengths),
        rewards=rewards,
        kls=kls,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--adapter", default=None, help="a LoRA folder; none: the reference itself")
    p.add_argument("--samples", type=int, default=8, help="responses per held-out prompt")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = evaluate(a.adapter, a.samples, a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()
