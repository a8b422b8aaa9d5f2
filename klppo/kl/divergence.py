"""Which divergence does a KL configuration actually follow?

``divergence_followed(estimator, mode, off_policy=False)`` answers, for one estimator applied in
the reward (detached, through the return with reward-to-go) or in the loss (backpropagated), what
the expected gradient is the gradient of. It encodes the estimator table of `docs/kl.md`
(Schulman 2020; Tang & Munos 2025; "Rethinking KL Regularization in RLHF" 2025; "A Comedy of
Estimators" 2025; DeepSeek-V3.2 Eq. 7). Notation: ``d = log pi - log ref``, ``r = ref / pi``,
``s = grad log pi``, ``w = pi / pi_old``.

"Unbiased" means: an unbiased estimate of grad KL(pi_theta || pi_ref). In loss mode that holds per
token (per position for ``full``); the sequence-level KL also depends on how a token changes the
later positions' distributions, which only the reward path (reward-to-go) captures (Tang & Munos
2025).

The estimator table of `docs/kl.md` is generated from here. Regenerate it with::

    python -m klppo.kl.divergence --write-readme docs/kl.md

and check it with ``python -m klppo.kl.divergence --check docs/kl.md`` (exit status 1 on drift);
without arguments the table is printed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .estimators import BUILTIN_KL_ESTIMATORS, get_kl_estimator_spec
from .penalty import KL_PLACES

__all__ = [
    "DivergenceInfo",
    "divergence_followed",
    "estimator_table_markdown",
    "replace_readme_table",
    "readme_table_block",
    "README_TABLE_START",
    "README_TABLE_END",
    "KL_PLACES",
]

README_TABLE_START = "<!-- estimator-table:start -->"
README_TABLE_END = "<!-- estimator-table:end -->"
CONTROLLER_TABLE_START = "<!-- controller-table:start -->"
CONTROLLER_TABLE_END = "<!-- controller-table:end -->"

REVERSE = "KL(pi||ref)"
FORWARD = "KL(ref||pi)"
NONE = "none (zero expected gradient)"


@dataclass(frozen=True)
class DivergenceInfo:
    """divergence: what the expected gradient is the gradient of. unbiased: True only for an unbiased
    gradient of KL(pi||ref). message: one line for people (usable as a warning)."""

    divergence: str
    unbiased: bool
    message: str


def _reward_info(base: str, estimator: str) -> DivergenceInfo:
    if base == "k1":
        return DivergenceInfo(REVERSE, True,
            f"{estimator} in the reward: with reward-to-go (gamma = 1) the policy gradient E[k1 * s] is the "
            "unbiased gradient of the sequence-level KL(pi||ref).")
    if base in ("k3", "low_var_kl", "corrected_k3"):
        extra = {
            "k3": "",
            "low_var_kl": " (and the [-10, 10] output clamp biases the value further)",
            "corrected_k3": " (rewards are computed at rollout time where pi = pi_old, so w = 1)",
        }[base]
        return DivergenceInfo(f"biased mix: grad {REVERSE} - grad {FORWARD}", False,
            f"{estimator} in the reward follows grad KL(pi||ref) - grad KL(ref||pi), not grad KL(pi||ref){extra}; "
            "reported to destabilise training: use k1 in the reward, or this estimator as a loss.")
    if base == "k2":
        return DivergenceInfo(f"biased mix: grad E_pi[k2] - grad {REVERSE}", False,
            f"{estimator} in the reward follows grad E_pi[d^2/2] - grad KL(pi||ref), not a KL: use k1 in the reward "
            "(k2 belongs in the loss).")
    if base == "abs":
        return DivergenceInfo("biased mix: grad E_pi|d| - grad sum_x |pi(x) - ref(x)|", False,
            f"{estimator} in the reward follows grad E_pi|d| - grad sum|pi - ref|, not a KL: use k1 in the reward.")
    if base == "full":
        return DivergenceInfo(f"partial: score-function part of grad {REVERSE}", False,
            "full in the reward: the per-position KL depends on theta directly too, and only the loss path sees that "
            "part; the gradient of the sequence KL(pi||ref) is exact only with full also in the loss (same coefficient).")
    raise KeyError(base)


def _loss_info(base: str, estimator: str, plus: bool, off_policy: bool) -> DivergenceInfo:
    if base == "full":
        where = " (positions are those sampled by pi_old)" if off_policy else ""
        return DivergenceInfo(REVERSE, True,
            f"full as a loss: the exact gradient of the per-position KL(pi||ref){where}; the effect of a token on "
            "later positions is not included (use k1 in the reward for that).")
    if plus:
        if off_policy:
            return DivergenceInfo("neither KL direction (k2 gradient without importance weight)", False,
                f"{estimator} as a loss off-policy (pi != pi_old): the straight-through k2 gradient E_old[d * s] has no "
                "importance weight, so it follows neither KL; use corrected_k3.")
        return DivergenceInfo(REVERSE, True,
            f"{estimator} as a loss: value of {base}, gradient of k2 (d * s), the unbiased per-token gradient of "
            "KL(pi||ref) on-policy.")
    if base == "corrected_k3":
        return DivergenceInfo(REVERSE, True,
            f"{estimator} as a loss: grad(w * k3) = w * d * s, the unbiased per-token gradient of KL(pi||ref) "
            "on- and off-policy (DeepSeek-V3.2 Eq. 7); without old_logp it falls back to k3 (forward KL).")
    if off_policy:
        grad = {"k1": "E_old[s] = grad E_old[log pi] (pushes pi away from pi_old)",
                "k2": "E_old[d * s]", "k3": "E_old[(1 - r) * s]", "low_var_kl": "E_old[(1 - r) * s]",
                "abs": "E_old[sign(d) * s]"}[base]
        return DivergenceInfo("neither KL direction (no importance weight)", False,
            f"{estimator} as a loss off-policy (pi != pi_old): the expected gradient {grad} has no importance weight "
            "and follows neither KL; use corrected_k3 (or k2 weighted by stopgrad(pi/pi_old)).")
    if base == "k1":
        return DivergenceInfo(NONE, False,
            f"{estimator} as a loss: its gradient is the score s, whose expectation is 0: noise, no regularisation; "
            "use k1 in the reward or k2 / k3+ as a loss.")
    if base == "k2":
        return DivergenceInfo(REVERSE, True,
            f"{estimator} as a loss: gradient d * s, the unbiased per-token gradient of KL(pi||ref) on-policy "
            "(k2 loss == k1 reward, token-wise).")
    if base in ("k3", "low_var_kl"):
        clamp = ("; the [-10, 10] output clamp also removes the gradient of the most divergent tokens"
                 if base == "low_var_kl" else "")
        return DivergenceInfo(FORWARD, False,
            f"{estimator} as a loss follows KL(ref||pi), the FORWARD KL: its value estimates KL(pi||ref) but its "
            f"gradient (1 - r) * s is that of KL(ref||pi){clamp}; use k3+ or k2 for the reverse KL.")
    if base == "abs":
        return DivergenceInfo("total variation: sum_x |pi(x) - ref(x)|", False,
            f"{estimator} as a loss: gradient sign(d) * s, whose expectation is the gradient of sum|pi - ref| "
            "(twice the total variation), not of a KL.")
    raise KeyError(base)


def divergence_followed(estimator: str, mode: str, off_policy: bool = False) -> DivergenceInfo:
    """What the expected gradient of ``estimator`` applied in ``mode`` follows.

    Args:
        estimator: a registered estimator name (``"full"``: the exact full-vocabulary KL).
        mode: ``"reward"`` or ``"loss"`` (call once per applied mode for ``kl_mode="both"``).
        off_policy: the loss is taken at theta != theta_old (later PPO epochs / mini-batches).
            Reward-mode answers do not depend on it: rewards are computed at rollout time, and
            the PPO ratio importance-weights the advantage.
    """
    if mode not in KL_PLACES:
        raise ValueError(f"Unknown KL mode {mode!r}; divergence_followed takes one of {', '.join(KL_PLACES)}")
    spec = get_kl_estimator_spec(estimator)  # ValueError for unknown names
    base, plus = spec.base, spec.straight_through
    known = base in BUILTIN_KL_ESTIMATORS
    if not known:
        return DivergenceInfo("unknown (custom estimator)", False,
            f"{estimator} is a custom estimator: klppo does not know which divergence its gradient follows.")
    if mode == "reward":
        return _reward_info(base, estimator)
    return _loss_info(base, estimator, plus, off_policy)


def _cell(info: DivergenceInfo) -> str:
    return f"{'yes' if info.unbiased else 'no'}: {info.divergence}".replace("|", "\\|")


def estimator_table_markdown() -> str:
    """The estimator table of `docs/kl.md` (markdown), generated from the registry and ``divergence_followed``."""
    lines = [
        "Generated by `python -m klppo.kl.divergence --write-readme docs/kl.md`. "
        "`d = logp - ref_logp`, `w = pi / pi_old`; \"yes\" = unbiased gradient of KL(pi\\|\\|ref) "
        "(per token in loss mode; with reward-to-go in reward mode).",
        "",
        "| name | value formula | gradient in reward mode | gradient in loss mode (on-policy) | off-policy loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows = []
    for name in BUILTIN_KL_ESTIMATORS:
        spec = get_kl_estimator_spec(name)
        if spec.straight_through:
            formula = f"value of `{spec.base}`, gradient of `k2`"
        elif spec.needs_logits:
            formula = f"`{spec.formula}` over the vocabulary (`full_kl`, from logits)"
        else:
            formula = f"`{spec.formula}`"
        rows.append((name, formula))
    for name, formula in rows:
        cells = [
            f"`{name}`",
            formula,
            _cell(divergence_followed(name, "reward")),
            _cell(divergence_followed(name, "loss")),
            _cell(divergence_followed(name, "loss", off_policy=True)),
        ]
        lines.append("| " + " | ".join(cell.replace("\n", " ") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _generated_blocks() -> dict:
    """``{(start marker, end marker): generator}`` of every README table generated from a registry."""
    from .controllers import controller_table_markdown

    return {
        (README_TABLE_START, README_TABLE_END): estimator_table_markdown,
        (CONTROLLER_TABLE_START, CONTROLLER_TABLE_END): controller_table_markdown,
    }


def readme_table_block(text: str, start_marker: str = README_TABLE_START, end_marker: str = README_TABLE_END) -> str:
    """The text between two README markers (exclusive); ValueError if the markers are missing."""
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        raise ValueError(f"README lacks the markers {start_marker} ... {end_marker}")
    return text[start + len(start_marker):end]


def replace_readme_table(text: str) -> str:
    """``text`` with the estimator table (required) and the controller table (where its markers are)
    regenerated between their markers."""
    readme_table_block(text)  # the estimator markers are required
    for (start_marker, end_marker), generate in _generated_blocks().items():
        if start_marker not in text:
            continue
        readme_table_block(text, start_marker, end_marker)
        start = text.find(start_marker) + len(start_marker)
        text = text[:start] + "\n" + generate() + text[text.find(end_marker):]
    return text


def stale_readme_tables(text: str) -> list[str]:
    """The start markers of the generated tables in ``text`` that differ from what the registries give."""
    return [
        start for (start, end), generate in _generated_blocks().items()
        if start in text and readme_table_block(text, start, end).strip() != generate().strip()
    ]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print, write or check the estimator and controller tables of docs/kl.md.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write-readme", metavar="PATH", help="rewrite the table between the markers in PATH")
    group.add_argument("--check", metavar="PATH", help="exit 1 if the table in PATH is out of date")
    args = parser.parse_args(argv)
    if args.write_readme:
        with open(args.write_readme, encoding="utf-8") as f:
            text = f.read()
        with open(args.write_readme, "w", encoding="utf-8") as f:
            f.write(replace_readme_table(text))
        return 0
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            text = f.read()
        readme_table_block(text)
        if stale_readme_tables(text):
            print(f"{args.check}: {', '.join(stale_readme_tables(text))} out of date; run "
                  f"python -m klppo.kl.divergence --write-readme {args.check}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(estimator_table_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
