"""The LM head read in blocks of response positions (`logits_block_mb`): scoring and the PPO loss give what one pass
over all positions gives, log-probs, KL estimates and gradients alike, and a model whose head transforms its output
is read right."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from datasets import Dataset
from trl.trainer.utils import selective_log_softmax

from klppo import KLPPOTrainer
from klppo.kl import full_kl
from klppo.models import TINY_MODEL, resolve_model_path
from klppo.ppo.actor_critic import ActorCritic, ValueHead
from klppo.ppo.results import Advantages
from klppo.ppo.scoring.logprobs import (
    ResponseLogits,
    block_positions,
    position_ids_from_mask,
    read_response,
    response_logits,
    response_positions,
)
from klppo.testing import klppo_config

pytestmark = pytest.mark.numerics

ONE_POSITION = 1e-9  # MiB: a block of one position
ALL = 1e6  # MiB: one block


def test_block_positions_fit_the_budget():
    assert block_positions(16, 49152, 256) == 85  # 16 x 85 x 49,152 x 4 bytes = 255 MiB
    assert 16 * 86 * 49152 * 4 > 256 * 2**20
    assert block_positions(64, 151936, 1) == 1  # never less than one position
    assert block_positions(1, 10, 1) == 26214


def plain_reads(logits, ref_logits, responses, temperature, suppressed):
    """Today's computation on whole `[B, R, V]` tensors."""
    scaled = response_logits(logits, responses.shape[1], temperature, suppressed)
    ref = response_logits(ref_logits, responses.shape[1], temperature, suppressed)
    probs = scaled.softmax(-1)
    return {
        "logp": selective_log_softmax(scaled, responses),
        "ref_logp": selective_log_softmax(ref, responses),
        "full": full_kl(scaled, ref),
        "entropy": -(probs * scaled.log_softmax(-1)).sum(-1),
    }


@pytest.mark.parametrize("budget_positions", [1, 3, 7, 64])
def test_reading_in_blocks_equals_one_pass_in_values_and_gradients(budget_positions):
    """Float32 hidden states through a linear head: every read and the gradients of a nonlinear loss of them
    (reaching the hidden states and the head's weight, through a checkpointed block) equal one pass over all
    positions within 1e-6."""
    torch.manual_seed(0)
    rows, length, hidden_size, vocab = 3, 7, 16, 50
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    ref_head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, length, hidden_size, requires_grad=True)
    ref_hidden = torch.randn(rows, length, hidden_size)
    responses = torch.randint(0, vocab - 2, (rows, length))
    suppressed = torch.tensor([vocab - 1, vocab - 2])
    temperature = 0.7
    budget = rows * budget_positions * vocab * 4 / 2**20
    assert block_positions(rows, vocab, budget) == budget_positions

    def loss_of(reads):
        return (reads["logp"].exp() * torch.linspace(-1, 1, length)).sum() + 0.3 * reads["full"].pow(2).sum()

    plain = plain_reads(head(hidden), ref_head(ref_hidden), responses, temperature, suppressed)
    loss_of(plain).backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    policy = ResponseLogits.from_hidden(hidden, head, vocab)
    reference = ResponseLogits.from_hidden(ref_hidden, ref_head, vocab)
    blocks = read_response(
        policy,
        responses,
        temperature,
        suppressed,
        budget,
        reference=reference,
        estimates={"full": full_kl},
        entropy=True,
    )
    for key in ("logp", "ref_logp", "full", "entropy"):
        assert blocks[key].shape == (rows, length)
        torch.testing.assert_close(blocks[key], plain[key], rtol=0, atol=1e-6, msg=key)
    assert not blocks["entropy"].requires_grad and not blocks["ref_logp"].requires_grad
    loss_of(blocks).backward()
    torch.testing.assert_close(hidden.grad, grads[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, grads[1], rtol=0, atol=1e-6)
    assert ref_head.weight.grad is None  # the reference takes no gradient


def test_a_block_of_every_position_is_the_plain_computation_bit_for_bit():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 30)
    responses = torch.randint(0, 30, (2, 5))
    got = read_response(ResponseLogits.from_logits(logits), responses, 0.8, None, ALL)["logp"]
    assert torch.equal(got, selective_log_softmax(response_logits(logits, 5, 0.8), responses))


def test_the_finite_check_finds_one_bad_logit():
    logits = torch.zeros(2, 4, 10)
    logits[1, 2, 7] = float("nan")
    finite = read_response(
        ResponseLogits.from_logits(logits),
        torch.zeros(2, 4, dtype=torch.long),
        1.0,
        None,
        2 * 10 * 4 / 2**20,
        finite=True,
    )["finite"]
    assert finite.tolist() == [[True] * 4, [True, True, False, True]]


@pytest.fixture(scope="module")
def prompts():
    words = ["The day was", "My friend said", "A letter came", "The food tasted", "Our team lost", "It rained"]
    return Dataset.from_dict({"prompt": [w for w in words for _ in range(4)]})


def length_reward(prompts, completions, completion_ids=None, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def trainer_and_rollout(model_path, prompts, tmp_path, n: int, **overrides):
    args = klppo_config(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_steps=1,
        response_length=10,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        stop_token=None,
        **overrides,
    )
    trainer = KLPPOTrainer(model=model_path, args=args, train_dataset=prompts, reward_funcs=length_reward)
    with torch.no_grad():  # a policy away from the reference, so that every KL is far from 0
        head = trainer.model.policy.get_output_embeddings().weight
        head.add_(0.05 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    return trainer, trainer.rollout(trainer.prompt_batch(prompts["prompt"][:n]))


def loss_and_grads(trainer, rollout):
    n = rollout.batch_size
    advantages = Advantages(
        torch.linspace(-1, 1, n)[:, None].expand_as(rollout.values).contiguous(), rollout.values, kl_loss_coef=0.5
    )
    counts = dict(num_tokens=rollout.response_mask.sum(), num_seqs=n)
    trainer.model.zero_grad()
    loss, parts, _ = trainer.loss_function()(rollout, advantages, torch.arange(n), counts)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v[0] for k, v in parts.items()}, grads


def check_blocks_match(trainer, rollout, positions: int, atol: float):
    """Scoring, the loss and its gradients with a budget of `positions` positions per block against one block."""
    scorer, vocab = trainer.scorer, trainer.model.policy.config.vocab_size
    x = trainer.args.experimental
    plain_score = scorer.score(trainer.model_wrapped, rollout.sequences())
    plain_loss, plain_parts, plain_grads = loss_and_grads(trainer, rollout)
    small = positions * rollout.batch_size * vocab * 4 / 2**20
    assert block_positions(rollout.batch_size, vocab, small) == positions < rollout.responses.shape[1]
    scorer.logits_block_mb = small
    trainer.args.experimental = dataclasses.replace(x, logits_block_mb=small)
    try:
        blocks_score = scorer.score(trainer.model_wrapped, rollout.sequences())
        blocks_loss, blocks_parts, blocks_grads = loss_and_grads(trainer, rollout)
    finally:
        scorer.logits_block_mb, trainer.args.experimental = x.logits_block_mb, x
    for key in ("logp", "ref_logp", "log_ratio", "kl", "statistic_kl", "logged_kl", "values"):
        torch.testing.assert_close(getattr(blocks_score, key), getattr(plain_score, key), rtol=0, atol=atol, msg=key)
    torch.testing.assert_close(blocks_loss, plain_loss, rtol=0, atol=atol)
    for key in ("loss/kl", "policy/entropy", "policy/approxkl"):
        torch.testing.assert_close(blocks_parts[key], plain_parts[key], rtol=0, atol=atol * rollout.response_mask.sum())
    assert blocks_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(blocks_grads[name], grad, rtol=0, atol=atol, msg=name)
    return plain_score


def test_the_trainer_in_blocks_equals_one_pass_and_the_models_own_logits(prompts, tmp_path):
    """The tiny model, float32, the exact KL in the loss and as the statistic: scoring (log-probs, every KL
    estimate, values) and the loss's value and gradients agree within 1e-6 between blocks of 3 positions and one
    block; and one block's log-probs are those of the model's own logits."""
    trainer, rollout = trainer_and_rollout(
        resolve_model_path(TINY_MODEL),
        prompts,
        tmp_path,
        n=4,
        kl_mode="both",
        kl_estimator="full",
        kl_target=0.5,
        critic="shared",
    )
    scored = check_blocks_match(trainer, rollout, positions=3, atol=1e-6)
    policy = trainer.model.policy
    seq = rollout.sequences()
    keep = response_positions(seq.responses.shape[1], seq.query_responses.shape[1], "cpu")
    with torch.no_grad():
        logits = policy(
            seq.query_responses,
            attention_mask=seq.attention_mask,
            logits_to_keep=keep,
            position_ids=position_ids_from_mask(seq.attention_mask),
        ).logits
    own = selective_log_softmax(
        response_logits(logits, keep.numel(), trainer.args.temperature, trainer.sampler.suppressed_ids), seq.responses
    )
    torch.testing.assert_close(scored.logp, own, rtol=0, atol=1e-6)
    assert trainer.model.head_reads_hidden is True


@pytest.mark.slow
def test_smollm2_in_blocks_equals_one_pass(prompts, tmp_path):
    """The same on the packaged SmolLM2-135M (vocabulary 49,152, tied embeddings), float32, with the sampled-token
    KL in the loss and the exact KL as the statistic, with LoRA (the reference is the adapter-disabled policy)."""
    from peft import LoraConfig

    path = resolve_model_path("klppo:smollm2-135m-instruct")
    args = klppo_config(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        max_steps=1,
        response_length=6,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        num_sample_generations=0,
        stop_token=None,
        kl_mode="both",
        kl_estimator="k2",
        kl_target=1.0,
        critic="shared",
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = KLPPOTrainer(model=path, args=args, train_dataset=prompts, reward_funcs=length_reward, peft_config=lora)
    with torch.no_grad():
        for name, p in trainer.model.policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(0)
    rollout = trainer.rollout(trainer.prompt_batch(prompts["prompt"][:2]))
    check_blocks_match(trainer, rollout, positions=2, atol=1e-6)


def capped_model(unknown: bool):
    """A tiny Gemma 2, whose forward soft-caps its head's output, or (`unknown`) one that caps it in a way no
    config field names."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits well past the cap, where capping changes them
    if unknown:
        model.config.final_logit_softcapping = None  # the forward still caps: klppo cannot know how
        forward = model.forward

        def capping_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            out.logits = torch.tanh(out.logits / 2.0) * 2.0
            return out

        model.forward = capping_forward
    return model


@pytest.mark.parametrize("unknown", [False, True])
def test_a_head_the_model_transforms_is_read_as_the_model_gives_it(unknown, caplog):
    """Gemma 2's soft-capping is applied to the blocks; a transform klppo does not know is found by the check on
    the first pass, which then reads the model's own logits (and says why memory grows)."""
    model = capped_model(unknown)
    actor = ActorCritic(model, value_head=ValueHead(32))
    ids = torch.randint(1, 40, (2, 9))
    mask = torch.ones_like(ids)
    responses = ids[:, -5:]
    with torch.no_grad():
        own = model(ids, attention_mask=mask, logits_to_keep=response_positions(5, 9, "cpu")).logits
    assert own.abs().max() <= 2.0 and (own.abs() > 1.5).any()  # past the cap, where capping changes them
    with caplog.at_level(logging.WARNING):
        reads, _ = actor(
            ids,
            attention_mask=mask,
            response_length=5,
            compute_values=False,
            read=lambda source: read_response(source, responses, 1.0, None, 40 * 2 * 4 / 2**20),
        )
    torch.testing.assert_close(reads["logp"], selective_log_softmax(own, responses), rtol=0, atol=1e-6)
    assert actor.head_reads_hidden is (not unknown)
    assert ("does not give the model's own logits" in caplog.text) is unknown


MALLOC_PROBE = """
import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
if sys.argv[1] == "command":
    from klppo.ppo.run.heap import decoding_heap, fix_mmap_threshold
    print("set" if fix_mmap_threshold(use_cpu=True) else "left", end=" ")
def where():
    libc.free(libc.malloc(8 << 20))  # a large block given back: glibc's own rule raises its threshold to its size
    before = libc.mallinfo2().hblks
    libc.malloc(2 << 20)
    return "mmapped" if libc.mallinfo2().hblks == before + 1 else "heap"
print(where(), end=" ")
if sys.argv[1] == "command":
    with decoding_heap():
        print("decoding", where(), end=" ")
print(where())
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only")
@pytest.mark.parametrize(
    "mode, env, expected",
    [
        ("plain", {}, "heap heap"),
        ("command", {}, "set mmapped decoding heap mmapped"),
        ("command", {"MALLOC_ARENA_MAX": "2"}, "left heap decoding heap heap"),
    ],
)
def test_the_command_fixes_mallocs_mmap_threshold_on_a_cpu(mode, env, expected):
    """The command's `fix_mmap_threshold`: after glibc has given back an 8 MiB block, a 2 MiB block is mmapped (and
    returned to the system when freed) only with the threshold fixed, and comes from the heap again while decoding
    (`decoding_heap`) and mmapped after it; a `MALLOC_*` option in the environment is the user's choice and is left
    alone."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
