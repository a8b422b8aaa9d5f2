"""TRL 1.12's PPO names on klppo: `PPOConfig` and `PPOTrainer`.

TRL removed `trl.experimental.ppo` in trl 1.13. A script written for it runs on klppo after one changed line:

    from trl.experimental.ppo import PPOConfig, PPOTrainer   # before
    from klppo import PPOConfig, PPOTrainer                  # after

`PPOConfig` is a `KLPPOConfig` that accepts every field of TRL 1.12's `PPOConfig` with its meaning and its default;
`PPOTrainer` is a `KLPPOTrainer` with TRL's constructor keywords (`reward_model=`, `value_model=`, `data_collator=`,
`optimizers=` ...), TRL's `generate_completions()` and TRL's metric names. klppo's own fields (the KL controllers,
estimators, guards) are there too: `--kl_target 6 --kl_controller tracking` works in a TRL script.

Metric names. A figure that TRL 1.12 and klppo define the same way is logged once, under TRL's name:
`loss/policy_avg` (klppo: `loss/policy`), `loss/value_avg`, `policy/approxkl_avg`, `policy/clipfrac_avg`,
`policy/entropy_avg`, `val/clipfrac_avg` (`TRL_METRIC_NAMES`). TRL's figures klppo does not log are added:
`objective/kl`, `objective/entropy`, `val/num_eos_tokens`, `episode`, `eps`. A figure whose definition differs
keeps its own name even where the two agree in value: klppo's `kl/k1`, `kl/k2`, `kl/k3` measure each estimator
whatever the configured one, in `kl_target_unit`, and `kl/value` is what the controller reads, while TRL's
`objective/kl` is the configured estimator's sum per sequence; with `kl_estimator="k1"` and sequence units they
agree, as `kl/value` and `kl/k1` already do in klppo.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from transformers import DataCollatorWithPadding, GenerationConfig, TrainingArguments

from .kl import GlobalSums
from .kl.config import doc_metadata, field_docs
from .ppo.config import KLPPOConfig, warn_once
from .ppo.trainer import KLPPOTrainer

logger = logging.getLogger(__name__)

# klppo's name -> TRL 1.12's, for the figures both define the same way (logged under TRL's name only)
TRL_METRIC_NAMES = {
    "loss/policy": "loss/policy_avg",
    "loss/value": "loss/value_avg",
    "policy/approxkl": "policy/approxkl_avg",
    "policy/clipfrac": "policy/clipfrac_avg",
    "policy/entropy": "policy/entropy_avg",
    "val/clipfrac": "val/clipfrac_avg",
}
# TRL 1.12 computed these from the others at run time; a value passed in was overwritten, as here
COMPUTED_FIELDS = (
    "world_size",
    "num_total_batches",
    "micro_batch_size",
    "local_batch_size",
    "batch_size",
    "local_mini_batch_size",
    "mini_batch_size",
)

PPO_CONFIG_DOC = r"""
    Configuration for [`PPOTrainer`]: TRL 1.12's `PPOConfig` on klppo.

    Every field of TRL 1.12's `trl.experimental.ppo.PPOConfig` is accepted with the meaning and the default it had
    there, and so is every field of [`KLPPOConfig`] (KL controllers, estimators, guards, critic layout). Batch
    sizes follow TRL 1.12 exactly: the rollout batch per process is `per_device_train_batch_size *
    gradient_accumulation_steps`, split into `num_mini_batches` mini-batches, one optimizer step each.
    (`KLPPOConfig` counts `gradient_accumulation_steps` per mini-batch instead; `PPOConfig` converts, so after
    construction `gradient_accumulation_steps` holds the micro-batches per mini-batch.)

    Parameters:
        > TRL 1.12 fields with klppo's behaviour

        total_episodes (`int` or `None`, *optional*, defaults to `None`):
            Number of prompts (episodes) to train on; the run makes `ceil(total_episodes / batch_size)` PPO updates,
            `batch_size` being the rollout batch over all processes, as in TRL. `None`: `num_train_epochs` passes
            over the training set (or `max_steps` updates when that is set; TRL ignored `max_steps`, so setting both
            is refused).
        local_rollout_forward_batch_size (`int`, *optional*, defaults to `64`):
            Sequences per no-grad forward pass in the rollout, per process. klppo's name for it is
            `rollout_forward_batch_size`; set either, not both to different values. TRL also generated in batches
            of this size; klppo samples a process's whole rollout batch in one `generate` call (a warning says so
            when this is smaller).
        rollout_forward_batch_size (`int` or `None`, *optional*, defaults to `None`):
            klppo's name of `local_rollout_forward_batch_size`; `None` takes that field's value.
        num_sample_generations (`int`, *optional*, defaults to `10`):
            Number of times over training that `generate_completions(sampling=True)` prints and logs completions of
            the first batch of `eval_dataset` (when there is one), as in TRL; klppo's table of training completions
            is logged as many times.
        stop_token (`str` or `None`, *optional*, defaults to `None`):
            `"eos"`: responses end at the tokenizer's EOS token; `None`: no stop token unless `stop_token_id` is set.
            Mutually exclusive with `stop_token_id`. Without a stop token, responses have `response_length` tokens;
            EOS is never sampled, unless `missing_eos_penalty` is set (then it is sampled as in TRL, see there).
        stop_token_id (`int` or `None`, *optional*, defaults to `None`):
            A stop token given by its id, as in TRL (klppo's own config takes the token's text in `stop_token`).
        missing_eos_penalty (`float` or `None`, *optional*, defaults to `None`):
            Subtracted from the score of a response that does not end with the stop token. Without a stop token,
            as in TRL 1.12 (a warning says what happens): responses have `response_length` tokens, EOS is sampled
            and scored like any other token without ending the response, and a response that contains no EOS token
            anywhere is penalised.
        sft_model_path (`str`, *optional*, defaults to `"EleutherAI/pythia-160m"`):
            Path to the SFT model; read by the script, not the trainer (as in TRL).
        reward_model_path (`str`, *optional*, defaults to `"EleutherAI/pythia-160m"`):
            Path to the reward model; read by the script, not the trainer (as in TRL).
        dataset_num_proc (`int` or `None`, *optional*, defaults to `None`):
            Processes for the script's dataset preparation (`dataset.map(num_proc=...)`); the trainer itself
            tokenizes nothing in bulk.
        exp_name (`str` or `None`, *optional*, defaults to `None`):
            Name of the experiment (older TRL versions): when set and `run_name` is not, the run is named
            `{exp_name}__{seed}__{unix time}`, as those versions did.
        model_adapter_name (`str` or `None`, *optional*, defaults to `None`):
            With a PEFT policy that holds several adapters: the one to train (made active).
        ref_adapter_name (`str` or `None`, *optional*, defaults to `None`):
            With a PEFT policy that holds several adapters: the one that serves as the reference. Unset, a policy
            with a trained adapter gets a frozen copy of it as reference (adapter `"ref"`), and a new adapter from
            `peft_config` gets the policy with its adapter disabled.
        ds3_gather_for_generation (`bool`, *optional*, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the policy's weights for generation. klppo always gathers them, so only
            `True` is accepted.
        bf16 (`bool` or `None`, *optional*, defaults to `None`):
            bf16 mixed precision. `None`: on when a bf16-capable GPU is used and `fp16` is off (TRL 1.12's default
            on a GPU), off on a CPU, where bf16 is slow.
        learning_rate (`float`, *optional*, defaults to `3e-6`):
            TRL 1.12's default.
        logging_steps (`float`, *optional*, defaults to `10`):
            Log every this many PPO updates (TRL 1.12's default).

        > Computed from the others (TRL 1.12 overwrote any value passed; so does klppo)

        world_size (`int` or `None`):
            Number of processes.
        num_total_batches (`int` or `None`):
            Number of PPO updates (set by the trainer, which knows the dataset).
        micro_batch_size (`int` or `None`):
            `per_device_train_batch_size * world_size`.
        local_batch_size (`int` or `None`):
            Rollout batch per process: `per_device_train_batch_size * gradient_accumulation_steps` (as given).
        batch_size (`int` or `None`):
            Rollout batch over all processes: `local_batch_size * world_size`.
        local_mini_batch_size (`int` or `None`):
            Mini-batch per process: `local_batch_size / num_mini_batches`.
        mini_batch_size (`int` or `None`):
            Mini-batch over all processes: `batch_size / num_mini_batches`.

    The other TRL 1.12 fields mean what they meant there and are [`KLPPOConfig`]'s: `num_mini_batches`,
    `response_length`, `stop_token_id`, `temperature`, `num_ppo_epochs`, `whiten_rewards`, `kl_coef`,
    `kl_estimator` (`"k1"`, `"k3"` and klppo's others), `cliprange`, `vf_coef`, `cliprange_value`, `gamma`, `lam`,
    `push_to_hub`. With no `kl_target`, the KL coefficient is fixed and `k1` enters the rewards, as in TRL.
"""

_DOCS = field_docs(PPO_CONFIG_DOC)


def _doc(name: str) -> dict:
    return doc_metadata(_DOCS, name)


@dataclass
class PPOConfig(KLPPOConfig):
    __doc__ = PPO_CONFIG_DOC

    total_episodes: int | None = field(default=None, metadata=_doc("total_episodes"))
    local_rollout_forward_batch_size: int = field(default=64, metadata=_doc("local_rollout_forward_batch_size"))
    rollout_forward_batch_size: int | None = field(default=None, metadata=_doc("rollout_forward_batch_size"))
    num_sample_generations: int = field(default=10, metadata=_doc("num_sample_generations"))
    stop_token: str | None = field(default=None, metadata=_doc("stop_token"))
    stop_token_id: int | None = field(default=None, metadata=_doc("stop_token_id"))
    missing_eos_penalty: float | None = field(default=None, metadata=_doc("missing_eos_penalty"))
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata=_doc("sft_model_path"))
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata=_doc("reward_model_path"))
    dataset_num_proc: int | None = field(default=None, metadata=_doc("dataset_num_proc"))
    exp_name: str | None = field(default=None, metadata=_doc("exp_name"))
    model_adapter_name: str | None = field(default=None, metadata=_doc("model_adapter_name"))
    ref_adapter_name: str | None = field(default=None, metadata=_doc("ref_adapter_name"))
    ds3_gather_for_generation: bool = field(default=True, metadata=_doc("ds3_gather_for_generation"))
    bf16: bool | None = field(default=None, metadata=_doc("bf16"))
    learning_rate: float | None = field(default=3e-6, metadata=_doc("learning_rate"))
    logging_steps: float = field(default=10, metadata=_doc("logging_steps"))
    world_size: int | None = field(default=None, metadata=_doc("world_size"))
    num_total_batches: int | None = field(default=None, metadata=_doc("num_total_batches"))
    micro_batch_size: int | None = field(default=None, metadata=_doc("micro_batch_size"))
    local_batch_size: int | None = field(default=None, metadata=_doc("local_batch_size"))
    batch_size: int | None = field(default=None, metadata=_doc("batch_size"))
    local_mini_batch_size: int | None = field(default=None, metadata=_doc("local_mini_batch_size"))
    mini_batch_size: int | None = field(default=None, metadata=_doc("mini_batch_size"))

    def __post_init__(self):
        self._resolve_trl_fields()
        super().__post_init__()
        self.world_size = TrainingArguments.world_size.fget(self)
        self.micro_batch_size = self.per_device_train_batch_size * self.world_size
        self.batch_size = self.local_batch_size * self.world_size
        self.mini_batch_size = self.batch_size // self.num_mini_batches

    def _resolve_trl_fields(self) -> None:
        if self.rollout_forward_batch_size is None:
            self.rollout_forward_batch_size = self.local_rollout_forward_batch_size
        elif self.local_rollout_forward_batch_size == 64:  # TRL's default: klppo's name was the one set
            self.local_rollout_forward_batch_size = self.rollout_forward_batch_size
        elif self.rollout_forward_batch_size != self.local_rollout_forward_batch_size:
            raise ValueError(
                f"`local_rollout_forward_batch_size`={self.local_rollout_forward_batch_size} and "
                f"`rollout_forward_batch_size`={self.rollout_forward_batch_size} name the same setting (TRL's and "
                "klppo's name for the sequences per rollout forward pass). Set only one of them."
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError(
                f"`stop_token`={self.stop_token!r} and `stop_token_id`={self.stop_token_id} are mutually exclusive "
                "(as in TRL): set `stop_token='eos'` to stop at the tokenizer's EOS token, or `stop_token_id` to stop "
                "at another token."
            )
        if not self.ds3_gather_for_generation:
            raise ValueError(
                "`ds3_gather_for_generation=False` is not supported: klppo always gathers the policy's ZeRO-3 "
                "weights for generation. For a policy too large for one GPU, train a LoRA adapter (`peft_config`) "
                "or use FSDP; otherwise leave `ds3_gather_for_generation` at True."
            )
        if self.total_episodes is not None:
            if self.total_episodes < 1:
                raise ValueError(f"`total_episodes` must be >= 1 (prompts to train on), got {self.total_episodes}.")
            if self.max_steps > 0:
                raise ValueError(
                    f"`total_episodes`={self.total_episodes} and `max_steps`={self.max_steps} both set the length of "
                    "the run. TRL 1.12 read `total_episodes` (ceil(total_episodes / batch_size) updates) and ignored "
                    "`max_steps`; set one of them: `total_episodes` in prompts, or `max_steps` in PPO updates."
                )
        if self.bf16 is None:
            self.bf16 = bool(
                not self.fp16 and not self.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            )
        if self.exp_name and self.run_name is None:
            self.run_name = f"{self.exp_name}__{self.seed}__{int(time.time())}"
        self._convert_batch_sizes()
        self._warn_trl_differences()

    def _warn_trl_differences(self) -> None:
        """Once per process: where a TRL 1.12 flag given here makes klppo do something else than TRL did."""
        rollout = self.local_batch_size
        if rollout is not None and self.local_rollout_forward_batch_size < rollout:
            warn_once(
                "local_rollout_forward_batch_size",
                f"local_rollout_forward_batch_size={self.local_rollout_forward_batch_size} sets the sequences per "
                "scoring forward pass; TRL also generated in batches of that size, while klppo samples the whole "
                f"rollout batch of a process ({rollout} sequences) in one generate call.",
            )
        if str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            warn_once(
                "eval_strategy",
                f"eval_strategy={getattr(self.eval_strategy, 'value', self.eval_strategy)!r}: klppo evaluates every "
                f"eval_steps={self.eval_steps or self.logging_steps} updates (eval/perplexity on held-out text, "
                "eval/scores on eval_dataset's prompts); TRL 1.12's PPOTrainer evaluated nothing (its scripts read "
                "eval_strategy only to load eval_dataset).",
            )

    def _convert_batch_sizes(self) -> None:
        """TRL's rollout batch per process is `per_device_train_batch_size * gradient_accumulation_steps`, split
        into `num_mini_batches`; klppo's mini-batch is `per_device_train_batch_size * gradient_accumulation_steps`.
        Stores klppo's `gradient_accumulation_steps` (micro-batches per mini-batch). Converting a converted config
        again (`dataclasses.replace`, a saved config) changes nothing: `local_batch_size` records TRL's value."""
        micro, accumulation, n_mini = (
            self.per_device_train_batch_size,
            self.gradient_accumulation_steps,
            self.num_mini_batches,
        )
        if n_mini < 1 or micro < 1 or accumulation < 1:
            return  # KLPPOConfig's checks name the field
        if (
            self.local_batch_size == micro * accumulation * n_mini
            and self.local_mini_batch_size == micro * accumulation
        ):
            return  # already converted
        rollout = micro * accumulation
        if rollout % n_mini:
            raise ValueError(
                f"The rollout batch per process, per_device_train_batch_size * gradient_accumulation_steps = {micro} * "
                f'{accumulation} = {rollout}, is not a multiple of num_mini_batches={n_mini} (TRL: "`local_batch_size` '
                'must be a multiple of `num_mini_batches`"). Change gradient_accumulation_steps or num_mini_batches.'
            )
        mini = rollout // n_mini
        if mini % micro == 0:
            self.gradient_accumulation_steps = mini // micro
        elif mini < micro:
            self.per_device_train_batch_size, self.gradient_accumulation_steps = mini, 1
        else:
            raise ValueError(
                f"A mini-batch of {mini} sequences per process (rollout batch {rollout} / num_mini_batches {n_mini}) "
                f"does not split into micro-batches of per_device_train_batch_size={micro}. Choose "
                "gradient_accumulation_steps as a multiple of num_mini_batches."
            )
        self.local_batch_size, self.local_mini_batch_size = rollout, mini

    def num_updates(self, dataset_size: int, world_size: int) -> int:
        """PPO updates: `ceil(total_episodes / batch_size)` when `total_episodes` is set (TRL 1.12), else
        `KLPPOConfig.num_updates`."""
        if self.total_episodes is not None:
            return max(1, math.ceil(self.total_episodes / (self.local_rollout_batch_size * world_size)))
        return super().num_updates(dataset_size, world_size)


class PPOTrainer(KLPPOTrainer):
    """TRL 1.12's `PPOTrainer` on klppo: its constructor, methods and metric names.

    Args (in TRL's order, so positional calls work too):
        args: a [`PPOConfig`] (a [`KLPPOConfig`] works too).
        processing_class: the policy's tokenizer (loaded from `model` when it is a path and this is None).
        model: the policy: a causal LM, a PEFT model (its reference is then a frozen copy of its adapter, or
            `args.ref_adapter_name`), or a path / hub id.
        ref_model: the frozen reference; None as in [`KLPPOTrainer`].
        reward_model: a sequence-classification model with one output (or its path). Given as a model, it is
            taken to share the policy's tokenizer, as TRL did, and scores the policy's token ids directly; given
            as a path, it does so when its tokenizer has the policy's vocabulary, else it re-tokenizes the text.
        train_dataset: prompts: pre-tokenized `input_ids` (TRL's scripts), or a `prompt` column.
        value_model: the critic: a sequence-classification model (TRL), a causal LM, a path, or the `value_model/`
            folder an earlier run saved. None: built per `args.critic_init`.
        data_collator: None or a `DataCollatorWithPadding` (TRL's default): klppo left-pads the prompts itself.
        eval_dataset: prompts for `generate_completions()` and `eval/scores`.
        optimizers: `(optimizer, lr_scheduler)`; the optimizer must hold the trainable parameters of
            `trainer.model` (policy and critic), so it is usually built after the trainer, or left None. The
            scheduler steps once per optimizer step.
        callbacks: extra `TrainerCallback`s.
        peft_config: a `peft.PeftConfig` for a new adapter on `model`.
        reward_funcs: klppo's reward functions, added to `reward_model` (see [`KLPPOTrainer`]).
        heldout_texts: texts for `eval/perplexity` (see [`KLPPOTrainer`]).
    """

    _tag_names = ["klppo", "ppo", "trl"]

    def __init__(
        self,
        args: KLPPOConfig | None = None,
        processing_class=None,
        model=None,
        ref_model=None,
        reward_model=None,
        train_dataset=None,
        value_model=None,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config=None,
        reward_funcs=None,
        heldout_texts: list[str] | None = None,
    ):
        args = args if args is not None else PPOConfig(output_dir="klppo-output")
        if model is None:
            raise ValueError(
                "PPOTrainer needs `model`: the policy, as a model or a path / hub id (e.g. args.sft_model_path)."
            )
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object (as in TRL): pass a copy, or None for a frozen copy "
                "of the policy made by the trainer (with PEFT, the policy with its adapter disabled)."
            )
        if data_collator is not None and not isinstance(data_collator, DataCollatorWithPadding):
            raise ValueError(
                f"`data_collator` {type(data_collator).__name__} is not supported: klppo builds each prompt batch itself "
                "(left-padded `input_ids` and attention mask, and the decoded prompts for the reward functions), which "
                "is what TRL's default DataCollatorWithPadding did. Prepare any other columns in the dataset "
                "(`dataset.map`) and pass data_collator=None."
            )
        model_adapter = getattr(args, "model_adapter_name", None)
        if model_adapter is not None:
            if model_adapter not in getattr(model, "peft_config", {}):
                raise ValueError(
                    f"`model_adapter_name`={model_adapter!r} names no adapter of the policy (adapters: "
                    f"{sorted(getattr(model, 'peft_config', {}))}). Pass a PEFT model that holds it, or unset it."
                )
            model.set_adapter(model_adapter)
        processing_class = self._fit_pad_token(model, processing_class)
        specs = [] if reward_model is None else [self._reward_model_function(reward_model, processing_class)]
        if reward_funcs is not None:
            specs += list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not specs:
            raise ValueError(
                "PPOTrainer needs `reward_model` (a sequence-classification model or its path) or `reward_funcs`."
            )
        super().__init__(
            model=model,
            args=args,
            processing_class=processing_class,
            reward_funcs=specs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            ref_model=ref_model,
            value_model=value_model,
            peft_config=peft_config,
            callbacks=callbacks,
            heldout_texts=heldout_texts,
        )
        self.optimizer, self.lr_scheduler = optimizers
        num_updates = self.args.num_updates(len(self.train_dataset), self.accelerator.num_processes)
        if isinstance(self.args, PPOConfig):
            self.args.num_total_batches = num_updates
            if self.args.total_episodes is None and self.args.max_steps <= 0:  # TRL: epochs over the dataset
                self.args.total_episodes = int(self.args.num_train_epochs * len(self.train_dataset))
        n = self.args.num_sample_generations
        self.sample_generations_freq = max(1, num_updates // n) if n > 0 else 0
        self._train_start = None

    @staticmethod
    def _fit_pad_token(model, tokenizer):
        """The tokenizer to train with. TRL's scripts add a `[PAD]` token without resizing the model (pythia's
        embedding has spare rows), and TRL replaced pad ids by 0 before every forward pass. klppo embeds the pad id at
        masked positions, so a pad id past the policy's embedding pads with EOS instead, in a copy of the tokenizer
        (the caller's stays as it was): the positions are masked either way."""
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if tokenizer is None or embeddings is None or tokenizer.pad_token_id is None:
            return tokenizer
        if tokenizer.pad_token_id >= embeddings.num_embeddings and tokenizer.eos_token is not None:
            logger.warning(
                "The pad token %r (id %d) is outside the policy's %d embeddings: padding with the EOS token %r "
                "instead (padded positions are masked, so training is the same).",
                tokenizer.pad_token,
                tokenizer.pad_token_id,
                embeddings.num_embeddings,
                tokenizer.eos_token,
            )
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    @staticmethod
    def _reward_model_function(reward_model, processing_class):
        """TRL's `reward_model`: a model shares the policy's tokenizer (token ids scored directly)."""
        from .rewards import RewardModelFunction

        if isinstance(reward_model, torch.nn.Module) and processing_class is not None:
            return RewardModelFunction(reward_model, tokenizer=processing_class, token_ids=True)
        return reward_model  # a path, or a model whose tokenizer is found when the policy's is known

    # ------------------------------------------------------------------ TRL's figures
    def apply_kl(self, rollout, rewards):
        """`KLPPOTrainer.apply_kl`, plus TRL's figures of the rollout: `objective/kl` (the configured estimator's
        sum per sequence, averaged over sequences), `objective/entropy` (the sampled tokens' `-log pi` summed per
        sequence) and `val/num_eos_tokens` (EOS tokens in the responses of all processes)."""
        penalty = super().apply_kl(rollout, rewards)
        mask = rollout.response_mask.to(rollout.logp.dtype)
        n_seq, acc = mask.shape[0], self.accelerator
        stats = GlobalSums()
        stats.add("objective/kl", (rollout.kl * mask).sum(), n_seq)
        stats.add("objective/entropy", (-rollout.logp * mask).sum(), n_seq)
        eos = (rollout.responses == self.processing_class.eos_token_id) & rollout.response_mask.bool()
        stats.add("val/num_eos_tokens", eos.sum(), 1.0 / acc.num_processes)  # counts add up to 1: a global sum
        penalty.metrics.update(stats.means(acc))
        return penalty

    def ppo_update(self, batch):
        metrics = super().ppo_update(batch)
        freq = self.sample_generations_freq
        if freq and self.eval_prompts is not None and self.state.global_step % freq == 0:
            self.generate_completions(sampling=True)
        return metrics

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._train_start = time.time()
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log under TRL's names (`TRL_METRIC_NAMES`); an update's logs also get TRL's `episode` (prompts trained
        on so far) and `eps` (episodes per second)."""
        logs = {TRL_METRIC_NAMES.get(k, k): v for k, v in logs.items()}
        if "objective/kl" in logs:
            episode = self.state.global_step * self.args.local_rollout_batch_size * self.accelerator.num_processes
            logs["episode"] = episode
            if self._train_start is not None:
                logs["eps"] = int(episode / max(time.time() - self._train_start, 1e-9))
        super().log(logs, start_time)

    # ------------------------------------------------------------------ TRL's methods
    def setup_optimisation(self, num_updates: int | None = None) -> None:
        """Prepare an optimizer given as `optimizers=` (else create one, as `KLPPOTrainer` does)."""
        if self.optimizer is None or self.model_wrapped is not self.model:
            return super().setup_optimisation(num_updates)
        num_updates = self.num_updates() if num_updates is None else num_updates
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in held]
        if missing:
            logger.warning(
                "The optimizer given does not hold %d trainable parameters (%s...); they will not train.",
                len(missing),
                ", ".join(missing[:3]),
            )
        if self.lr_scheduler is None:
            steps = num_updates * self.args.num_ppo_epochs * self.args.num_mini_batches
            self.create_scheduler(num_training_steps=steps, optimizer=self.optimizer)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False):
        """Greedy completions of `eval_dataset`'s prompts (its first batch of `per_device_eval_batch_size`
        prompts per process with `sampling=True`), truncated at the stop token and scored by the reward
        functions, as TRL's `generate_completions`. Prints the first five rows (with `rich`), logs the table to
        wandb when it reports there, and returns it as a `pandas.DataFrame` with columns `query`,
        `model response` and `score` (None without `eval_dataset`)."""
        import pandas as pd
        from accelerate.utils import gather_object

        from .ppo.generation.sampling import truncate_at_stop
        from .ppo.results import Sequences

        if self.eval_prompts is None:
            return None
        acc, size = self.accelerator, self.args.per_device_eval_batch_size
        rows = self.eval_prompts.shard(num_shards=acc.num_processes, index=acc.process_index, contiguous=True)
        generation_config = GenerationConfig(
            max_new_tokens=self.args.response_length,
            do_sample=False,
            pad_token_id=self.processing_class.pad_token_id,
            eos_token_id=[] if self.sampler.stop_token_id is None else self.sampler.stop_token_id,
            suppress_tokens=None if self.sampler.suppressed_ids is None else self.sampler.suppressed_ids.tolist(),
        )
        table = {"query": [], "model response": [], "score": []}
        for start in range(0, len(rows) - size + 1, size):  # whole batches, as TRL's eval loader (drop_last)
            batch = self.prompt_batch(list(rows.select(range(start, start + size))))
            input_ids, attention_mask = batch.input_ids.to(acc.device), batch.attention_mask.to(acc.device)
            with self.sampler.unwrapped(self.model_wrapped) as unwrapped:
                out = unwrapped.policy.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
                )
            responses, mask = truncate_at_stop(
                out[:, input_ids.shape[1] :], self.sampler.stop_token_id, self.processing_class.pad_token_id
            )
            sequences = Sequences(
                prompts=batch.prompts,
                extra=batch.extra,
                query_responses=torch.cat([input_ids, responses], 1),
                attention_mask=torch.cat([attention_mask, mask], 1),
                responses=responses,
                response_mask=mask,
                context_length=input_ids.shape[1],
            )
            rewards = self.compute_rewards(sequences)
            table["query"] += gather_object([str(p) for p in batch.prompts])
            table["model response"] += gather_object(rewards.completions)
            table["score"] += gather_object(rewards.scores.tolist())
            if sampling:
                break
        df = pd.DataFrame(table)
        if self.is_world_process_zero():
            try:
                from trl.trainer.utils import print_prompt_completions_sample

                head = df.head(5)
                print_prompt_completions_sample(
                    head["query"].tolist(),
                    head["model response"].tolist(),
                    {"score": head["score"].tolist()},
                    None,
                    self.state.global_step,
                )
            except ImportError:  # without `rich`
                logger.info("%s", df.head(5))
            if "wandb" in (self.args.report_to or []):
                import wandb

                if wandb.run is not None:
                    wandb.log({"completions": wandb.Table(dataframe=df)})
        return df

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs):
        """Transformers' model card; TRL's `dataset_name` (as in `push_to_hub(dataset_name=...)`) names the
        dataset."""
        if dataset_name is not None:
            kwargs.setdefault("dataset", dataset_name)
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        return super().create_model_card(model_name=model_name, tags=tags + self._tag_names, **kwargs)
