"""The generation seam (`klppo.ppo.generation`): an engine whose sampling distribution drifts from the trainer's,
corrected by truncated importance sampling; the correction's arithmetic; the vLLM fields refused where they cannot
work. The vLLM engine's own tests are in `tests/test_vllm.py` (their own pytest pass, `-m vllm`)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import pytest
import torch

from klppo.ppo.generation.correction import correct_rollout, importance_weights, weight_advantages
from klppo.ppo.generation.engine import Sampled
from klppo.ppo.generation.hf import GenerateEngine
from klppo.ppo.generation.sampling import Generation
from klppo.testing import klppo_config
from klppo.testing.bandit import PROMPT, bandit_trainer, kl, one_token_state, tilted

BETA = 0.5


@pytest.fixture(scope="module")
def tiny_path():
    from klppo.models import TINY_MODEL, resolve_model_path

    return resolve_model_path(TINY_MODEL)


class DriftingEngine(GenerateEngine):
    """The `generate` engine made inexact on purpose: it samples at `temperature * factor` and reports that
    distribution's log-probs as its own (`sampling_logp`), as an engine with other numerics would."""

    exact = False
    reads_while_decoding = False

    def __init__(self, base: GenerateEngine, factor: float):
        self.__dict__.update(base.__dict__)
        self.generation_config = replace_temperature(base.generation_config, base.args.temperature * factor)

    def generate(self, batch, plan):
        sampled = super().generate(batch, replace(plan, read_while_decoding=True, keep_generation_logits=False))
        seq = sampled.sequences
        seq = replace(seq, sampling_logp=torch.where(seq.response_mask.bool(), sampled.generated.logp, 0.0))
        return Sampled(seq, Generation(seq.responses, finite=sampled.generated.finite))


def replace_temperature(config, temperature):
    import copy

    config = copy.deepcopy(config)
    config.temperature = temperature
    return config


def drifted_bandit(tiny_path, tmp_path, factor: float, correction: bool, **overrides):
    settings = {"kl_mode": "reward", "kl_estimator": "k1", **overrides}
    trainer = bandit_trainer(
        tiny_path, tmp_path, experimental={"vllm_importance_sampling_correction": correction}, **settings
    )
    trainer.sampler = DriftingEngine(trainer.sampler, factor)
    return trainer


def kl_readings(trainer, prompts: int = 2048) -> tuple[float, float, float]:
    """`(corrected, plain, exact)`: on one rollout of `prompts` copies of the bandit's prompt, the KL statistic the
    trainer reads (k1 weighted by the truncated ratios), the same k1 unweighted, and KL(pi || ref) in closed form."""

    rollout = trainer.rollout(trainer.prompt_batch([PROMPT] * prompts))
    keep = rollout.response_mask.bool()
    corrected = float(rollout.statistic_kl[keep].mean())
    plain = float(rollout.log_ratio[keep].mean())
    state = one_token_state(trainer)
    return corrected, plain, kl(state["logp"], state["ref"])


@pytest.mark.numerics
@pytest.mark.slow
def test_a_drifting_engine_is_measured_and_its_kl_reading_corrected(tiny_path, tmp_path):
    """An engine that samples at a temperature above the trainer's (`DriftingEngine`, built on generate): the rollout
    is scored with the trainer's forward, the drift is logged on every rollout, and the KL the controller reads is
    the trainer's k1 weighted by min(pi / mu, 3). After 40 updates of the one-token bandit on a 5% drift (the policy
    away from the reference), one rollout from the engine 50% off: the plain reading E_mu[log pi / ref] misses
    KL(pi || ref) (closed form) by more than 0.05 nats, the corrected one by less than half that miss (4096 samples:
    the importance-weighted mean is the noisier one). At 30% off the plain miss was 0.044-0.083 over three draws of
    the tokens, too close to 0.05 for the verdict not to hang on which tokens a host's kernels draw; at 50% off it
    was 0.078-0.097 and the corrected miss at most 0.15 of it, under default and AVX2 kernels alike."""
    trainer = drifted_bandit(tiny_path, tmp_path, 1.05, True, max_steps=40)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sampling/is_ratio_mean" in h]
    assert len(logs) == 40 and all(h["sampling/logp_diff_max"] > 1e-3 for h in logs)  # it drifted on every rollout
    trainer.sampler.generation_config.temperature = trainer.args.temperature * 1.5
    corrected, plain, exact = kl_readings(trainer, prompts=4096)
    assert abs(plain - exact) > 0.05, (corrected, plain, exact)
    assert abs(corrected - exact) < 0.5 * abs(plain - exact), (corrected, plain, exact)


@pytest.mark.numerics
@pytest.mark.slow
def test_the_equilibrium_controllers_estimate_from_a_drifting_engines_batch_is_corrected(tiny_path, tmp_path):
    """The equilibrium controller reads the batch itself: each sequence's score and log-ratio, as importance weights
    toward the optimum at each beta. On a drifting engine's batch those weights are taken under the engine's mu;
    each sequence's truncated ratio `pi / mu` corrects them. After 40 updates of the one-token bandit (beta 0.1, the
    policy away from the reference), one rollout of 4096 responses from an engine 50% hotter: the controller's
    estimate of the beta whose optimum has KL(pi_beta || ref) = that of beta* = 0.5 (exact from the reference's
    logits) is within 3% of beta* with the correction, and more than 5% off without it, on the same rollout.
    Measured (seeds 0-3): corrected 0.993-1.008 beta*, plain 0.917-0.932."""
    from klppo.kl.controllers.equilibrium import EquilibriumKLController
    from klppo.ppo import update

    trainer = drifted_bandit(tiny_path, tmp_path, 1.05, True, max_steps=40, kl_coef=0.1)
    start = one_token_state(trainer)
    target = kl(tilted(start["ref"], start["reward"], BETA), start["ref"])
    trainer.train()
    trainer.sampler.generation_config.temperature = trainer.args.temperature * 1.5
    rollout = trainer.rollout(trainer.prompt_batch([PROMPT] * 4096))
    estimates = {}
    for name, batch in (("corrected", rollout), ("plain", replace(rollout, is_log_weight=None))):
        controller = EquilibriumKLController(kl_coef=BETA, target=target)
        rewards = trainer.compute_rewards(batch)
        penalty = trainer.apply_kl(batch, rewards)
        update.update_controller(
            controller, trainer.kl_guard, None, trainer.kl_plan, batch, rewards, penalty, trainer.accelerator, 1, False
        )
        estimates[name] = math.exp(controller.estimate) / BETA
    assert abs(estimates["corrected"] - 1) < 0.03, estimates
    assert abs(estimates["plain"] - 1) > 0.05, estimates


def test_importance_weights_truncate_per_token_and_per_sequence():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.1, 0.1]]))
    mu = torch.log(torch.tensor([[0.1, 0.4, 0.9], [0.1, 0.2, 0.5]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, ratio, capped = importance_weights(logp, mu, mask, "token_truncate", 3.0)
    assert torch.allclose(w, torch.tensor([[3.0, 0.5, 1.0], [1.0, 0.5, 1.0]]))  # 5 capped at 3; 1 off the mask
    assert capped.tolist() == [[True, False, False], [False, False, False]]
    w, ratio, capped = importance_weights(logp, mu, mask, "sequence_truncate", 3.0)
    assert torch.allclose(w[0], torch.full((3,), 2.5)) and torch.allclose(w[1], torch.tensor([0.5, 0.5, 1.0]))
    assert torch.allclose(ratio[1, :2], torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="token_truncate"):
        importance_weights(logp, mu, mask, "token_mask", 3.0)


def test_the_correction_weights_the_statistic_and_logs_the_drift():
    """The KL statistic and the logged KL are the trainer's, weighted by the truncated ratios; the drift metrics
    are the trainer's log-probs against the engine's; an exact engine's rollout is left as it is."""
    from types import SimpleNamespace

    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    rollout = SimpleNamespace(
        logp=logp,
        sampling_logp=torch.log(torch.tensor([[0.25, 0.4]])),
        response_mask=torch.ones(1, 2),
        statistic_kl=torch.tensor([[1.0, 1.0]]),
        logged_kl=torch.ones(1, 2, 3),
    )
    import dataclasses

    @dataclasses.dataclass
    class R:
        logp: torch.Tensor
        sampling_logp: torch.Tensor
        response_mask: torch.Tensor
        statistic_kl: torch.Tensor
        logged_kl: torch.Tensor
        is_weight: torch.Tensor | None = None
        is_log_weight: torch.Tensor | None = None
        sampling_metrics: dict = dataclasses.field(default_factory=dict)

    out = correct_rollout(R(**vars(rollout)), True, "token_truncate", 3.0)
    assert torch.allclose(out.is_weight, torch.tensor([[2.0, 0.5]]))
    assert torch.allclose(out.statistic_kl, torch.tensor([[2.0, 0.5]]))
    assert torch.allclose(out.logged_kl[..., 1], torch.tensor([[2.0, 0.5]]))
    m = out.sampling_metrics
    assert m["sampling/logp_diff_max"] == pytest.approx(math.log(2)) and m["sampling/is_ratio_min"] == pytest.approx(
        0.5
    )
    assert m["sampling/is_ratio_max"] == pytest.approx(2.0) and m["sampling/is_capped_frac"] == 0
    off = correct_rollout(R(**vars(rollout)), False, "token_truncate", 3.0)
    assert off.is_weight is None and torch.equal(off.statistic_kl, rollout.statistic_kl) and off.sampling_metrics
    exact = R(**{**vars(rollout), "sampling_logp": None})
    assert correct_rollout(exact, True, "token_truncate", 3.0) is exact
    # each sequence's log weight (the equilibrium controller's): log min(prod_t pi / mu, 3) in either mode, padding
    # left out, finite however far a long sequence drifts
    two = R(
        logp=torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.9]])),
        sampling_logp=torch.log(torch.tensor([[0.25, 0.6], [0.1, 0.01]])),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        statistic_kl=torch.ones(2, 2),
        logged_kl=torch.ones(2, 2, 3),
    )
    for mode in ("token_truncate", "sequence_truncate"):
        log_w = correct_rollout(two, True, mode, 3.0).is_log_weight
        assert torch.allclose(log_w, torch.tensor([0.0, math.log(3.0)], dtype=torch.float64), atol=1e-6), mode
    for drift, weight, log_w in ((1.0, 3.0, math.log(3.0)), (-1.0, 0.0, -1000.0)):
        long = R(
            logp=torch.zeros(1, 1000),
            sampling_logp=torch.full((1, 1000), -drift),
            response_mask=torch.ones(1, 1000),
            statistic_kl=torch.ones(1, 1000),
            logged_kl=torch.ones(1, 1000, 3),
        )
        out = correct_rollout(long, True, "sequence_truncate", 3.0)
        assert torch.all(out.is_weight == weight) and math.isfinite(out.sampling_metrics["sampling/is_ratio_max"])
        assert float(out.is_log_weight[0]) == pytest.approx(log_w)


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_the_guards_reading_weights_an_inexact_engines_tokens(unit):
    """`guard_sample` with `is_weight`: every token's KL now (`exp(old) * d`) and at the rollout (`d_rollout`) times
    its weight, as the rollout's statistic is weighted; without weights the plain sums; padding adds nothing."""
    from klppo.ppo.safety.step_checks import guard_sample

    d = torch.tensor([[0.5, -0.2, 0.9], [1.0, 0.3, 7.0]], dtype=torch.float64)
    old = torch.tensor([[0.1, -0.3, 0.0], [0.2, 0.05, 5.0]], dtype=torch.float64)
    before = torch.tensor([[0.4, 0.1, 0.9], [0.8, 0.25, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = torch.tensor([[2.0, 0.5, 1.0], [1.5, 3.0, 9.0]], dtype=torch.float64)
    weighted = guard_sample(d, old, before, mask, unit, w)
    plain = guard_sample(d, old, before, mask, unit)
    m = mask.double()
    assert float(weighted.kl_now) == pytest.approx(float((old.exp() * d * w * m).sum()), rel=1e-12)
    assert float(weighted.kl_rollout) == pytest.approx(float((before * w * m).sum()), rel=1e-12)
    assert float(plain.kl_now) == pytest.approx(float((old.exp() * d * m).sum()), rel=1e-12)
    change = old.exp() * d * w * m - before * w * m
    change = change.sum(dim=1) if unit == "sequence" else change
    assert float(weighted.change_sq) == pytest.approx(float((change * change).sum()), rel=1e-12)
    assert int(weighted.count) == int(plain.count) == (2 if unit == "sequence" else 5)


def test_weighted_advantages_are_centred_under_the_trainers_policy():
    """`weight_advantages`: the advantages minus their self-normalised mean under the trainer's policy (sum w A /
    sum w over the tokens that carry a policy gradient), times w; zero elsewhere; unchanged without weights."""
    from types import SimpleNamespace

    from klppo.ppo.results import Advantages

    a = torch.tensor([[1.0, -2.0, 5.0], [0.5, 3.0, 0.0]])
    w = torch.tensor([[2.0, 0.5, 1.0], [1.0, 3.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    valid = mask * torch.tensor([[1.0], [0.0]])  # the second sequence: no reward function applied
    adv = Advantages(a, a.clone(), 0.1)
    out = weight_advantages(adv, SimpleNamespace(is_weight=w, response_mask=mask), valid).advantages
    mean = (2.0 * 1.0 + 0.5 * -2.0 + 1.0 * 5.0) / (2.0 + 0.5 + 1.0)
    assert torch.allclose(out[0], (a[0] - mean) * w[0]) and torch.equal(out[1], torch.zeros(3))
    assert float((out[0] / w[0]).mul(w[0]).sum()) == pytest.approx(0.0, abs=1e-6)  # centred under w
    assert weight_advantages(adv, SimpleNamespace(is_weight=None, response_mask=mask)) is adv


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.parametrize("kl_mode, estimator, steps, bound", [("reward", "k1", 120, 0.02), ("loss", "k2", 240, 0.002)])
def test_a_drifting_engine_with_the_correction_lands_on_the_optimum(
    tiny_path, tmp_path, kl_mode, estimator, steps, bound
):
    """The one-token bandit sampled by an engine 30% hotter than the trainer, corrected: it lands on pi* = ref
    exp(r / beta) / Z. In the reward, within the `generate` engine's bound (KL(pi || pi*) < 0.02 after 120 updates);
    ablation: weighting the advantages without centring them under the trainer's policy first left it at 0.06-0.14
    (seeds 0 and 1), the centred correction at 0.005-0.009. In the loss, where the KL term carries its own gradient,
    the term is weighted too: after 240 updates the corrected run is at 0.0005-0.0007 (seeds 0-3; on-policy
    0.0005-0.0006), and with the advantages weighted but the KL term not, at 0.0053-0.0066 (seeds 0-3): the two
    terms' expectations were then taken under different distributions. Without any correction this bandit lands as
    well (0.0003-0.0005, seeds 0 and 2): when both terms are expectations under the engine's mu, the fixed point (r - beta log
    pi / ref constant on mu's support) is pi* whatever mu is; the correction's work here is the KL reading the
    controller takes (the test above)."""
    trainer = drifted_bandit(tiny_path, tmp_path, 1.3, True, kl_mode=kl_mode, kl_estimator=estimator, max_steps=steps)
    start = one_token_state(trainer)
    assert kl(start["logp"], tilted(start["ref"], start["reward"], BETA)) > 0.1
    trainer.train()
    assert all(h["sampling/logp_diff_max"] > 1e-2 for h in trainer.state.log_history if "sampling/logp_diff_max" in h)
    end = one_token_state(trainer)
    assert kl(end["logp"], tilted(end["ref"], end["reward"], BETA)) < bound


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="setup.sh vllm"):
        klppo_config(output_dir=str(tmp_path), use_vllm=True)


def test_vllm_fields_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ValueError, match="one engine per training process"):
        klppo_config(output_dir=str(tmp_path), use_vllm=True, experimental={"vllm_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="colocate"):
        klppo_config(output_dir=str(tmp_path), experimental={"vllm_mode": "server"})
    with pytest.raises(ValueError, match="token_truncate"):
        klppo_config(output_dir=str(tmp_path), experimental={"vllm_importance_sampling_mode": "sequence_mask"})


def test_the_vllm_kv_cache_holds_the_whole_local_batch_in_whole_blocks(tmp_path):
    """On a CPU vLLM allocates its KV cache in blocks of 128 tokens, one sequence at least one block: the default
    size holds every sequence of the local batch at the engine's longest length at once (the default job's shape:
    SmolLM2-135M, 32 sequences of up to 64 + 12 tokens). Sized in tokens it held 23 sequences, and the engine
    decoded each batch in two waves."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from klppo.ppo.generation.vllm import CPU_BLOCK_SIZE, VLLMEngine

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    for max_model_len, sequences in ((76, 32), (128, 16), (129, 16), (1100, 4)):
        engine = object.__new__(VLLMEngine)
        engine.args = klppo_config(output_dir=str(tmp_path), experimental={})
        engine.config, engine.max_model_len, engine.max_num_seqs = config, max_model_len, sequences
        block_bytes = 2 * 30 * 3 * 64 * 4 * CPU_BLOCK_SIZE
        blocks = int(engine.kv_cache_mb() * 2**20 // block_bytes)
        # vLLM's block pool keeps one block as a null block
        assert blocks >= sequences * math.ceil(max_model_len / CPU_BLOCK_SIZE) + 1, (max_model_len, sequences, blocks)
    engine.args = SimpleNamespace(experimental=SimpleNamespace(vllm_kv_cache_mb=300))
    assert engine.kv_cache_mb() == 300


def test_the_vllm_engines_longest_sequence_is_what_the_datasets_need(tiny_path, tmp_path):
    """`max_model_length`: the datasets' longest prompt plus `response_length`, with or without
    `max_prompt_length` (without it the engine took the model's whole context, and a CPU's KV cache was sized for
    every sequence at that length); a `vllm_max_model_length` shorter than the datasets need is refused with the
    length needed, a longer one kept; without datasets, the longest prompt the run can take."""
    from datasets import Dataset
    from transformers import LlamaConfig

    from klppo.models import load_tokenizer
    from klppo.ppo.generation.vllm import max_model_length
    from klppo.ppo.prompts import prompt_token_ids

    tokenizer = load_tokenizer(tiny_path)
    prompts = Dataset.from_dict({"prompt": ["The day was", "one two three four five six seven eight nine ten"]})
    longest = max(len(ids) for ids in prompt_token_ids(list(prompts), tokenizer, 64)[1])
    config = LlamaConfig(max_position_embeddings=4096)

    def length(given=None, datasets=(prompts,), **overrides):
        args = klppo_config(
            output_dir=str(tmp_path),
            response_length=8,
            experimental={"vllm_max_model_length": given},
            **overrides,
        )
        return max_model_length(args, config, tokenizer, datasets)

    assert length(max_prompt_length=64) == length(max_prompt_length=None) == longest + 8
    assert length(max_prompt_length=4) == 4 + 8
    assert length(max_prompt_length=None, datasets=(None,)) == 4096
    assert length(max_prompt_length=64, datasets=(None, None)) == 64 + 8
    assert length(given=200, max_prompt_length=None) == 200
    with pytest.raises(ValueError, match=f"vllm_max_model_length is 10.*needs {longest + 8}"):
        length(given=10, max_prompt_length=None)
