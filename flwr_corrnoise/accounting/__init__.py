"""Privacy accounting, split as ``dp_accounting`` splits it: *events* describe a release
(:mod:`.events`), *accountants* turn a description into ``(ε, δ)`` (:mod:`.gaussian`,
:mod:`.pure`). Pure NumPy/SciPy/mpmath: no Flower, no torch, no mechanism code.

Who builds which event:

* a learner's matrix-factorization release — one :class:`GaussianRelease` of ℓ2 sensitivity
  ``2·B_g·max_j ‖c_j‖`` over the rows released so far
  (:meth:`flwr_corrnoise.mechanisms.Factorization.release`), accounted by
  :class:`AnalyticGaussianAccountant` (``"exact"``) or :class:`ZCdpAccountant` (``"zcdp"``);
  :mod:`flwr_corrnoise.privacy` calibrates and reports through them;
* Chen & Wang's ("Locally Differentially Private Distributed Online Learning with Guaranteed
  Optimality") nodes and baselines — a :class:`LaplaceSeries` (one release per step, a labelled
  sensitivity bound each) or a :class:`PerDatumLaplace`; Wang, Yang, Yao, Song & Wan's ("Revisiting
  Differentially Private Algorithms for Decentralized Online Learning") — a
  :class:`SelfComposed` Laplace release per tree position, a :class:`WorstCase` over data
  owners or releases; all accounted by :class:`BasicComposition`
  (:mod:`flwr_corrnoise.decentralized.chen_wang_privacy`, ``wang_privacy``).
"""

from .base import (
    Accountant,
    PrivacyBudgetError,
    Release,
    UnsupportedEventError,
    check_budget,
)
from .events import (
    Composed,
    GaussianRelease,
    LaplaceRelease,
    LaplaceSeries,
    NoRelease,
    PerDatumLaplace,
    SelfComposed,
)
from .gaussian import AnalyticGaussianAccountant, GaussianAccountant, ZCdpAccountant
from .pure import BasicComposition

#: the Gaussian accountants by the ``method`` name a calibration records
GAUSSIAN_ACCOUNTANTS: dict[str, GaussianAccountant] = {
    "zcdp": ZCdpAccountant(),
    "exact": AnalyticGaussianAccountant(),
}

__all__ = [
    "GAUSSIAN_ACCOUNTANTS",
    "Accountant",
    "AnalyticGaussianAccountant",
    "BasicComposition",
    "Composed",
    "GaussianAccountant",
    "GaussianRelease",
    "LaplaceRelease",
    "LaplaceSeries",
    "NoRelease",
    "PerDatumLaplace",
    "PrivacyBudgetError",
    "Release",
    "SelfComposed",
    "UnsupportedEventError",
    "ZCdpAccountant",
    "check_budget",
]
