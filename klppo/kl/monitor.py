"""The KL drift monitor: a warning, naming the fix, when the KL statistic stays far from its target."""

from __future__ import annotations

__all__ = ["KLDriftMonitor"]


class KLDriftMonitor:
    """Warn when the KL statistic stays far from its target: the controller is not holding it.

    An adaptive controller should keep the KL statistic near ``target``. When the statistic is
    above ``high * target`` (or below ``low * target``) for ``patience`` consecutive updates,
    :meth:`update` returns a warning once. It warns again only after the statistic has come back
    inside the band, or has crossed to the other side of it (a new kind of drift), so a run that
    stays out of band logs one message, not one per step.

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
        self.warned = False  # already warned for the current streak

    def update(self, value: float) -> str | None:
        """Record one value of the statistic; return a warning message or ``None``."""
        value = float(value)
        if value > self.high * self.target:
            side = "above"
        elif value < self.low * self.target:
            side = "below"
        else:
            side = None
        if side != self.side:
            self.side, self.streak, self.warned = side, 0, False
        if side is None:
            return None
        self.streak += 1
        if self.streak < self.patience or self.warned:
            return None
        self.warned = True
        return self._message(value)

    def _message(self, value: float) -> str:
        if self.side == "above":
            edge = f"above {self.high:g} x kl_target"
            advice = (
                "the KL penalty is too weak to hold it: raise kl_coef (or kl_coef_max, which may be capping "
                "an adaptive controller), shorten kl_horizon so the controller reacts faster, or lower the "
                "learning rate"
            )
        else:
            edge = f"below {self.low:g} x kl_target"
            advice = (
                "the KL penalty is too strong and the policy barely moves: lower kl_coef (or kl_coef_min, "
                "which may be holding an adaptive controller up) or shorten kl_horizon"
            )
        return (
            f"KL drift: {self.name} = {value:.4g} has been {edge} ({self.target:g}) for {self.streak} "
            f"consecutive updates; {advice}. Also check that kl_target is in the units of kl_target_unit "
            "(nats per token vs nats per sequence differ by about the response length)."
        )

    def state_dict(self) -> dict:
        return {
            "target": self.target,
            "patience": self.patience,
            "high": self.high,
            "low": self.low,
            "name": self.name,
            "side": self.side,
            "streak": self.streak,
            "warned": self.warned,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("target", "patience", "high", "low", "name", "side", "streak", "warned"):
            if key in state:
                setattr(self, key, state[key])
