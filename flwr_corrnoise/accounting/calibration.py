"""The record a Gaussian calibration returns: the noise std and everything needed to audit
it (the sensitivity it assumed, the accountant, the participation it covers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .events import GaussianRelease


@dataclass(frozen=True)
class Calibration:
    """The result of a calibration, with everything needed to audit it.

    Why here, below :mod:`flwr_corrnoise.privacy` and
    :mod:`flwr_corrnoise.amplification`: both calibrations return it (the amplified one a
    subclass), and the one calibration entry point (``privacy.calibrate_factorization``)
    calls the amplified one, so the type must live under both."""

    std: float  # V, the per-coordinate std of ξ
    epsilon: float
    delta: float
    clip_norm: float  # B_g
    sensitivity: float  # max_j ‖c_j‖ of the mechanism
    l2_sensitivity: float  # Δ = 2·B_g·sensitivity
    method: str  # "zcdp" or "exact"
    mechanism: str = ""
    steps: int = 0
    #: how often one datum enters the stream (``Participation.describe()``)
    participation: str = "each datum once"
    #: whether ``sensitivity`` is exact (a pattern reaches it) or a certified upper bound
    sensitivity_exact: bool = True

    @property
    def noise_multiplier(self) -> float:
        """``V/Δ``: the std in units of the L2 sensitivity."""
        return self.std / self.l2_sensitivity

    @property
    def release(self) -> GaussianRelease:
        """The calibrated release, as its accountant reads it."""
        return GaussianRelease(self.l2_sensitivity, self.std)

    def as_dict(self) -> dict[str, float | str | int]:
        return {**asdict(self), "noise_multiplier": self.noise_multiplier}
