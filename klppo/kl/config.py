"""`KLControlConfig`: the KL settings one controller needs, validated once, shared by `KLPPOConfig` and
`klppo.integrations.trl.add_kl_control`; and `field_docs`, which reads a config class's docstring into the help
text of each field, so that every field is documented once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .controllers import build_kl_controller, get_kl_controller, kl_controllers
from .estimators import kl_estimators
from .optimum import KLOptimum
from .penalty import KL_MODES, LOSS_AGG_MODES
from .reduce import KL_STATISTIC_UNITS

__all__ = ["KLControlConfig", "choice_error", "field_docs", "doc_metadata"]


def choice_error(field_name: str, value, choices) -> ValueError:
    """The error for a value outside its choices, naming them."""
    listed = ", ".join(repr(c) for c in choices)
    return ValueError(f"`{field_name}`={value!r} is not valid. Choose one of: {listed}.")


def field_docs(doc: str) -> dict[str, str]:
    """`{field: its description}` from the `Parameters:` section of a Hugging Face-style docstring: an entry is a
    line `name (`type`, ...):` indented by 8 spaces (one line may document several fields: `a (...), b (...):`),
    its description the lines below indented by 12. Headings (`> KL control`) are skipped."""
    docs, names, body = {}, [], []
    section = doc.split("Parameters:", 1)[1]
    for line in section.splitlines() + [" " * 8 + "end (`x`):"]:
        if line.startswith(" " * 8) and not line.startswith(" " * 9) and line.rstrip().endswith(":"):
            docs.update({n: " ".join(body) for n in names})
            names, body = re.findall(r"\w+", re.sub(r"\([^)]*\)", "", line)), []
        elif line.startswith(" " * 12):
            body.append(line.strip())
    return docs


def doc_metadata(docs: dict[str, str], name: str) -> dict:
    """A field's `metadata` (its `--help` text) from `docs` (`field_docs` of its class's docstring). argparse
    formats help texts with `%`, so a literal one is doubled."""
    return {"help": docs[name].replace("%", "%%")}


KL_CONTROL_DOC = r"""
    The KL settings of one run: where the KL acts, how it is estimated, and how its coefficient beta is controlled.
    `KLPPOConfig` has these fields, and `klppo.integrations.trl.add_kl_control` takes the controller's ones for TRL's
    GRPO and RLOO trainers; both validate them here, with the same messages.

    Parameters:
        > KL control

        kl_mode (`str`, *optional*, defaults to `"reward"`):
            Where the KL estimate acts. `"reward"`: per-token rewards `-kl_coef * kl_t` on response tokens
            (Ziegler et al. 2019; with `k1` this is an unbiased gradient of the sequence KL). `"loss"`:
            `kl_coef * aggregated kl` added to the policy loss (GRPO style). `"both"`: both, with the same
            coefficient. `"none"`: no KL term (KL is still measured and logged).
        kl_estimator (`str`, *optional*, defaults to `"k1"`):
            Which estimate of the KL is applied (`docs/kl.md` gives the gradient each one follows). Per-token: `k1`, `k2`, `k3`, `low_var_kl`, `abs`, `corrected_k3`, each also with a `+`
            suffix (value of the estimator, gradient of `k2`), or `"full"` (exact KL over the whole vocabulary,
            computed in chunks). Combinations whose gradient is not that of KL(pi||ref) log one warning naming the
            divergence they follow (the estimator table in `docs/kl.md`).
        kl_coef (`float`, *optional*, defaults to `0.05`):
            Initial KL coefficient beta: the fixed value with `kl_controller="fixed"`, else the controller's start.
            It names the objective `E[r] - beta * KL(pi || ref)` in every `kl_mode`.
        kl_controller (`str` or `None`, *optional*, defaults to `None`):
            How beta changes between updates. `"fixed"`, `"equilibrium"` (beta moves toward the batch's estimate
            of the coefficient whose KL-regularised optimum has the target KL; needs a KL whose optimum is known:
            `k1` in the reward, or `k2`, an `X+` estimator, `corrected_k3`, `full` or `k3` in the loss, as listed in
            `docs/kl.md`), `"tracking"` (PI control of log beta on the KL and where it is heading, for any KL
            configuration), `"adaptive"` (Ziegler et al. 2019, Sec. 2.2), `"exponential"` (`beta <- beta *
            exp(rate * (kl - target))`), `"pid"` (PID on log beta), or a name registered with
            `klppo.kl.register_kl_controller`. `None`: with a `kl_target`, `"equilibrium"` where it applies and
            `"tracking"` for any other KL (`KLPPOConfig` logs one warning naming why); without one, `"fixed"`.
        kl_target (`float` or `None`, *optional*, defaults to `None`):
            Target of the controller statistic `kl/value`, in the unit of `kl_target_unit`; turns on the default
            controller. Required by every controller but `"fixed"`. Typical: 6 nats per sequence (trlx) or 0.1
            per token (verl).
        kl_target_unit (`str`, *optional*, defaults to `"sequence"`):
            Unit of the controller statistic: `"sequence"` (mean over sequences of the per-sequence sum, the
            trlx / old TRL convention) or `"token"` (token-weighted mean, verl's convention). Both are reduced
            across all processes as (sum, count).
        kl_controller_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            The controller's own constants (gains, bounds, windows), as a mapping; each controller declares its
            constants and their defaults in its constructor (the controller table in `docs/kl.md`), and a key it
            does not declare is refused. E.g. `{"horizon": 10000}` for `adaptive`, `{"kp": 0.1, "ki": 0.3}` for
            `pid`, `{"coef_min": 1e-3}` for any controller with bounds. From a command line, a JSON string. `None`:
            the controller's defaults. klppo's trainer gives `equilibrium` with `kl_mode: loss` and a KL that trains
            toward the tilt (`k2`, an `X+` estimator, `corrected_k3`, `full`) `{"jackknife_groups": 8}` unless the
            mapping sets it (`0` turns that filter off).
        kl_value_clamp (`float` or `None`, *optional*, defaults to `None`):
            Opt-in clamp of every estimator's output to `[-v, v]` (OpenRLHF uses 10). Clamped tokens have zero
            gradient; their fraction is logged as `kl/clamped_frac`.
        kl_loss_agg_mode (`str`, *optional*, defaults to `"token-mean"`):
            Aggregation of the KL loss term: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean` or
            `seq-mean-token-sum-norm` (each sequence's sum divided by the constant `response_length`). Counts are
            global (all processes, whole mini-batch), so results do not depend on how a batch is split across
            processes and accumulation steps.
"""

_DOCS = field_docs(KL_CONTROL_DOC)


@dataclass
class KLControlConfig:
    __doc__ = KL_CONTROL_DOC

    kl_mode: str = field(default="reward", metadata=doc_metadata(_DOCS, "kl_mode"))
    kl_estimator: str = field(default="k1", metadata=doc_metadata(_DOCS, "kl_estimator"))
    kl_coef: float = field(default=0.05, metadata=doc_metadata(_DOCS, "kl_coef"))
    kl_controller: str | None = field(default=None, metadata=doc_metadata(_DOCS, "kl_controller"))
    kl_target: float | None = field(default=None, metadata=doc_metadata(_DOCS, "kl_target"))
    kl_target_unit: str = field(default="sequence", metadata=doc_metadata(_DOCS, "kl_target_unit"))
    kl_controller_kwargs: dict | str | None = field(default=None, metadata=doc_metadata(_DOCS, "kl_controller_kwargs"))
    kl_value_clamp: float | None = field(default=None, metadata=doc_metadata(_DOCS, "kl_value_clamp"))
    kl_loss_agg_mode: str = field(default="token-mean", metadata=doc_metadata(_DOCS, "kl_loss_agg_mode"))

    def __post_init__(self):
        self.validate_kl_control()

    # what the KL term trains toward, for the controller that solves for its optimum; subclasses add what they know
    def _undiscounted(self) -> bool:
        """Whether the return the KL rewards enter is undiscounted (the sequence-level tilt needs it)."""
        return True

    def _loss_weight(self) -> tuple[float | None, str]:
        """The weight of a KL in the loss against the policy gradient, per unit of beta (1: beta names `E[r] - beta *
        KL` in the loss too), and why it is not known where it is None. The policy gradient is a token mean, so a
        token-mean KL term weighs 1; the other aggregations weigh by a share of the responses' lengths."""
        if self.kl_loss_agg_mode == "token-mean":
            return 1.0, ""
        return None, (
            f"kl_loss_agg_mode={self.kl_loss_agg_mode!r} weighs the KL against the policy gradient (a token "
            "mean) by the responses' lengths, which move with the policy"
        )

    def kl_optimum(self) -> KLOptimum | None:
        """The optimum the configured KL term trains toward, as a function of beta (`klppo.kl.optimum.KLOptimum`),
        where klppo knows it: what the equilibrium controller solves for. None elsewhere."""
        return self._optimum_and_why()[0]

    def _optimum_and_why(self) -> tuple[KLOptimum | None, str]:
        from .optimum import kl_optimum_of

        if not self._undiscounted() or self.kl_value_clamp is not None:
            return None, (
                f"with gamma={getattr(self, 'gamma', 1.0)} or kl_value_clamp={self.kl_value_clamp} that "
                "optimum is not the one trained (it needs gamma 1 and no kl_value_clamp)"
            )
        weight, why = self._loss_weight() if "loss" in self.kl_modes_applied else (1.0, "")
        optimum = kl_optimum_of(self.kl_mode, self.kl_estimator, weight)
        if optimum is not None:
            return optimum, ""
        if weight is None and kl_optimum_of(self.kl_mode, self.kl_estimator, 1.0) is not None:
            return None, why
        return None, (
            f"{self.kl_estimator} in kl_mode={self.kl_mode!r} trains toward no optimum klppo knows in "
            "closed form (docs/kl.md, 'Which optimum each KL trains toward')"
        )

    def default_controller(self) -> str:
        """`kl_controller=None`: with a `kl_target`, `"equilibrium"` where the optimum the KL trains toward is known
        (`kl_optimum`) and `"tracking"` elsewhere; without one, `"fixed"`."""
        if self.kl_target is None:
            return "fixed"
        return "equilibrium" if self.kl_optimum() is not None else "tracking"

    def validate_kl_control(self) -> None:
        """Check every KL field, naming the valid choices and the fix; resolve `kl_controller=None` (the one
        automatic choice here) and parse `kl_controller_kwargs` given as JSON."""
        if self.kl_mode not in KL_MODES:
            raise choice_error("kl_mode", self.kl_mode, KL_MODES)
        if self.kl_estimator not in kl_estimators():
            raise choice_error("kl_estimator", self.kl_estimator, kl_estimators())
        if self.kl_target_unit not in KL_STATISTIC_UNITS:
            raise choice_error("kl_target_unit", self.kl_target_unit, KL_STATISTIC_UNITS)
        if self.kl_loss_agg_mode not in LOSS_AGG_MODES:
            raise choice_error("kl_loss_agg_mode", self.kl_loss_agg_mode, LOSS_AGG_MODES)
        if self.kl_value_clamp is not None and not self.kl_value_clamp > 0:
            raise ValueError(f"`kl_value_clamp` must be > 0 or None (off), got {self.kl_value_clamp}.")
        optimum, why = self._optimum_and_why()
        if self.kl_controller is None:
            self.kl_controller = self.default_controller()
        if self.kl_controller not in kl_controllers():
            raise choice_error("kl_controller", self.kl_controller, kl_controllers())
        if get_kl_controller(self.kl_controller).reads_sequences and optimum is None:
            raise ValueError(
                f"`kl_controller='{self.kl_controller}'` sets beta from the batch's estimate of the coefficient whose "
                f"KL-regularised optimum has the target KL, but {why}. Use kl_controller='tracking' (or 'pid'), which "
                "read only the KL statistic, or a KL whose optimum is known: k1 in the reward, or k2, an X+ estimator, "
                "corrected_k3, full or k3 in the loss (docs/kl.md)."
            )
        self._validate_target()
        if isinstance(self.kl_controller_kwargs, str):  # from a command line
            try:
                self.kl_controller_kwargs = json.loads(self.kl_controller_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"`kl_controller_kwargs` must be a mapping (JSON on a command line), got "
                    f"{self.kl_controller_kwargs!r}: {err}."
                ) from None
        try:  # the controller's constants (gains, bounds, windows) are checked by building it once
            build_kl_controller(self)
        except (ValueError, TypeError) as err:
            raise ValueError(f"`kl_controller='{self.kl_controller}'`: {err}") from None

    def _validate_target(self) -> None:
        if not get_kl_controller(self.kl_controller).needs_target:
            if self.kl_coef < 0:
                raise ValueError(f"`kl_coef` must be >= 0, got {self.kl_coef}.")
            return
        if self.kl_mode == "none":
            raise ValueError(
                f"`kl_mode='none'` applies no KL term, so `kl_controller='{self.kl_controller}'` has nothing to "
                "adapt. Set `kl_controller='fixed'`, or choose kl_mode 'reward', 'loss' or 'both'."
            )
        if self.kl_target is None or not self.kl_target > 0:
            raise ValueError(
                f"`kl_controller='{self.kl_controller}'` needs a positive `kl_target` (got {self.kl_target}), in the "
                f"unit of `kl_target_unit` ('{self.kl_target_unit}'): e.g. 6.0 nats per sequence or 0.1 per token. "
                "Use `kl_controller='fixed'` for a constant coefficient."
            )
        if not self.kl_coef > 0:
            raise ValueError(
                f"`kl_controller='{self.kl_controller}'` scales the coefficient multiplicatively, so `kl_coef` must "
                f"be > 0 (got {self.kl_coef})."
            )

    @property
    def kl_modes_applied(self) -> tuple[str, ...]:
        """The places the KL term acts: a subset of ("reward", "loss")."""
        return KL_MODES[self.kl_mode]
