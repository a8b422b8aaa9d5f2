"""Shared fixtures.

Model cache: klppo builds its special models (``klppo:tiny-llama``, ``klppo:smollm2-135m-instruct``)
under ``$KLPPO_CACHE``. The test session points ``KLPPO_CACHE`` at a fresh temporary folder, so
tests never touch the user's cache and every run (CI included) builds from scratch once per
session; subprocesses started by tests inherit it. Set ``KLPPO_TEST_CACHE=/some/folder`` to keep
the cache between runs instead (the SmolLM2 conversion then happens only once).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_SESSION_CACHE: str | None = None
_LOCK_FOLDER: str | None = None
_RANKS_LOCK = "KLPPO_TEST_RANKS_LOCK"  # the folder of the lock file, shared by the test processes


def pytest_configure(config):
    global _SESSION_CACHE
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one test process per core: one thread each, subprocesses too
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    global _LOCK_FOLDER
    if not os.environ.get("PYTEST_XDIST_WORKER") and _RANKS_LOCK not in os.environ:  # the workers inherit it
        _LOCK_FOLDER = os.environ[_RANKS_LOCK] = tempfile.mkdtemp(prefix="klppo-test-lock-")
    config.addinivalue_line("markers", "ranks: starts processes that talk to each other; runs with no other such test")
    keep = os.environ.get("KLPPO_TEST_CACHE")
    if keep:
        os.environ["KLPPO_CACHE"] = keep
    else:
        _SESSION_CACHE = tempfile.mkdtemp(prefix="klppo-test-cache-")
        os.environ["KLPPO_CACHE"] = _SESSION_CACHE


def pytest_collection_modifyitems(config, items):
    """The tests marked `slow` first (their order otherwise kept): the two test processes then end together,
    instead of one waiting for the other's last long test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked `ranks` (ranks that exchange tensors: DeepSpeed, FSDP, torchrun) run one at a time, their
    fixtures included: two of them at once put 4 busy processes on 2 cores, and a rank that is off its core stalls
    every collective (a ZeRO-3 command then ran 5x slower than alone)."""
    folder = os.environ.get(_RANKS_LOCK)
    if not folder or not os.environ.get("PYTEST_XDIST_WORKER") or item.get_closest_marker("ranks") is None:
        yield
        return
    from filelock import FileLock

    with FileLock(os.path.join(folder, "ranks.lock")):
        yield


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    if _LOCK_FOLDER is not None:
        shutil.rmtree(_LOCK_FOLDER, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of ``klppo:tiny-llama`` in the session cache (built on first use, ~2 s)."""
    from klppo.models import TINY_MODEL, resolve_model_path

    return resolve_model_path(TINY_MODEL)


@pytest.fixture
def tiny_model_and_tokenizer(tiny_model_path):
    """A fresh ``(model, tokenizer)`` of the tiny random Llama: eval mode, fp32, CPU, left padding.

    The tokenizer has bos ``<|endoftext|>``, eos ``<|im_end|>``, pad ``<|pad|>`` (pad != eos) and a
    ChatML chat template. Each test gets its own copy, free to train or modify.
    """
    from klppo.models import tiny_model_and_tokenizer as build

    return build()


@pytest.fixture(scope="session")
def tiny_reward_model_path(tiny_model_path, tmp_path_factory):
    """A random one-output Llama sequence classifier with the tiny tokenizer, saved to disk (a reward model)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    path = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return path


def once_per_session(tmp_path_factory, name: str, build):
    """The folder `build(folder)` fills, built once per test session: under pytest-xdist the test processes share
    it (the first to ask builds it under a file lock, the others wait and reuse it), so a fixture that starts ranks
    or trains does not run once in each process."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent  # shared by the session's test processes
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (folder / ".built").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def engine_rollout(tmp_path_factory):
    """One saved rollout of 8 sequences (with its rewards) for the worker's `engine` mode: 4 per rank, 2 mini-batches
    of 2 per rank, 1 sequence per micro-batch. Shared by the engine tests (DeepSpeed, FSDP2)."""
    import torch

    import dist_trainer_worker as worker

    def build(out):
        trainer = worker.make_trainer(str(out))
        torch.manual_seed(0)
        rollout = trainer.rollout(trainer.prompt_batch(worker.PROMPTS["prompt"][:8]))
        torch.save((rollout, trainer.compute_rewards(rollout)), out / "rollout.pt")

    return once_per_session(tmp_path_factory, "engine_rollout", build) / "rollout.pt"


@pytest.fixture(scope="session")
def ddp_update(engine_rollout, tmp_path_factory):
    """The `engine` update of `engine_rollout` under DDP (`torchrun`, 2 CPU processes): the reference engine."""
    from test_trainer_distributed import torchrun

    def build(out):
        torchrun(["engine", str(engine_rollout), str(out)], out)

    return once_per_session(tmp_path_factory, "ddp", build)
