"""Reward functions from specs: callables, built-in names, ``module:function``, reward models."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Sequence

from .lexical import long_word_reward
from .lists import list_items_reward
from .sentiment import positive_sentiment_reward

BUILTIN_REWARDS: dict[str, Callable] = {
    "klppo:sentiment": positive_sentiment_reward,
    "klppo:long-words": long_word_reward,
    "klppo:list-items": list_items_reward,
}

VALID_FORMS = (
    "a reward spec is one of: a Python callable fn(prompts, completions, completion_ids=None, **kwargs) "
    f"-> list[float]; a built-in name ({', '.join(sorted(BUILTIN_REWARDS))}); 'package.module:function'; "
    "'path/to/file.py:function'; or a sequence-classification reward model with one output "
    "(a model object, a local folder or a Hub id)"
)


def load_reward_funcs(specs, weights: Sequence[float] | None = None, policy_tokenizer=None, **reward_model_kwargs):
    """Build reward functions and their weights.

    Args:
        specs: one spec or a list of them. Each spec is a callable (kept as is), a built-in name
            such as ``"klppo:sentiment"``, ``"package.module:function"``,
            ``"path/to/file.py:function"``, a ``PreTrainedModel`` for sequence classification, or any
            other string, taken as a reward model's local folder or Hub id and wrapped in
            :class:`~klppo.rewards.RewardModelFunction`.
        weights: one weight per spec (default: all 1.0). The trainer's score is the weighted sum.
        policy_tokenizer: the policy's tokenizer. A reward model whose tokenizer has the same vocabulary
            then scores the policy's token ids directly (``token_ids=True``: nothing is decoded and
            re-encoded), and a reward model given as a module with no tokenizer of its own uses this one
            (TRL's PPO assumed a shared tokenizer); a reward model with another vocabulary re-tokenizes
            the text with its own tokenizer.
        reward_model_kwargs: passed to :class:`~klppo.rewards.RewardModelFunction` for reward
            models (``batch_size``, ``max_length``, ``device``, ``label_index``, ``dtype``...).

    Returns:
        ``(reward_funcs, weights)``: two lists of equal length.

    Raises:
        ValueError: a spec cannot be turned into a reward function (the message names the spec,
            the cause and the valid forms), or ``weights`` does not match ``specs``.
    """
    if specs is None:
        raise ValueError(f"No reward function given: {VALID_FORMS}.")
    if isinstance(specs, (str, Path)) or callable(specs):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ValueError(f"No reward function given: {VALID_FORMS}.")
    if weights is None:
        weights = [1.0] * len(specs)
    weights = [float(w) for w in weights]
    if len(weights) != len(specs):
        raise ValueError(
            f"Got {len(specs)} reward functions and {len(weights)} reward weights: give one weight per "
            "reward function, or none for equal weights of 1.0."
        )
    funcs = [_load_one(spec, reward_model_kwargs, policy_tokenizer) for spec in specs]
    if policy_tokenizer is not None:
        from .reward_model import RewardModelFunction

        for fn in funcs:
            if isinstance(fn, RewardModelFunction) and "token_ids" not in reward_model_kwargs:
                fn.use_token_ids_if_shared(policy_tokenizer)
    return funcs, weights


def reward_func_name(fn) -> str:
    """A short name for metric keys (``rewards/<name>``): the function's ``__name__``, the wrapped
    function's name for a ``functools.partial``, or the class name of any other callable."""
    if isinstance(fn, functools.partial):
        return reward_func_name(fn.func)
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) and name else type(fn).__name__


def unique_names(names: list[str]) -> list[str]:
    """`names` with a repeated name numbered from its second use on (`f`, `f_2`, `f_3`): each reward function gets
    its own `rewards/<name>` figure, as two lambdas would not."""
    unique: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in unique:
            n += 1
            candidate = f"{name}_{n}"
        unique.append(candidate)
    return unique


def _load_one(spec, reward_model_kwargs: dict, policy_tokenizer=None):
    from .reward_model import RewardModelFunction

    if _is_module(spec):  # a model object: a PreTrainedModel is callable, but not a reward function
        if policy_tokenizer is not None and not getattr(getattr(spec, "config", None), "name_or_path", ""):
            reward_model_kwargs = {"tokenizer": policy_tokenizer, **reward_model_kwargs}
        return _reward_model(spec, reward_model_kwargs, RewardModelFunction)
    if callable(spec):
        return spec
    if isinstance(spec, Path):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ValueError(f"Reward spec {spec!r} has type {type(spec).__name__}: {VALID_FORMS}.")
    if spec.startswith("klppo:"):
        if spec not in BUILTIN_REWARDS:
            raise ValueError(f"Unknown built-in reward {spec!r}: valid built-ins are {sorted(BUILTIN_REWARDS)}.")
        return BUILTIN_REWARDS[spec]
    target, _, attr = spec.rpartition(":")
    if target and attr.isidentifier():
        if target.endswith(".py"):
            return _get_callable(_import_file(spec, target), attr, spec)
        if all(part.isidentifier() for part in target.split(".")):
            try:
                module = importlib.import_module(target)
            except Exception as err:
                raise ValueError(
                    f"Reward spec {spec!r}: could not import module {target!r} ({type(err).__name__}: {err}). "
                    f"Check that it is installed or on PYTHONPATH; {VALID_FORMS}."
                ) from err
            return _get_callable(module, attr, spec)
    return _reward_model(spec, reward_model_kwargs, RewardModelFunction)


def _is_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _import_file(spec: str, file: str):
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"Reward spec {spec!r}: file {file!r} does not exist (resolved to {str(path)!r}). "
            f"Check the path; {VALID_FORMS}."
        )
    # A stable, unique module name per file, so two files with the same stem do not clash.
    name = f"klppo_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(
            f"Reward spec {spec!r}: running {str(path)!r} failed ({type(err).__name__}: {err}). "
            "Fix the error in that file."
        ) from err
    return module


def _get_callable(module, attr: str, spec: str):
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(
            f"Reward spec {spec!r}: {module.__name__!r} has no attribute {attr!r} "
            f"(its public callables: {public[:20]}). {VALID_FORMS[0].upper()}{VALID_FORMS[1:]}."
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"Reward spec {spec!r}: {attr!r} is a {type(fn).__name__}, not a function. {VALID_FORMS}.")
    return fn


def _reward_model(spec, reward_model_kwargs: dict, factory):
    try:
        return factory(spec, **reward_model_kwargs)
    except Exception as err:
        shown = spec if isinstance(spec, str) else type(spec).__name__
        raise ValueError(
            f"Reward spec {shown!r} was taken as a sequence-classification reward model, which could not be "
            f"loaded ({type(err).__name__}: {err}). If it is a model, check the folder or Hub id (and hub "
            f"access); otherwise use another form: {VALID_FORMS}."
        ) from err
