"""Prompt datasets and held-out text.

Prompts come from the built-in offline set (``klppo:offline-prompts``), a local file
(``.jsonl``, ``.json``, ``.csv``, ``.parquet``) or a Hugging Face Hub dataset. Every loader returns a
``datasets.Dataset`` with a ``prompt`` column, either plain text or conversational
(``[{"role": "user", "content": ...}]``), the two formats TRL's online trainers accept.

Held-out text for perplexity comes from Python's own documentation (``klppo:pydoc``, the help
texts in ``pydoc_data.topics``, shipped with every Python) or from a local text file.
"""

from __future__ import annotations

import json
import random
import re
from importlib import resources
from pathlib import Path

OFFLINE_PROMPTS_ID = "klppo:offline-prompts"
LIST_PROMPTS_ID = "klppo:list-prompts"
HELDOUT_TEXT_ID = "klppo:pydoc"

# Every EVAL_EVERY-th prompt of the built-in set goes to the eval split.
EVAL_EVERY = 10

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_SPLITS = ("train", "eval", "all")


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def offline_prompts(split: str = "all") -> list[str]:
    """The built-in prompt openings for the "continue this text" sentiment task.

    Args:
        split: ``"train"``, ``"eval"`` or ``"all"``. The split is fixed: prompt ``i`` (0-based,
            in file order) is in ``eval`` when ``i % 10 == 9``, otherwise in ``train``.

    Returns:
        The prompts, in file order.
    """
    if split not in _SPLITS:
        raise ValueError(f"Unknown split {split!r} for {OFFLINE_PROMPTS_ID}: use one of {_SPLITS}.")
    text = resources.files("klppo").joinpath("assets/offline_prompts.txt").read_text(encoding="utf-8")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if split == "all":
        return prompts
    in_eval = [i % EVAL_EVERY == EVAL_EVERY - 1 for i in range(len(prompts))]
    return [p for p, e in zip(prompts, in_eval) if e == (split == "eval")]


LIST_TOPICS = (
    "fruits",
    "vegetables",
    "ways to save water",
    "uses for a brick",
    "reasons to learn a language",
    "things to pack for a trip",
    "habits of good sleepers",
    "kitchen tools",
    "board games",
    "musical instruments",
    "ways to stay warm in winter",
    "things to do on a rainy day",
    "birds",
    "trees",
    "sports played with a ball",
    "jobs in a hospital",
    "ways to reduce waste",
    "things found in a garden",
    "famous rivers",
    "desserts",
    "ways to learn faster",
    "household chores",
    "animals that live in the sea",
    "reasons to read books",
    "things to bring to a picnic",
    "tips for a job interview",
    "ways to be kind to a neighbour",
    "spices",
    "parts of a bicycle",
    "things that make a good teacher",
    "ways to exercise at home",
    "breakfast foods",
    "hobbies that cost little",
    "things to check before a long drive",
    "flowers",
    "ways to relax after work",
    "school subjects",
    "tools a carpenter uses",
    "ways to make a room brighter",
    "rules for a safe hike",
    "insects",
    "things to do in a new city",
    "signs of a healthy plant",
    "uses for old newspapers",
    "ways to keep a conversation going",
    "farm animals",
    "qualities of a good friend",
    "kinds of weather",
    "ways to save money on food",
    "things to keep in a first-aid kit",
)
LIST_PROMPT = "Give five {topic}, one per line. Start every line with '- ' and explain each in one sentence."


def list_prompts(split: str = "all") -> list[str]:
    """The prompts of the list-format task (`klppo.rewards.lists`): five items of a topic, one per line, each
    explained in a sentence. Split as the built-in set is: prompt `i` is in `eval` when `i % 10 == 9`."""
    if split not in _SPLITS:
        raise ValueError(f"Unknown split {split!r} for {LIST_PROMPTS_ID}: use one of {_SPLITS}.")
    prompts = [LIST_PROMPT.format(topic=t) for t in LIST_TOPICS]
    if split == "all":
        return prompts
    return [p for i, p in enumerate(prompts) if (i % EVAL_EVERY == EVAL_EVERY - 1) == (split == "eval")]


BUILTIN_PROMPTS = {OFFLINE_PROMPTS_ID: offline_prompts, LIST_PROMPTS_ID: list_prompts}


def load_prompt_dataset(
    name_or_path: str,
    split: str = "train",
    prompt_column: str = "prompt",
    conversational: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
):
    """Load prompts as a ``datasets.Dataset`` with a ``prompt`` column.

    Args:
        name_or_path: ``"klppo:offline-prompts"``, ``"klppo:list-prompts"``, a local ``.jsonl``/``.json``/``.csv``/``.parquet``
            file, or a Hub dataset name (loaded with ``datasets.load_dataset``).
        split: the split to load. For the built-in set: ``"train"``, ``"eval"`` or ``"all"``
            (``"test"`` and ``"validation"`` mean ``"eval"``). For a local file it is ignored (the
            whole file is one split). For a Hub dataset it is passed to ``load_dataset``.
        prompt_column: the column holding the prompts; renamed to ``prompt``.
        conversational: turn each plain-text prompt ``p`` into ``[{"role": "user", "content": p}]``
            so the trainer applies the tokenizer's chat template. Prompts already conversational are
            left as they are.
        max_samples: keep at most this many rows, chosen by a shuffle with ``seed``.
        seed: seed of the shuffle used by ``max_samples``.

    Returns:
        A ``datasets.Dataset``. Columns other than ``prompt`` are kept (reward functions receive
        them as keyword arguments in TRL's convention).
    """
    import datasets

    if name_or_path in BUILTIN_PROMPTS:
        builtin_split = {"test": "eval", "validation": "eval"}.get(split, split)
        dataset = datasets.Dataset.from_dict({"prompt": BUILTIN_PROMPTS[name_or_path](builtin_split)})
    elif name_or_path.startswith("klppo:"):
        raise ValueError(
            f"Unknown built-in prompt set {name_or_path!r}: the built-in ones are {', '.join(BUILTIN_PROMPTS)}. "
            "Pass one, a local .jsonl/.json/.csv/.parquet file, or a Hub dataset name."
        )
    elif Path(name_or_path).suffix.lower() in _FILE_BUILDERS:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"Prompt file {str(path)!r} does not exist: check the path (relative paths are "
                f"resolved from {str(Path.cwd())!r}) or use the built-in set {OFFLINE_PROMPTS_ID!r}."
            )
        if path.stat().st_size == 0:
            raise ValueError(
                f"Prompt file {str(path)!r} is empty: it needs one prompt per row, in a column {prompt_column!r}."
            )
        builder = _FILE_BUILDERS[path.suffix.lower()]
        try:
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
        except (StopIteration, datasets.exceptions.DatasetGenerationError) as err:
            raise ValueError(f"Could not read prompts from {str(path)!r} ({type(err).__name__}: {err}).") from None
    else:
        dataset = datasets.load_dataset(name_or_path, split=split)

    if prompt_column not in dataset.column_names:
        raise ValueError(
            f"{name_or_path!r} has no column {prompt_column!r} (columns: {dataset.column_names}): "
            "pass the name of the column holding the prompts as prompt_column."
        )
    texts = [p for p in dataset[prompt_column] if p]
    if not texts:
        raise ValueError(
            f"{name_or_path!r} has no non-empty prompt in column {prompt_column!r} ({len(dataset)} rows): every "
            "prompt is empty, so there is nothing to continue."
        )
    if prompt_column != "prompt":
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    if max_samples is not None and max_samples < len(dataset):
        dataset = dataset.shuffle(seed=seed).select(range(max_samples))
    if conversational:
        dataset = dataset.map(_to_conversational)
    return dataset


def _to_conversational(example: dict) -> dict:
    prompt = example["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return {"prompt": prompt}


# --------------------------------------------------------------------------------------------
# Held-out text
# --------------------------------------------------------------------------------------------


def pydoc_passages(max_chars: int = 1000, min_chars: int = 200) -> list[str]:
    """English passages from Python's built-in help texts (``pydoc_data.topics.topics``).

    Each help topic is split into paragraphs at blank lines; whitespace runs inside a paragraph are
    collapsed to one space; paragraphs that are mostly symbols (code, grammar rules, tables) are
    dropped; consecutive paragraphs are joined while the passage stays within
    ``max_chars`` (a longer paragraph is cut at word boundaries). Passages shorter than
    ``min_chars`` are dropped. The order is deterministic (topics sorted by name).
    """
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        current = ""
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            # Drop heading underlines (``*****``, ``=====``), then whitespace runs.
            paragraph = " ".join(_RULE.sub(" ", paragraph).split())
            if not _is_prose(paragraph):
                continue
            for piece in _cut_words(paragraph, max_chars):
                if current and len(current) + 1 + len(piece) <= max_chars:
                    current = f"{current} {piece}"
                else:
                    if len(current) >= min_chars:
                        passages.append(current)
                    current = piece
        if len(current) >= min_chars:
            passages.append(current)
    return passages


_RULE = re.compile(r"([*=~^+\-])\1{2,}")


def _is_prose(paragraph: str, min_letter_frac: float = 0.8) -> bool:
    """False for empty paragraphs and for code, grammar rules and tables (few letters)."""
    if not paragraph or paragraph.startswith(">>>") or paragraph.count("|") > 2:
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) >= min_letter_frac


def _cut_words(text: str, max_chars: int) -> list[str]:
    """Split ``text`` at spaces into pieces of at most ``max_chars`` (a longer word is cut)."""
    pieces, current = [], ""
    for word in text.split(" "):
        while len(word) > max_chars:
            if current:
                pieces.append(current)
                current = ""
            pieces.append(word[:max_chars])
            word = word[max_chars:]
        if current and len(current) + 1 + len(word) > max_chars:
            pieces.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        pieces.append(current)
    return pieces


def load_heldout_texts(
    name_or_path: str = HELDOUT_TEXT_ID,
    max_texts: int | None = 64,
    seed: int = 0,
    text_column: str = "text",
    split: str = "test",
) -> list[str]:
    """Texts for held-out perplexity.

    Args:
        name_or_path: ``"klppo:pydoc"`` (Python's help texts, see :func:`pydoc_passages`), a local
            ``.txt`` file (one text per non-empty line), a ``.jsonl``/``.json``/``.csv``/``.parquet``
            file with a ``text_column``, or a Hub dataset name.
        max_texts: keep at most this many texts, sampled with ``seed`` (``None`` keeps all).
        seed: seed of the sample.
        text_column: the column holding the text (files other than ``.txt``, Hub datasets).
        split: the split of a Hub dataset.

    Returns:
        A list of non-empty strings, in a deterministic order for a given seed.
    """
    path = Path(name_or_path)
    if name_or_path == HELDOUT_TEXT_ID:
        texts = pydoc_passages()
    elif name_or_path.startswith("klppo:"):
        raise ValueError(
            f"Unknown built-in text set {name_or_path!r}: the only one is {HELDOUT_TEXT_ID!r}. "
            "Pass it, a local .txt/.jsonl file, or a Hub dataset name."
        )
    elif path.suffix.lower() == ".txt" or path.suffix.lower() in _FILE_BUILDERS:
        if not path.is_file():
            raise ValueError(
                f"Held-out text file {str(path)!r} does not exist: check the path or use the "
                f"built-in text {HELDOUT_TEXT_ID!r}."
            )
        if path.suffix.lower() == ".txt":
            texts = path.read_text(encoding="utf-8").splitlines()
        elif path.suffix.lower() == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            texts = _column(rows, text_column, name_or_path)
        else:
            import datasets

            dataset = datasets.load_dataset(_FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
            texts = _column(dataset, text_column, name_or_path)
    else:
        import datasets

        dataset = datasets.load_dataset(name_or_path, split=split)
        texts = _column(dataset, text_column, name_or_path)

    texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
    if max_texts is not None and max_texts < len(texts):
        texts = random.Random(seed).sample(texts, max_texts)
    return texts


def _column(rows, column: str, source: str) -> list:
    if hasattr(rows, "column_names"):
        if column not in rows.column_names:
            raise ValueError(f"{source!r} has no column {column!r} (columns: {rows.column_names}): pass text_column.")
        return list(rows[column])
    if rows and column not in rows[0]:
        raise ValueError(f"{source!r} has no field {column!r} (fields: {sorted(rows[0])}): pass text_column.")
    return [row.get(column) for row in rows]
