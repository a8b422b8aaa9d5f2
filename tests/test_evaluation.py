"""Held-out perplexity (exact value, sharding across ranks, PEFT) and the KL drift monitor."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klppo.evaluation import heldout_perplexity
from klppo.kl import KLDriftMonitor

TEXTS = [
    "The train was late again, and nobody on the platform said a word.",
    "Dear diary, today was long.",
    "If the guard evaluates as true or is missing, the block inside is executed.",
    "Hi",
    "The little theatre company put on a play that surprised the whole town, and we stayed for the songs.",
]


def reference_perplexity(model, tokenizer, texts, max_length=None) -> float:
    """One text at a time, no padding, float64 log-softmax: the definition, written out."""
    nll, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"][:max_length]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        nll -= logp.gather(-1, ids[0, 1:, None]).sum().item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def test_perplexity_matches_definition(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    expected = reference_perplexity(model, tokenizer, TEXTS)
    for batch_size in (1, 2, 8):  # right padding inside a batch changes nothing
        assert heldout_perplexity(model, tokenizer, TEXTS, batch_size=batch_size) == pytest.approx(expected, rel=1e-5)
    assert 100 < expected < 10_000  # a random model over a 1k vocabulary


def test_perplexity_restores_mode_and_truncates(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    model.train()
    heldout_perplexity(model, tokenizer, TEXTS[:2])
    assert model.training
    model.eval()
    heldout_perplexity(model, tokenizer, TEXTS[:2])
    assert not model.training
    assert heldout_perplexity(model, tokenizer, TEXTS, max_length=4) == pytest.approx(
        reference_perplexity(model, tokenizer, TEXTS, max_length=4), rel=1e-5
    )
    with pytest.raises(ValueError, match="no texts"):
        heldout_perplexity(model, tokenizer, [])


class FakeRank:
    """One rank of a 2-process accelerator whose all-reduce is recorded instead of performed."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, rank: int):
        self.process_index = rank
        self.reduced = []

    def reduce(self, tensor, reduction="sum"):
        self.reduced.append(tensor.clone())
        return tensor


def test_perplexity_shards_texts_across_ranks(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    calls = []
    model.register_forward_hook(lambda module, args, kwargs_or_out: calls.append(1))
    ranks = [FakeRank(0), FakeRank(1)]
    for rank in ranks:
        heldout_perplexity(model, tokenizer, TEXTS, batch_size=2, accelerator=rank)
    # 5 texts: rank 0 gets 3, rank 1 gets 2 plus one zero-weight copy -> 2 forwards each
    assert len(calls) == 4
    (packed0,), (packed1,) = ranks[0].reduced, ranks[1].reduced
    total, count = packed0 + packed1
    expected = reference_perplexity(model, tokenizer, TEXTS)
    assert math.exp(total / count) == pytest.approx(expected, rel=1e-5)
    n_tokens = sum(len(tokenizer(t)["input_ids"]) - 1 for t in TEXTS)
    assert count.item() == n_tokens


def test_perplexity_with_peft_model(tiny_model_and_tokenizer):
    peft = pytest.importorskip("peft")
    model, tokenizer = tiny_model_and_tokenizer
    base = heldout_perplexity(model, tokenizer, TEXTS)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert heldout_perplexity(lora, tokenizer, TEXTS) == pytest.approx(base, rel=1e-6)  # LoRA starts at zero


def test_drift_monitor_waits_for_patience_and_does_not_spam():
    monitor = KLDriftMonitor(target=0.1, patience=3)
    assert [monitor.update(v) for v in (0.25, 0.3)] == [None, None]
    assert monitor.update(0.12) is None  # back inside the band: the streak restarts
    messages = [monitor.update(0.5) for _ in range(6)]
    assert messages[:2] == [None, None] and all(m is None for m in messages[3:])
    warning = messages[2]
    assert "kl/value" in warning and "0.1" in warning and "3 consecutive" in warning
    assert "raise kl_coef" in warning and "kl_target_unit" in warning

    assert [monitor.update(0.1) for _ in range(3)] == [None] * 3  # inside for `patience` updates: re-armed
    assert [monitor.update(0.5) for _ in range(3)][-1] is not None

    low = [monitor.update(0.01) for _ in range(3)]  # crossing to the other side is a new drift
    assert low[:2] == [None, None] and "below 0.5 x kl_target" in low[2] and "lower kl_coef" in low[2]


def test_drift_monitor_is_silent_during_the_approach_and_warns_once_per_excursion():
    """The policy starts at the reference: a KL that climbs from 0 towards the target reads below the band for
    many updates, which is no reason to lower the penalty. Once the KL has reached the band, a fall below it
    warns once; readings that dip back inside the band for fewer than `patience` updates are the same
    excursion."""
    monitor = KLDriftMonitor(target=4.0, patience=5)
    approach = [0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6, 1.9]  # below 0.5 x 4 for 10 updates
    assert [monitor.update(v) for v in approach] == [None] * 10
    assert [monitor.update(v) for v in (2.5, 3.5, 4.0)] == [None] * 3  # reached the band, then the target
    readings = [1.0] * 5 + [2.1] + [1.0] * 5 + [2.1, 2.2] + [1.0] * 5
    messages = [m for m in (monitor.update(v) for v in readings) if m]
    assert len(messages) == 1 and "below 0.5 x kl_target" in messages[0]
    assert [monitor.update(4.0) for _ in range(5)] == [None] * 5  # back for `patience` updates: a new excursion
    assert [monitor.update(1.0) for _ in range(5)][-1] is not None


def test_drift_monitor_state_round_trip():
    monitor = KLDriftMonitor(target=2.0, patience=2, high=3.0, low=0.25)
    monitor.update(10.0)
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = KLDriftMonitor(target=1.0)
    restored.load_state_dict(state)
    assert restored.state_dict() == monitor.state_dict()
    assert restored.update(10.0) is not None  # the restored streak reaches patience
    for bad in (dict(target=0.0), dict(target=1.0, patience=0), dict(target=1.0, high=0.9)):
        with pytest.raises(ValueError):
            KLDriftMonitor(**bad)
