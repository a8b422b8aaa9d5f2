"""The KL drift monitor: a warning, naming the fix, when the KL statistic stays far from its target."""

from __future__ import annotations

__all__ = ["KLDriftMonitor"]


class KLDriftMonitor:
    """Warn when the KL statistic stays far from its target: the controller is not holding it.

    An adaptive controller should keep the KL statistic near ``target``. When the statistic is
    above ``high * target`` (or below ``low * target``) for ``patience`` consecutive updates,
    :meth:`update` returns a warning. One excursion warns once: a side warns again only after the
    statistic has stayed inside the band for ``patience`` updates (a reading or two back inside is
    the same excursion), or after a warning about the other side (a new kind of drift).

    The policy starts at the reference, so the statistic starts near 0 and climbs towards the target:
    below the band is then the approach, not a penalty that is too strong. The low side therefore
    counts only once the statistic has reached the band (``>= low * target``) a first time.

    Args:
        target: the KL target, in the units of the statistic passed to :meth:`update`.
        patience: consecutive out-of-band updates before warning.
        high: upper edge of the band, as a multiple of ``target``.
        low: lower edge of the band, as a multiple of ``target``.
        name: the statistic's name in messages.
    """

    def __init__(self, target: float, patience: int = 5, high: float = 2.0, low: float = 0.5, name: str = "kl/value"):
        if not target > 0:
            raise ValueError(f"KLDriftMonitor target must be > 0, got {target}: pass the controller's kl_target.")
        if patience < 1:
            raise ValueError(f"KLDriftMonitor patience must be >= 1, got {patience}.")
        if not 0 <= low < 1 < high:
            raise ValueError(f"KLDriftMonitor needs 0 <= low < 1 < high, got low={low}, high={high}.")
        self.target = float(target)
        self.patience = int(patience)
        self.high = float(high)
        self.low = float(low)
        self.name = name
        self.side: str | None = None  # "above", "below" or None (inside the band)
        self.streak = 0  # consecutive updates on `side`
        self.warned: str | None = None  # the side warned about in the current excursion
        self.inside = 0  # consecutive updates inside the band
        self.reached = False  # the statistic has reached the band: the approach is over

    def update(self, value: float) -> str | None:
        """Record one value of the statistic; return a warning message or ``None``."""
        value = float(value)
        self.reached = self.reached or value >= self.low * self.target
        if value > self.high * self.target:
            side = "above"
        elif value < self.low * self.target:
            side = "below" if self.reached else None
            if side is None:
                return None  # the approach: nothing to count
        else:
            side = None
        if side is None:
            self.side, self.streak, self.inside = None, 0, self.inside + 1
            if self.inside >= self.patience:
                self.warned = None  # back for long enough: the excursion is over
            return None
        self.inside = 0
        if side != self.side:
            self.side, self.streak = side, 0
        self.streak += 1
        if self.streak < self.patience or self.warned == side:
            return None
        self.warned = side
        return self._message(value)

    def _message(self, value: float) -> str:
        if self.side == "above":
            edge = f"above {self.high:g} x kl_target"
            advice = (
                "the KL penalty is too weak to hold it: raise kl_coef (or the controller's coef_max in "
                "kl_controller_kwargs, which may be capping it), use the default controller (equilibrium where "
                "the KL's optimum is known, else tracking), or lower the learning rate"
            )
        else:
            edge = f"below {self.low:g} x kl_target"
            advice = (
                "the KL penalty is too strong and the policy barely moves: lower kl_coef (or the controller's "
                "coef_min in kl_controller_kwargs, which may be holding it up), or use the default controller "
                "(equilibrium where the KL's optimum is known, else tracking)"
            )
        return (
            f"KL drift: {self.name} = {value:.4g} has been {edge} ({self.target:g}) for {self.streak} "
            f"consecutive updates; {advice}. Also check that kl_target is in the units of kl_target_unit "
            "(nats per token vs nats per sequence differ by about the response length)."
        )

    _STATE = ("target", "patience", "high", "low", "name", "side", "streak", "warned", "inside", "reached")

    def state_dict(self) -> dict:
        return {key: getattr(self, key) for key in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for key in self._STATE:
            if key in state:
                setattr(self, key, state[key])
        if isinstance(self.warned, bool):  # saved when `warned` was a flag for the current side
            self.warned = self.side if self.warned else None
        if "reached" not in state:  # saved before the approach was told apart: assume it is over
            self.reached = True
