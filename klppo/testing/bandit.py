"""One- and two-token bandits on the tiny Llama whose KL-regularised optimum is known in closed form.

A fixed prompt, a response of one token `a` (or two, `a1 a2`), and a reward that depends on the token ids.
The policy is `softmax(logits / T)` over the vocabulary less the end-of-sequence ids (responses have a fixed
length, so those ids are never sampled and are masked out of every scored log-softmax). Everything below
is computed exactly from logits: with a 1k vocabulary these are sums, not estimates.

Closed forms (reward r, coefficient beta, reference ref):

- reverse KL, `max E_pi[r] - beta * KL(pi || ref)`: `pi* = ref * exp(r / beta) / Z`;
  for any pi, `J(pi*) - J(pi) = beta * KL(pi || pi*)`;
- forward KL, `max E_pi[r] - beta * KL(ref || pi)`: `pi(a) = beta * ref(a) / (lam - r(a))`, with
  `lam > max r` fixed by `sum pi = 1` (bisection: the sum decreases in lam);
- two tokens, reward at the end, k1 in the reward with reward-to-go: the same tilt at the sequence level,
  `pi*(a1 a2) = ref(a1 a2) * exp(r(a1, a2) / beta) / Z`.
"""

from __future__ import annotations

import math

import torch
from datasets import Dataset

from klppo import KLPPOTrainer
from klppo.testing import klppo_config

PROMPT = "The day was"
MODULUS = 4  # reward 1 for token ids divisible by 4: about a quarter of the reference's mass


def in_set(ids: torch.Tensor, modulus: int = MODULUS) -> torch.Tensor:
    return (ids % modulus == 0).double()


def one_token_reward(modulus: int = MODULUS):
    def reward(prompts, completions, completion_ids=None, **kwargs):
        return [float(ids[0] % modulus == 0) for ids in completion_ids]

    reward.__name__ = f"token_id_divisible_by_{modulus}"
    return reward


def two_token_reward(prompts, completions, completion_ids=None, **kwargs):
    """Given once, at the end: 1 for a first token in the set, plus 1 for an odd second token. The first
    token is paid only through the score at the last position, so it learns only through the reward-to-go;
    the second token's tilt must hold after every first token."""
    return [float(ids[0] % MODULUS == 0) + float(ids[1] % 2 == 1) for ids in completion_ids]


def two_token_rewards(vocab: int) -> torch.Tensor:
    """`[V, V]` reward of every pair (a1, a2), as `two_token_reward` gives it."""
    ids = torch.arange(vocab)
    return in_set(ids)[:, None] + (ids % 2 == 1).double()[None, :]


def bandit_trainer(tiny_path, tmp_path, response_length: int = 1, modulus: int = MODULUS, **overrides) -> KLPPOTrainer:
    reward = one_token_reward(modulus) if response_length == 1 else two_token_reward
    base = dict(
        output_dir=str(tmp_path / "bandit"),
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_steps=120,
        response_length=response_length,
        stop_token=None,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        kl_coef=0.5,
        critic="shared",
        lam=1.0,  # unbiased advantages whatever the critic: the fixed point is the closed form's
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        rollout_forward_batch_size=64,
    )
    base.update(overrides)
    rollout_batch = base["per_device_train_batch_size"] * base["gradient_accumulation_steps"] * base["num_mini_batches"]
    prompts = Dataset.from_dict({"prompt": [PROMPT] * rollout_batch})
    return KLPPOTrainer(model=tiny_path, args=klppo_config(**base), train_dataset=prompts, reward_funcs=reward)


@torch.no_grad()
def next_token_logprobs(trainer: KLPPOTrainer, model, prefixes: list[list[int]]) -> torch.Tensor:
    """`log softmax(logits / T)` of the next token after `PROMPT + prefix` for each prefix, with the
    suppressed ids masked out exactly as the trainer scores them. `[len(prefixes), V]`, float64."""
    from klppo.ppo.scoring.logprobs import mask_suppressed

    tokenizer = trainer.processing_class
    prompt = tokenizer(PROMPT)["input_ids"]
    ids = torch.tensor([prompt + list(p) for p in prefixes])
    logits = model(input_ids=ids).logits[:, -1].double() / trainer.args.temperature
    return torch.log_softmax(mask_suppressed(logits, trainer.sampler.suppressed_ids), dim=-1)


def policy_and_reference(trainer: KLPPOTrainer, prefixes=((),)) -> tuple[torch.Tensor, torch.Tensor]:
    policy = trainer.accelerator.unwrap_model(trainer.model).policy.eval()
    if trainer.ref_model is not None:
        ref = next_token_logprobs(trainer, trainer.ref_model, prefixes)
    else:
        with policy.disable_adapter():
            ref = next_token_logprobs(trainer, policy, prefixes)
    return next_token_logprobs(trainer, policy, prefixes), ref


def allowed(trainer: KLPPOTrainer, vocab: int) -> torch.Tensor:
    keep = torch.ones(vocab, dtype=torch.bool)
    if trainer.sampler.suppressed_ids is not None:
        keep[trainer.sampler.suppressed_ids] = False
    return keep


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p || q) over the last dim, 0 log 0 = 0."""
    p = logp.exp()
    return float(torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum())


def tilted(ref_logp: torch.Tensor, reward: torch.Tensor, beta: float) -> torch.Tensor:
    """log pi* = log ref + r / beta - log Z (the reverse-KL optimum)."""
    return torch.log_softmax(ref_logp + reward / beta, dim=-1)


def forward_kl_optimum(ref_logp: torch.Tensor, reward: torch.Tensor, beta: float, keep: torch.Tensor) -> torch.Tensor:
    """log of `pi(a) = beta * ref(a) / (lam - r(a))`, `sum pi = 1`, on the allowed tokens (-inf elsewhere)."""
    ref = ref_logp.exp() * keep
    lo, hi = float(reward[keep].max()), float(reward[keep].max()) + beta + 1.0
    while (beta * ref / (hi - reward)).sum() > 1:
        hi += hi - lo
    for _ in range(200):
        lam = 0.5 * (lo + hi)
        if (beta * ref / (lam - reward)).sum() > 1:
            lo = lam
        else:
            hi = lam
    pi = beta * ref / (0.5 * (lo + hi) - reward)
    return torch.where(keep, pi.log(), torch.full_like(pi, -math.inf))


def one_token_state(trainer: KLPPOTrainer, modulus: int = MODULUS) -> dict:
    """Exact quantities of the trained one-token bandit."""
    logp, ref = (x[0] for x in policy_and_reference(trainer))
    reward = in_set(torch.arange(logp.shape[-1]), modulus)
    return {"logp": logp, "ref": ref, "reward": reward, "keep": allowed(trainer, logp.shape[-1])}


def two_token_kl_to_optimum(trainer: KLPPOTrainer, beta: float) -> tuple[float, float]:
    """(KL(pi || pi*), KL(pi || ref)) over two-token sequences, exactly: every first token, then the
    conditional of the second."""
    logp1, ref1 = (x[0] for x in policy_and_reference(trainer))
    vocab = logp1.shape[-1]
    keep = allowed(trainer, vocab)
    firsts = torch.arange(vocab)[keep]
    logp2 = torch.full((vocab, vocab), -math.inf, dtype=torch.float64)
    ref2 = logp2.clone()
    for chunk in firsts.split(256):
        p, r = policy_and_reference(trainer, [[int(a)] for a in chunk])
        logp2[chunk], ref2[chunk] = p, r
    reward = two_token_rewards(vocab)
    # pi*(a2 | a1) = ref(a2 | a1) exp(r / beta) / Z(a1);  pi*(a1) = ref(a1) Z(a1) / Z
    log_z1 = torch.logsumexp(ref2 + reward / beta, dim=-1)
    opt2 = ref2 + reward / beta - log_z1[:, None]
    opt1 = torch.log_softmax(torch.where(keep, ref1 + log_z1, torch.full_like(ref1, -math.inf)), dim=-1)
    p1 = logp1.exp()
    kl_opt, kl_ref = kl(logp1, opt1), kl(logp1, ref1)
    for a in firsts.tolist():
        kl_opt += float(p1[a]) * kl(logp2[a], opt2[a])
        kl_ref += float(p1[a]) * kl(logp2[a], ref2[a])
    return kl_opt, kl_ref


def grpo_advantage_gap(q: float, group: int, eps: float = 1e-4) -> float:
    """`Delta_G(q) = E[A | r = 1] - E[A | r = 0]` for a 0/1 reward whose probability is q, GRPO's advantage
    `(r - mean) / (unbiased std + eps)` over a group of `group`: the other `group - 1` rewards hold k ones with
    probability Binomial(group - 1, q)."""

    def std(ones: int) -> float:
        return math.sqrt(ones * (group - ones) / (group * (group - 1)))

    gap = 0.0
    for k in range(group):
        weight = math.comb(group - 1, k) * q**k * (1 - q) ** (group - 1 - k)
        gap += weight * ((1 - (k + 1) / group) / (std(k + 1) + eps) + (k / group) / (std(k) + eps))
    return gap


def coefficient_for_target(ref_logp: torch.Tensor, reward: torch.Tensor, target: float, optimum=tilted) -> float:
    """The beta* whose optimum `optimum(ref_logp, reward, beta)` (default the tilt) has KL(pi*_beta || ref) =
    target, by bisection on log beta (that KL falls monotonically as beta grows)."""
    lo, hi = math.log(1e-4), math.log(1e4)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl(optimum(ref_logp, reward, math.exp(mid)), ref_logp) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def grpo_coefficient_for_target(
    ref_logp: torch.Tensor, reward: torch.Tensor, target: float, group: int, forward: bool
) -> float:
    """GRPO's beta* for a KL in the loss on a 0/1 reward: its group normalisation makes the policy gradient that of
    `E[Delta_G(q) * r]`, so its fixed point at beta is the optimum at `beta / Delta_G(q)` (the forward-KL one for
    `k3`, the tilt for `k2`), q the fixed point's own reward probability. The optimum with KL `target` has a
    coefficient b* and a q*; beta* = b* * Delta_G(q*)."""
    keep = torch.isfinite(ref_logp)
    optimum = (lambda ref, r, b: forward_kl_optimum(ref, r, b, keep)) if forward else tilted
    b = coefficient_for_target(ref_logp, reward, target, optimum)
    q = float((optimum(ref_logp, reward, b).exp() * reward).sum())
    return b * grpo_advantage_gap(q, group)
