"""Reward functions: sentiment, long words, reward-model wrapper, loading from specs, error messages."""

from __future__ import annotations

import functools
import math
import textwrap

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from klppo.rewards import (
    RewardModelFunction,
    completion_text,
    load_reward_funcs,
    long_word_reward,
    long_word_share,
    positive_sentiment_reward,
    reward_func_name,
)

PROMPTS = ["The film started slowly, but", "Dear diary, today was", "The soup was cold when it arrived, but"]
COMPLETIONS = [" it became a wonderful, joyful story.", " awful and sad.", " the waiter was"]


def test_long_word_share_counts_words_of_seven_letters_or_more():
    # words: The(3) wonderful(9) journey(7) was(3) absolutely(10) fun(3) -> 3 of 6 have >= 7 letters
    assert long_word_share("The wonderful journey was absolutely fun!") == 0.5
    assert long_word_share("abcdef abcdefg") == 0.5  # 6 letters is short, 7 is long
    assert long_word_share("") == 0.0 and long_word_share("42, ...") == 0.0  # no words
    assert long_word_share("well-known") == 0.0  # hyphens split words: well(4), known(5)
    assert long_word_share("It's extraordinary") == 1 / 3  # It, s, extraordinary
    chat = [[{"role": "assistant", "content": " extraordinary"}]]
    assert long_word_reward(["p"], chat) == [1.0]
    assert long_word_reward(PROMPTS, COMPLETIONS) == [1 / 6, 0.0, 0.0]  # "wonderful"; "waiter" has 6 letters
    assert load_reward_funcs("klppo:long-words") == ([long_word_reward], [1.0])


def test_completion_text_formats():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    with pytest.raises(TypeError):
        completion_text(3)


def test_sentiment_orders_positive_above_negative():
    happy, sad, neutral = positive_sentiment_reward(PROMPTS, COMPLETIONS)
    assert happy > 0.5 and sad < -0.3 and happy > neutral > sad
    chat = positive_sentiment_reward(
        [[{"role": "user", "content": p}] for p in PROMPTS[:2]],
        [[{"role": "assistant", "content": c}] for c in COMPLETIONS[:2]],
    )
    assert chat == [happy, sad]
    assert all(-1.0 <= s <= 1.0 for s in positive_sentiment_reward(["x"] * 3, ["", "!!!", "love love love"]))


def test_builtin_and_callable_specs():
    def mine(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    funcs, weights = load_reward_funcs(["klppo:sentiment", mine], weights=[2, 0.5])
    assert funcs == [positive_sentiment_reward, mine] and weights == [2.0, 0.5]
    assert load_reward_funcs("klppo:sentiment") == ([positive_sentiment_reward], [1.0])
    with pytest.raises(ValueError, match="one weight per reward function"):
        load_reward_funcs(["klppo:sentiment", mine], weights=[1.0])
    with pytest.raises(
        ValueError, match="valid built-ins are \\['klppo:list-items', 'klppo:long-words', 'klppo:sentiment'\\]"
    ):
        load_reward_funcs("klppo:toxicity")


def test_module_and_file_specs(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        def length_reward(prompts, completions, completion_ids=None, **kwargs):
            return [float(len(c)) for c in completions]

        NOT_A_FUNCTION = 3
        """
    )
    (tmp_path / "my_rewards_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    (fn,), _ = load_reward_funcs("my_rewards_mod:length_reward")
    assert fn(PROMPTS, COMPLETIONS) == [float(len(c)) for c in COMPLETIONS]
    (from_file,), _ = load_reward_funcs(f"{tmp_path / 'my_rewards_mod.py'}:length_reward")
    assert from_file.__name__ == "length_reward" and from_file(["p"], ["abcd"]) == [4.0]

    with pytest.raises(ValueError, match="no_such_module_xyz.*could not import module.*PYTHONPATH"):
        load_reward_funcs("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'.*length_reward"):
        load_reward_funcs("my_rewards_mod:missing")
    with pytest.raises(ValueError, match="not a function"):
        load_reward_funcs("my_rewards_mod:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_funcs(f"{tmp_path / 'nope.py'}:length_reward")


def test_unloadable_model_spec_explains_the_forms(tmp_path):
    with pytest.raises(ValueError) as err:
        load_reward_funcs(str(tmp_path / "no-such-reward-model"))
    message = str(err.value)
    assert "no-such-reward-model" in message and "sequence-classification" in message
    assert "'package.module:function'" in message and "klppo:sentiment" in message


def test_reward_model_by_path(tiny_reward_model_path):
    (rm,), weights = load_reward_funcs(str(tiny_reward_model_path), batch_size=2)
    assert isinstance(rm, RewardModelFunction) and weights == [1.0]
    assert reward_func_name(rm) == tiny_reward_model_path.name
    assert isinstance(rm.model, torch.nn.Module) and not rm.model.training
    assert not any(p.requires_grad for p in rm.model.parameters())

    scores = rm(PROMPTS, COMPLETIONS)
    assert len(scores) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    # padding and batching do not change a score
    alone = [rm([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert alone == pytest.approx(scores, abs=1e-5)
    # plain text is prompt + completion
    assert rm([""], [PROMPTS[0] + COMPLETIONS[0]]) == pytest.approx(scores[:1], abs=1e-6)


def test_reward_model_conversational_uses_chat_template(tiny_reward_model_path):
    rm = RewardModelFunction(str(tiny_reward_model_path), batch_size=4)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    scores = rm(prompts, completions)
    text = rm.tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
    ids = rm.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = rm.model(input_ids=ids).logits[0, 0].item()
    assert scores[0] == pytest.approx(expected, abs=1e-5)


def test_reward_model_object_and_label_checks(tiny_reward_model_path):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path)
    (rm,), _ = load_reward_funcs([model])  # a model object is wrapped, not called as a function
    assert isinstance(rm, RewardModelFunction) and rm.model is model

    two = AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_model_path, num_labels=2, ignore_mismatched_sizes=True
    )
    with pytest.raises(ValueError, match="has 2 labels.*label_index"):
        RewardModelFunction(two)
    assert len(RewardModelFunction(two, label_index=1)(["a"], ["b"])) == 1


def test_reward_func_name():
    def scorer(prompts, completions, **kwargs):
        return []

    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            return []

    assert reward_func_name(scorer) == "scorer"
    assert reward_func_name(functools.partial(scorer, scale=2)) == "scorer"
    assert reward_func_name(Scorer()) == "Scorer"
    assert reward_func_name(positive_sentiment_reward) == "positive_sentiment_reward"


# ---------------------------------------------------------------------------------------------
# what the trainer accepts from a reward function


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, 2.0], "returned 2 values for 4 completions"),
        ("great", "returned str"),
        (0.5, "returned float"),
        (None, "returned NoneType"),
        (["a", 1.0, 2.0, 3.0], "returned str 'a' for completion 0"),
        ([1.0, [2.0], 3.0, 4.0], "returned list [2.0] for completion 1"),
    ],
)
def test_wrong_reward_results_name_the_function(returned, message):
    from klppo.rewards import reward_values

    with pytest.raises(ValueError, match="my_reward") as err:
        reward_values(returned, 4, "my_reward")
    assert message in str(err.value) and "return a list of 4 numbers" in str(err.value)


def test_reward_values_accept_numbers_tensors_and_none():
    import numpy as np
    import torch

    from klppo.rewards import reward_values

    assert reward_values([1, True, np.float32(0.5), torch.tensor(2.0), None], 5, "f") == [1.0, 1.0, 0.5, 2.0, None]
    assert reward_values(torch.tensor([0.5, 1.5]), 2, "f") == [0.5, 1.5]
