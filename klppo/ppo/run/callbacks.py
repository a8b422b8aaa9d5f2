"""Around the PPO loop: the progress bar, wandb without credentials, and phase timings."""

from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager

import torch
from torch.profiler import record_function
from transformers import TrainerCallback

_WANDB_NOTICE_GIVEN = False


class KLProgressCallback(TrainerCallback):
    """A progress bar over PPO updates showing the live KL statistic, coefficient and reward."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="PPO", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "kl/value" in logs:
            self.bar.set_postfix(
                kl=f"{logs['kl/value']:.3g}", coef=f"{logs['kl/coef']:.3g}", reward=f"{logs['objective/scores']:.3g}"
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def wandb_lacks_credentials(args) -> bool:
    """Whether wandb is in `report_to`, `WANDB_MODE` unset, and wandb has no credentials (no `WANDB_API_KEY`, no
    `~/.netrc` login): klppo then logs offline, and says so once per process."""
    global _WANDB_NOTICE_GIVEN
    if "wandb" not in (args.report_to or []) or os.environ.get("WANDB_MODE"):
        return False
    if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb_login():
        return False
    if not _WANDB_NOTICE_GIVEN:
        warnings.warn(
            "wandb has no credentials here: logging offline to ./wandb (sync later with `wandb sync`).", stacklevel=3
        )
        _WANDB_NOTICE_GIVEN = True
    return True


def maybe_offline_wandb(args) -> None:
    """For a command that owns its process (`klppo train`): `WANDB_MODE=offline` in the process's environment when
    wandb lacks credentials. A trainer built from Python leaves the environment alone (`offline_wandb`)."""
    if wandb_lacks_credentials(args):
        os.environ["WANDB_MODE"] = "offline"


@contextmanager
def offline_wandb(args):
    """`WANDB_MODE=offline` while wandb starts its run (it reads the mode then) when it lacks credentials, and the
    environment as it was afterwards."""
    if not wandb_lacks_credentials(args):
        yield
        return
    os.environ["WANDB_MODE"] = "offline"
    try:
        yield
    finally:
        os.environ.pop("WANDB_MODE", None)


def _netrc_has_wandb_login() -> bool:
    """Whether `~/.netrc` (where `wandb login` saves the key) has a login for wandb's host."""
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def now(accelerator) -> float:
    """Wall time, after the accelerator's pending work (CUDA) has finished."""
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize(accelerator.device)
    return time.perf_counter()


@contextmanager
def timed(timings: dict, key: str, accelerator):
    """Add the block's wall time to `timings[key]`; under `torch.profiler` the block is a range named
    `klppo/<key without "time/">`."""
    start = now(accelerator)
    try:
        with record_function("klppo/" + key.removeprefix("time/")):
            yield
    finally:
        timings[key] = timings.get(key, 0.0) + now(accelerator) - start
