"""A variant of the equilibrium controller's approach, tried and not kept, registered as ``equilibrium_projected``
for ablations: until the KL first reaches the target, beta is the equilibrium coefficient times
``(projected / target) ** approach_power`` with ``projected = kl + max(kl - previous, 0)`` (the reading plus its
last rise), and the first reading applies no factor. After the KL arrives, beta is the equilibrium coefficient alone
(the variant predates the shipped controller's hold). The guard is on by default only for the built-in
controllers' names, so the commands set it (from the repository root):

    python -m lab.controller_grid --plugin approach_projected \\
        --config '{"kl_controller": "equilibrium_projected", "experimental": {"kl_guard": true}}' --seeds 11 12 --out ...
    python -m lab.default_task_lr --plugin approach_projected --lrs 5e-4 --seeds 4 5 6 --out ... \\
        -- --kl_controller equilibrium_projected --experimental '{"kl_guard": true}'
"""

from klppo.kl.controllers import EquilibriumKLController, register_kl_controller, safe_log


@register_kl_controller("equilibrium_projected")
class ProjectedEquilibriumKLController(EquilibriumKLController):
    """The equilibrium controller with the approach on the projected reading (for ablations)."""

    def next_coef(self, kl: float, n_steps: int) -> float:
        previous = self.last_kl  # the reading before this one (the base class records it after each update)
        # the equilibrium step and the arrival; its factor on the last reading is dropped
        super().next_coef(kl, n_steps)
        if self.arrived or previous is None:
            return self.coef
        projected = kl + max(kl - previous, 0.0)
        return self.from_log(
            safe_log(self.coef) + self.approach_power * safe_log(min(max(projected, 0.0) / self.target, 1.0))
        )
