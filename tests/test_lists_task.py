"""The long-response task: its verifiable reward, its prompts and its config."""

from __future__ import annotations

import pytest

from klppo.data import LIST_PROMPTS_ID, list_prompts, load_prompt_dataset
from klppo.rewards import list_item_score, list_items_reward, load_reward_funcs


@pytest.mark.parametrize(
    "text, score",
    [
        ("- apple: sweet.\n- pear: soft.\n- fig: rich.\n- plum: tart.\n- kiwi: green.", 1.0),
        ("Here are five:\n1. apple\n2) pear\n* fig\n\u2022 plum\n- kiwi\nThat is all.", 1.0),
        ("- apple\n- pear", 0.4),
        ("Apples are sweet. Pears are soft.", 0.0),
        ("-apple\n1.pear\n#1 fig", 0.0),  # no space after the marker: not a list line
        ("\n".join(f"- item {i}" for i in range(7)), 0.6),  # two past the fifth
        ("\n".join(f"- item {i}" for i in range(12)), 0.0),  # clipped at 0
    ],
)
def test_the_list_reward_counts_list_lines(text, score):
    assert list_item_score(text) == pytest.approx(score)


def test_the_list_reward_is_built_in_and_reads_conversational_completions():
    (fn,), _ = load_reward_funcs(["klppo:list-items"])
    assert fn is list_items_reward
    completions = [[{"role": "assistant", "content": "- a x\n- b y"}], "no list"]
    assert fn(["p", "p"], completions) == [pytest.approx(0.4), 0.0]


def test_the_list_prompts_split_and_load():
    train, evaluation = list_prompts("train"), list_prompts("eval")
    assert len(train) == 45 and len(evaluation) == 5 and not set(train) & set(evaluation)
    assert all(p.startswith("Give five ") for p in train)
    dataset = load_prompt_dataset(LIST_PROMPTS_ID, split="test")
    assert dataset["prompt"] == evaluation
    with pytest.raises(ValueError, match="klppo:list-prompts"):
        load_prompt_dataset("klppo:no-such-set")
