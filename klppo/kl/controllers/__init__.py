"""KL coefficient controllers.

Every controller has the same surface:

- ``.value``: the current coefficient beta (a Python float);
- ``.update(kl, n_steps) -> float``: feed the KL statistic of the latest rollout batch (already
  reduced over all ranks, see ``klppo.kl.reduce``) and the number of sequences in the GLOBAL batch;
  returns the new beta. Call it once per rollout batch, on every rank with the same inputs, so that
  the ranks stay identical. A NaN or infinite reading leaves beta unchanged and is counted in
  ``skipped_updates``.
- ``.state_dict()`` / ``.load_state_dict(d)``: a JSON-serialisable dict (checkpoint it: verl issue
  2653 shows what happens when beta is not saved). The state records the class, so loading it into
  another kind of controller fails. Hyperparameters are stored for the record but not restored: the
  constructor (the config of the resumed run) decides them.
- ``.name``: the registry name (``"fixed"``, ``"adaptive"``, ``"exponential"``, ``"pid"``,
  ``"tracking"``, ``"equilibrium"``, or one registered with :func:`register_kl_controller`).
- ``.observe_sequences(scores, log_ratios, lengths, unit)``: only controllers that read the batch itself
  (``reads_sequences``: ``"equilibrium"``) implement it (the base class's raises ``TypeError``); the trainer calls it before each ``update`` with every rank's sequences. Such a
  controller learns which optimum the configured KL trains toward from its constructor's ``optimum``
  (``klppo.kl.optimum.KLOptimum``), which the config passes.

Controllers live in a registry: a class decorated with ``@register_kl_controller(name)`` is buildable
by name from a config. Its constants (gains, bounds, windows) are its constructor's keyword
parameters; a config sets them through one mapping, ``kl_controller_kwargs``, checked against the
constructor, so each controller declares its own settings, once.

One module per family: ``base`` (the base class, the registry, building one from a config), ``classic`` (fixed,
Ziegler's adaptive, exponential, PID), ``tracking``, ``equilibrium``. They register in that order, the order of
``kl_controllers()`` and of the controller table in `docs/kl.md`.

The unit of the statistic (nats per token or per sequence) is the caller's choice; the target must
be given in the same unit.
"""

from ..optimum import equilibrium_log_coef, optimum_kl
from .base import (
    CONFIG_ARGUMENTS,
    KLController,
    LogSpaceController,
    build_kl_controller,
    controller_table_markdown,
    get_kl_controller,
    kl_controllers,
    register_kl_controller,
    safe_log,
    unregister_kl_controller,
)
from .classic import AdaptiveKLController, ExponentialKLController, FixedKLController, PIDKLController
from .tracking import TrackingKLController

# isort: split
# registered after `tracking`: the registration order is the order of `kl_controllers()`
from .equilibrium import EquilibriumKLController

__all__ = [
    "register_kl_controller",
    "unregister_kl_controller",
    "get_kl_controller",
    "kl_controllers",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "ExponentialKLController",
    "PIDKLController",
    "TrackingKLController",
    "EquilibriumKLController",
    "optimum_kl",
    "equilibrium_log_coef",
    "build_kl_controller",
    "controller_table_markdown",
    "CONFIG_ARGUMENTS",
    "LogSpaceController",
    "safe_log",
]
