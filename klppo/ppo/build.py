"""What `KLPPOTrainer` is built from: checked inputs, the policy, its reference and its critic, the reward functions
and models, and how they are prepared (frozen models under each engine, activation checkpointing)."""

from __future__ import annotations

import copy
import logging
import os
import warnings

from torch import nn
from trl.trainer.utils import disable_dropout_in_model

from ..models import ensure_pad_token, load_causal_lm, load_tokenizer
from .actor_critic import ActorCritic, CriticModel, ValueHead, hidden_size_of
from .config import KLPPOConfig

logger = logging.getLogger(__name__)


def check_trainer_inputs(args: KLPPOConfig | None, train_dataset, reward_funcs, eval_dataset=None) -> KLPPOConfig:
    """The config to use (a default one for None); errors that name the fix for missing, empty or mistyped inputs."""
    if args is None:
        args = KLPPOConfig(output_dir="klppo-output")
    if not isinstance(args, KLPPOConfig):
        raise TypeError(f"`args` must be a KLPPOConfig, got {type(args).__name__}.")
    if train_dataset is None:
        raise ValueError("KLPPOTrainer needs a `train_dataset` with a `prompt` column (or pre-tokenized `input_ids`).")
    check_prompt_dataset("train_dataset", train_dataset)
    if eval_dataset is not None:
        check_prompt_dataset("eval_dataset", eval_dataset)
    if reward_funcs is None:
        raise ValueError("KLPPOTrainer needs `reward_funcs`: a callable, a reward model, or a path to one.")
    return args


def as_prompt_dataset(data):
    """A list of prompts (text or conversations) or of rows (dicts with a `prompt`) as a `datasets.Dataset`; anything
    else as it is."""
    if not isinstance(data, (list, tuple)):
        return data
    from datasets import Dataset

    if data and all(isinstance(row, dict) and ("prompt" in row or "input_ids" in row) for row in data):
        return Dataset.from_list(list(data))
    return Dataset.from_dict({"prompt": list(data)})


def check_prompt_dataset(name: str, dataset) -> None:
    """`dataset` is a `datasets.Dataset` with a non-empty `prompt` column (text, or conversations: lists of messages)
    or an `input_ids` column (token ids); else an error that names the fix."""
    from datasets import Dataset, DatasetDict

    if isinstance(dataset, DatasetDict):
        raise TypeError(
            f"`{name}` is a DatasetDict with splits {list(dataset)}: pass one split, e.g. dataset['train']."
        )
    if not isinstance(dataset, Dataset):
        raise TypeError(
            f"`{name}` must be a datasets.Dataset, got {type(dataset).__name__}: build one with "
            "`Dataset.from_dict({'prompt': prompts})` (an IterableDataset is not supported: a run counts its prompts)."
        )
    column = next((c for c in ("prompt", "input_ids") if c in dataset.column_names), None)
    if column is None:
        raise ValueError(
            f"`{name}` needs a `prompt` column (text or conversations) or an `input_ids` column (token ids); "
            f"it has {dataset.column_names}. Rename the prompt column with `dataset.rename_column(old, 'prompt')`."
        )
    rows = dataset[column]
    bad = (
        next(((i, p) for i, p in enumerate(rows) if not isinstance(p, (str, list))), None)
        if column == "prompt"
        else None
    )
    if bad is not None:
        raise ValueError(
            f"`{name}`'s prompts must be text or conversations (lists of messages); row {bad[0]} holds "
            f"{type(bad[1]).__name__} {bad[1]!r}."
        )
    if len(dataset) == 0 or not any(len(p) for p in rows):
        raise ValueError(f"`{name}` has no non-empty prompt ({len(dataset)} rows): PPO needs prompts to continue.")


def load_policy_and_tokenizer(model, processing_class=None):
    """`(model, path, tokenizer)`: the policy (loaded when given as a path), the path it came from (or None)
    and its tokenizer, left-padded with a pad token (a copy of the one given, when that needs either)."""
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(model, str):
        model = load_causal_lm(model)
    given = processing_class is not None
    if processing_class is None:
        if not path:
            raise ValueError("Pass `processing_class` (the tokenizer) when `model` is not a path.")
        processing_class = load_tokenizer(path)
    if not hasattr(processing_class, "pad_token"):
        raise TypeError(f"`processing_class` must be the policy's tokenizer, got {type(processing_class).__name__}.")
    if hasattr(model, "peft_config") and not hasattr(model, "get_base_model"):
        raise ValueError(
            "The policy carries an adapter that transformers loaded (not a peft PeftModel). Pass the adapter folder's "
            "path as `model`, or load it with peft: `PeftModel.from_pretrained(base_model, folder, is_trainable=True)`."
        )
    if not hasattr(model, "generate") or not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"The policy must be a causal LM (it samples text), got {type(model).__name__}.")
    if given and (processing_class.pad_token is None or processing_class.padding_side != "left"):
        processing_class = copy.deepcopy(processing_class)  # the caller's tokenizer stays as it was
    ensure_pad_token(processing_class, path or "the policy")
    embeddings = model.get_input_embeddings()
    embeddings = getattr(embeddings, "base_layer", embeddings)  # a LoRA-wrapped embedding
    vocab = getattr(embeddings, "num_embeddings", None) or embeddings.weight.shape[0]  # ZeRO-3: the weight is empty
    if processing_class.pad_token_id >= vocab:
        raise ValueError(
            f"The tokenizer's pad token {processing_class.pad_token!r} (id {processing_class.pad_token_id}) lies "
            f"outside the policy's {vocab} embeddings. Use the end-of-sequence token for padding "
            "(`tokenizer.pad_token = tokenizer.eos_token`), or grow the embeddings "
            "(`model.resize_token_embeddings(len(tokenizer))`)."
        )
    processing_class.padding_side = "left"
    return model, path or None, processing_class


def build_models(
    model,
    given_path: str | None,
    args: KLPPOConfig,
    ref_model,
    value_model,
    peft_config,
    reward_funcs,
    ref_adapter_name: str | None = None,
):
    """`(actor_critic, ref_model, use_adapter_reference, ref_adapter_name)`; `given_path` is the policy's path when
    it was given as one.

    The reference is `ref_model` (a module or a path), else the policy with its adapter disabled when
    `peft_config` is given (no second copy in memory; a fresh adapter starts as the identity), else, for a
    policy that already carries a trained PEFT adapter, the policy with a frozen copy of that adapter active
    (adapter `"ref"`, or the adapter named `ref_adapter_name`), else a frozen copy of the initial policy. A
    separate critic initialised from the policy starts from the weights passed in (copied before any adapter is
    added), or from the policy's path. Dropout is off in every model. `ref_adapter_name` in the result is the
    adapter the reference runs with, None for "adapters disabled".
    """
    critic_start = None
    if args.critic_free:
        logger.info(
            "advantage_estimator='%s' needs no critic: none is built or trained (critic=%r%s ignored).",
            args.advantage_estimator,
            args.critic,
            ", value_model" if value_model is not None else "",
        )
    elif args.critic == "separate" and value_model is None and args.critic_init == "policy":
        if hasattr(model, "peft_config"):  # the policy's weights as they are: its adapter merged into a plain copy
            critic_start = copy_model(model).merge_and_unload().requires_grad_(True)
        else:
            critic_start = given_path or copy_model(model)
    if ref_model is not None and ref_model is model:
        raise ValueError(
            "`ref_model` is the policy itself: the reference would move with it (and freezing it would freeze the "
            "policy). Leave `ref_model` unset (klppo keeps a frozen copy of the initial policy) or pass a copy "
            "(`copy.deepcopy(model)`)."
        )
    use_adapter_reference = False
    if peft_config is not None:
        from peft import get_peft_model

        if hasattr(model, "peft_config"):
            raise ValueError(
                "The policy already carries a PEFT adapter and a `peft_config` was given too. To go on training the "
                "adapter it has, pass the model without `peft_config` (its reference is then a frozen copy of that "
                "adapter); to train a new adapter on top, merge the old one first (`model.merge_and_unload()`)."
            )
        use_adapter_reference = ref_model is None
        with warnings.catch_warnings():  # peft reads the name transformers 5.20 deprecated; not the user's setting
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(model, peft_config)
    elif ref_model is None and hasattr(model, "peft_config"):
        use_adapter_reference = True
        ref_adapter_name = reference_adapter(model, ref_adapter_name)
    elif ref_model is None:
        ref_model = copy_model(model)
    if isinstance(ref_model, str):
        ref_model = load_causal_lm(ref_model)
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
    if args.critic_free:
        actor_critic = ActorCritic(model)
    elif args.critic == "shared":
        if value_model is not None:
            raise ValueError("`value_model` is for critic='separate'; critic='shared' puts a head on the policy.")
        head = ValueHead(hidden_size_of(model.config))
        actor_critic = ActorCritic(model, value_head=head, detach_value_input=args.experimental.shared_critic_detach)
    else:
        actor_critic = ActorCritic(model, critic=build_critic(value_model, args, critic_start, reward_funcs))
    for module in (actor_critic, ref_model):
        if module is not None:
            disable_dropout_in_model(module)
    return actor_critic, ref_model, use_adapter_reference, ref_adapter_name if use_adapter_reference else None


REFERENCE_ADAPTER = "ref"


def reference_adapter(model, ref_adapter_name: str | None = None) -> str:
    """The adapter that serves as the reference of a PEFT `model` whose active adapter is already trained: the
    adapter `ref_adapter_name` when given (it must be loaded), else a frozen copy of the active adapter, added as
    `"ref"` (as TRL's GRPO does). Disabling the adapter instead would make the reference the base model, not
    the policy the run starts from. The active adapter is made trainable (PEFT loads adapters frozen)."""
    active = model.active_adapter
    if ref_adapter_name is not None:
        if ref_adapter_name not in model.peft_config:
            raise ValueError(
                f"`ref_adapter_name`={ref_adapter_name!r} is not an adapter of the policy (it has "
                f"{sorted(model.peft_config)}). Load it first (`model.load_adapter(path, adapter_name=...)`), or "
                "leave `ref_adapter_name` unset to use a frozen copy of the active adapter."
            )
    else:
        ref_adapter_name = REFERENCE_ADAPTER
        if ref_adapter_name in model.peft_config:
            raise ValueError(
                f"The policy already has an adapter named {ref_adapter_name!r}; pass `ref_adapter_name="
                f"{ref_adapter_name!r}` to use it as the reference, or rename it."
            )
        model.add_adapter(ref_adapter_name, model.peft_config[active])
        params = dict(model.named_parameters())
        for name, param in params.items():
            if f".{active}." in name:
                params[name.replace(f".{active}.", f".{ref_adapter_name}.")].data.copy_(param.data)
    model.set_adapter(active)  # trainable, and the only active one
    for name, param in model.named_parameters():
        if f".{ref_adapter_name}." in name:
            param.requires_grad_(False)
    return ref_adapter_name


def copy_model(model: nn.Module) -> nn.Module:
    """A copy of `model`'s weights as a new module. Under DeepSpeed ZeRO-3 the weights are partitioned across ranks
    (a deep copy would copy empty placeholders): the copy is built partitioned too, by `from_config` under
    ZeRO-3's init, and each weight is gathered to fill it."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not (is_deepspeed_zero3_enabled() and any(hasattr(p, "ds_id") for p in model.parameters())):
        return copy.deepcopy(model)
    import deepspeed
    import torch

    twin = type(model)._from_config(model.config, dtype=next(model.parameters()).dtype)
    source = dict(model.named_parameters())
    for name, param in twin.named_parameters():
        with deepspeed.zero.GatheredParameters([source[name], param], modifier_rank=0), torch.no_grad():
            param.copy_(source[name])
    return twin


def prepare_frozen(module: nn.Module, accelerator, deepspeed: bool, fsdp: bool) -> nn.Module:
    """A frozen model (reference, reward model) placed beside the policy: on `accelerator`'s device, or sharded like
    it under DeepSpeed ZeRO-3 / FSDP (TRL's `prepare_deepspeed` / `prepare_fsdp`)."""
    module.eval().requires_grad_(False)
    if deepspeed:
        from trl.models.utils import prepare_deepspeed

        return prepare_deepspeed(module, accelerator)
    if fsdp:
        from trl.models.utils import prepare_fsdp

        return prepare_fsdp(module, accelerator)
    return module.to(accelerator.device)


def build_critic(value_model, args: KLPPOConfig, policy_start, reward_funcs) -> nn.Module:
    """A separate critic: `value_model` (a module or a path), else per `critic_init`; `policy_start` is the
    policy's path or a copy of its initial weights (for `critic_init="policy"`)."""
    if isinstance(value_model, nn.Module):
        return value_model if isinstance(value_model, CriticModel) else CriticModel.from_model(value_model)
    if value_model is not None and CriticModel.is_saved_critic(value_model):
        return CriticModel.from_pretrained(value_model)  # a critic saved by an earlier run
    source = value_model or args.critic_init
    if source == "policy":
        if isinstance(policy_start, nn.Module):
            return CriticModel.from_model(policy_start)
        source = policy_start
    elif source == "reward":
        reward_fn = next((f for f in reward_funcs if hasattr(f, "model")), None)
        if reward_fn is None:
            raise ValueError("critic_init='reward' needs a reward model among `reward_funcs`.")
        check_critic_reads_policy_tokens(reward_fn)
        return CriticModel.from_model(copy_model(reward_fn.model).requires_grad_(True))  # the reward model is frozen
    return CriticModel.from_model(load_critic_backbone(source))


def load_critic_backbone(source: str) -> nn.Module:
    """The model at `source` for a critic: a sequence classifier (a reward model) keeps its class and head, as a
    module given as `value_model` would; anything else loads as a causal LM."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from ..models import resolve_model_path

    path = resolve_model_path(source)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a LoRA folder: its base with the adapter merged
        return load_causal_lm(path).merge_and_unload().requires_grad_(True)
    architectures = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return AutoModelForSequenceClassification.from_pretrained(path, dtype="float32")
    return load_causal_lm(source)


def check_critic_reads_policy_tokens(reward_fn) -> None:
    """A critic started from a reward model reads the POLICY's token ids, one value per position from the tokens
    before it: the reward model must share the policy's vocabulary and attend causally. Anything else is refused
    in one paragraph that names the fix."""
    flags = [m.is_causal for m in reward_fn.model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    causal = bool(flags) and all(flags)  # transformers' attention modules say whether they mask the future
    shared = bool(getattr(reward_fn, "token_ids", False))  # set when its vocabulary is the policy's
    if not (causal and shared):
        why = (
            "its tokenizer's vocabulary differs from the policy's"
            if not shared
            else (
                f"{type(reward_fn.model).__name__} is not a causal (decoder-only) model: its values would see later tokens"
            )
        )
        raise ValueError(
            f"critic_init='reward' cannot start the critic from this reward model: {why}. The critic scores the "
            "policy's own token ids at every response position. Use critic_init='policy' (the default), "
            "critic='shared', or a reward model of the policy's family (same tokenizer), or pass value_model=."
        )


def enable_activation_checkpointing(actor_critic, args):
    """Turn on activation checkpointing when the arguments ask for it (transformers >= 5.20 names it activation
    checkpointing; earlier versions have only the gradient_* fields), and take the flags off `args`, the trainer's own
    copy (`KLPPOConfig.for_model`), so that Trainer does not do it again. Returns the kwargs it was turned on with
    (None: off), which generation needs to turn it back on after decoding."""
    if not (getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing):
        return None
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
    actor_critic.activation_checkpointing_enable(kwargs)
    args.gradient_checkpointing = False
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = False
    return kwargs


def prepare_frozen_models(ref_model, reward_funcs, accelerator, deepspeed: bool, fsdp: bool):
    """Frozen models live beside the policy (sharded under ZeRO-3 / FSDP): the reference, returned, and the reward
    models inside `reward_funcs`, prepared in place."""
    for fn in reward_funcs:
        if isinstance(getattr(fn, "model", None), nn.Module):
            fn.model = prepare_frozen(fn.model, accelerator, deepspeed=deepspeed, fsdp=fsdp)
    return prepare_frozen(ref_model, accelerator, deepspeed=deepspeed, fsdp=fsdp) if ref_model is not None else None


def load_rewards(reward_funcs, args, policy_tokenizer):
    """`(functions, weights, names)` of the trainer's `reward_funcs` (one or a list of callables, models or paths),
    weighted by `args.reward_weights`, each name unique (`klppo.rewards`)."""
    from ..rewards import load_reward_funcs, reward_func_name, unique_names

    specs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    funcs, weights = load_reward_funcs(specs, args.reward_weights, policy_tokenizer=policy_tokenizer)
    return funcs, weights, unique_names([reward_func_name(f) for f in funcs])
