"""KL control for klppo: pure tensor functions and small classes (torch and the stdlib only).

- ``estimators``: the built-in estimators (per-token ones and the exact ``full``, ``klppo.kl.full``), each declared
  whole where it is registered (``estimator_registry``: its value, and what its gradient follows in each place,
  ``KLGradient``), and ``estimate_kl``.
- ``controllers``: coefficient controllers behind a registry (fixed, adaptive, exponential, PID, tracking,
  equilibrium).
- ``penalty``: KL into per-token rewards or into the loss; loss aggregation modes.
- ``reduce``: token-weighted global statistics across ranks (one collective each), ``GlobalSums``.
- ``monitor``: ``KLDriftMonitor``, which warns when the statistic stays far from its target.
- ``optimum``: the optimum a KL configuration trains toward as a function of beta (``kl_optimum_of``,
  ``KLOptimum``), and its KL estimated from a batch: what the equilibrium controller solves for.
- ``divergence``: which divergence a configuration follows; the estimator table of `docs/kl.md`
  (imported on first use so that ``python -m klppo.kl.divergence`` runs cleanly).
"""

from .controllers import (
    AdaptiveKLController,
    EquilibriumKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    PIDKLController,
    TrackingKLController,
    build_kl_controller,
    get_kl_controller,
    kl_controllers,
    register_kl_controller,
    unregister_kl_controller,
)
from .estimate import compute_kl, estimate_kl, kl_from_log_ratio
from .estimators import (
    BUILTIN_KL_ESTIMATORS,
    KLGradient,
    full_kl,
    get_kl_estimator,
    get_kl_estimator_spec,
    kl_estimators,
    register_kl_estimator,
    unregister_kl_estimator,
)
from .monitor import KLDriftMonitor
from .optimum import KLOptimum, kl_optimum_of
from .penalty import KL_MODES, KL_PLACES, LOSS_AGG_MODES, aggregate_loss, kl_loss, kl_reward
from .reduce import (
    KL_STATISTIC_UNITS,
    GlobalSums,
    check_same_on_all_ranks,
    global_masked_mean,
    global_masked_whiten,
    global_sequence_sum_mean,
    kl_statistic,
    reduce_sum_count,
)

__all__ = [
    "get_kl_estimator",
    "get_kl_estimator_spec",
    "kl_estimators",
    "compute_kl",
    "kl_from_log_ratio",
    "estimate_kl",
    "full_kl",
    "register_kl_estimator",
    "unregister_kl_estimator",
    "BUILTIN_KL_ESTIMATORS",
    "KLGradient",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "ExponentialKLController",
    "PIDKLController",
    "TrackingKLController",
    "EquilibriumKLController",
    "build_kl_controller",
    "register_kl_controller",
    "unregister_kl_controller",
    "get_kl_controller",
    "kl_controllers",
    "kl_reward",
    "kl_loss",
    "aggregate_loss",
    "LOSS_AGG_MODES",
    "KL_MODES",
    "KL_PLACES",
    "reduce_sum_count",
    "global_masked_mean",
    "global_sequence_sum_mean",
    "global_masked_whiten",
    "kl_statistic",
    "KL_STATISTIC_UNITS",
    "GlobalSums",
    "check_same_on_all_ranks",
    "KLDriftMonitor",
    "divergence_followed",
    "KLOptimum",
    "kl_optimum_of",
    "DivergenceInfo",
    "estimator_table_markdown",
]

_LAZY = {"divergence_followed", "DivergenceInfo", "estimator_table_markdown"}


def __getattr__(name):
    if name in _LAZY:
        from . import divergence

        return getattr(divergence, name)
    raise AttributeError(f"module 'klppo.kl' has no attribute {name!r}")
