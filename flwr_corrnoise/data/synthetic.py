"""Per-learner online data streams for binary logistic regression: synthetic(α, β).

Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated Learning With
Correlated Noise" (Sec. V-A) trains ``min_x mean log(1 + exp(−b·⟨x, a⟩))`` on data "generated using
the method described in [38]", the synthetic(α, β) generator of Li et al. (FedProx, "Federated
optimization in heterogeneous networks"). That generator, per learner ``i``::

    u_i ~ N(0, α)          B_i ~ N(0, β)
    w_i ~ N(u_i, 1)^d      b_i ~ N(u_i, 1)          (the learner's true model)
    v_i[j] ~ N(B_i, 1)     x ~ N(v_i, Σ),  Σ = diag(j^−1.2), j = 1..d
    label = argmax softmax(W_i x + b_i)             (multi-class)

Why it cannot be used as is for *binary* labels. The naive binary version,
``y = sign(w_iᵀx + b_i)``, is dominated by the learner's feature mean: ``w_iᵀv_i`` has
standard deviation ≈ √(d(1+α)(1+β)) ≈ 11 while the within-learner part ``w_iᵀ(x − v_i)``
has standard deviation ≈ √((1+α)·Σ_j j^−1.2) ≈ 2.0. So each learner's labels are almost
constant (measured over 5 seeds: 85 % of the learners have < 10 % or > 90 % positives),
and a global linear model reaches ≈ 96 % test accuracy by learning *which learner a point
came from* (``θᵀv_i``), not the labelling rule; predicting each learner's majority label
already gives 95 %. Every training method then saturates near the same
accuracy and the differences between noise mechanisms disappear.

The adaptation used here keeps every FedProx parameter and its distribution, and changes
two things:

1. **Centred labelling** (``centered=True``): ``y = sign(w_iᵀ(x − v_i) + b_i)``. The label
   depends on where a point lies *within* its learner's cloud, so each learner's labels are
   roughly balanced (``b_i ~ N(u_i, 1)`` against a margin of standard deviation ≈ 4.3 with
   the defaults; measured over 50 seeds × 20 learners: 90 % of the learners have between
   33 % and 68 % positives, all between 16 % and 82 %). The feature shift ``v_i`` (β) still
   makes the learners' inputs differ, as in FedProx.
2. **A shared model component** (``shared_scale``): ``w_i = w_g + w̃_i`` with
   ``w_g ~ N(0, shared_scale²)^d`` common to all learners and ``w̃_i ~ N(u_i, 1)^d`` the
   FedProx model. Without it the learners' models are independent random vectors and no
   single global model is good for all of them; with it a global model is good but not
   perfect, because the learner-specific parts (and α, through ``u_i``) disagree. With the
   defaults (``shared_scale = 2``) the best single global logistic model reaches ≈ 83 %
   held-out accuracy against ≈ 52 % for the majority predictor, and noiseless online
   FedAvg ≈ 76 % (numbers in ``docs/data.md``), which leaves room for noisier methods to
   show lower accuracy.

``label_noise`` flips each label independently with that probability (an optional way to
make the Bayes accuracy smaller still). ``shared_scale=0, centered=False`` is the naive
FedProx adaptation, kept for comparison.

**Drift** (the paper's dynamic setting, "the best predictor may vary with season"): all
learners' models rotate together, ``w_i(p) = R(p)·w_i`` with ``R(p) = exp(drift·p·K)``
and ``K = Q J Qᵀ`` a fixed random skew-symmetric orthogonal matrix (``Q`` orthogonal,
``J`` block-diagonal 90° rotations). Because ``K² = −I`` (even ``d``),
``R(p) w = cos(drift·p)·w + sin(drift·p)·K w``: every model turns by exactly
``drift·p`` radians after ``p`` stream positions, and since the rotation is common the
*global* optimum moves too (an independent rotation per learner would only blur it).
``drift`` is in radians per stream position (per local step); the motion is periodic
with period ``2π/drift``. For odd ``d`` the component of ``w`` along the one direction
``K`` leaves fixed is not rotated (the rest turns by ``drift·p``; norms are kept).

**Random access.** A stream position is an ``int``; the datum at position ``p`` of learner
``i`` depends only on ``(config, i, p)``. Data are generated in blocks of
:data:`BLOCK_SIZE` positions, each block from its own generator keyed by
``[seed, tag, learner, block]``, and a small LRU cache of blocks makes sequential reads of a
few points cheap. Changing :data:`BLOCK_SIZE` changes the data, so it is a module constant,
not a setting.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Positions per generated block. Part of the data's definition: do not change.
BLOCK_SIZE = 128

# Tags that separate the independent random streams derived from one seed.
_TAG_GLOBAL = 0  # shared model component and the drift rotation
_TAG_LEARNER = 1  # per-learner generative parameters
_TAG_DATA = 2  # per-learner training streams
_TAG_TEST = 3  # the held-out mixture stream

_SIGMA_EXPONENT = -1.2  # Σ = diag(j^−1.2), as in FedProx


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that determines a synthetic federation (and hence every datum).

    Attributes:
        num_learners: number of learners ``n`` (Zhang et al.: 20).
        dim: feature dimension ``d`` (Zhang et al.: 100).
        alpha: FedProx α, the variance of ``u_i``, i.e. how much the learners' models
            (and biases) differ in mean.
        beta: FedProx β, the variance of ``B_i``, i.e. how much the learners' feature
            means differ.
        drift: rotation of all true models, radians per stream position; 0 = static.
        label_noise: probability of flipping each label (train and test), in ``[0, 0.5]``.
        seed: master seed; every random quantity is derived from it.
        shared_scale: standard deviation of the entries of the model component ``w_g``
            shared by all learners; 0 gives FedProx's independent models.
        centered: label with ``w_iᵀ(x − v_i) + b_i`` (True, balanced labels) or with
            FedProx's ``w_iᵀx + b_i`` (False, nearly constant labels per learner).
        mean_spread: standard deviation of the entries of ``v_i`` around ``B_i`` (FedProx:
            1). Why a knob: the spread of ``v_i`` is a learner-specific offset no single
            linear model can absorb (it caps the centred task near 0.83); 0 leaves the
            learners' feature means at ``B_i·1``, a task a global model learns well (the
            demo's, ``experiments/demo.py``). The draws are the same for any value.
    """

    num_learners: int = 20
    dim: int = 100
    alpha: float = 0.1
    beta: float = 0.1
    drift: float = 0.0
    label_noise: float = 0.0
    seed: int = 0
    shared_scale: float = 2.0
    centered: bool = True
    mean_spread: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_learners", "dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("alpha", "beta", "shared_scale", "mean_spread"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(self.drift):
            raise ValueError(f"drift must be finite, got {self.drift!r}")
        if not (0.0 <= self.label_noise <= 0.5):
            raise ValueError(f"label_noise must be in [0, 0.5], got {self.label_noise!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy seed sequences), got {self.seed!r}")


def _check_position(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class SyntheticFederation:
    """The generative parameters of ``n`` learners' streams; data are made on demand.

    Holds only ``O(n·d + d²)`` numbers (models, biases, feature means, the drift rotation);
    the stream itself is never materialized, so a learner whose position is saved and
    restored (e.g. in Flower's ``context.state``) gets the same data back.

    Example:
        >>> fed = SyntheticFederation(SyntheticConfig(num_learners=3, dim=5))
        >>> a, y = fed.learner_batch(learner=1, start=10, count=4)
        >>> a.shape, y.shape
        ((4, 5), (4,))
        >>> b, _ = fed.learner_batch(learner=1, start=12, count=1)
        >>> bool(np.array_equal(a[2], b[0]))
        True
    """

    def __init__(self, config: SyntheticConfig | None = None, *, cache_blocks: int = 0) -> None:
        """Derive all generative parameters from ``config``.

        Args:
            config: the federation's definition (default: Zhang et al.'s setting).
            cache_blocks: how many generated blocks to keep; 0 picks ``max(64, 4n)`` so
                that round-robin access over all learners never regenerates a block.
        """
        self.config = config if config is not None else SyntheticConfig()
        cfg = self.config
        n, d = cfg.num_learners, cfg.dim
        self._sqrt_sigma = np.arange(1, d + 1, dtype=float) ** (_SIGMA_EXPONENT / 2)

        # Shared component and drift rotation. Independent of n, so adding learners keeps
        # the existing ones unchanged.
        g_rng = np.random.default_rng([cfg.seed, _TAG_GLOBAL])
        shared = cfg.shared_scale * g_rng.standard_normal(d)

        self._u = np.empty(n)
        self._shift = np.empty(n)  # B_i
        self._models = np.empty((n, d))
        self._biases = np.empty(n)
        self._means = np.empty((n, d))
        for i in range(n):
            rng = np.random.default_rng([cfg.seed, _TAG_LEARNER, i])
            u_i = rng.normal(0.0, math.sqrt(cfg.alpha))
            b_shift = rng.normal(0.0, math.sqrt(cfg.beta))
            self._u[i] = u_i
            self._shift[i] = b_shift
            self._models[i] = shared + u_i + rng.standard_normal(d)
            self._biases[i] = u_i + rng.standard_normal()
            self._means[i] = b_shift + cfg.mean_spread * rng.standard_normal(d)
        if cfg.drift != 0.0:
            # Drawn after the shared component from the same generator, and only when
            # needed (a QR of d×d): the static data do not depend on it.
            q, r = np.linalg.qr(g_rng.standard_normal((d, d)))
            q = q * np.sign(np.diag(r))  # Haar-distributed orthogonal matrix
            half = d // 2
            # K = Q J Qᵀ, J = blockdiag([[0, −1], [1, 0]]) on coordinate pairs (2k, 2k+1).
            q_even, q_odd = q[:, 0 : 2 * half : 2], q[:, 1 : 2 * half : 2]
            self._rot_k = q_odd @ q_even.T - q_even @ q_odd.T
            # Split w_i = fixed + rotating part; K·rot is where the rotating part turns to
            # (fixed = 0 for even d, where K is orthogonal).
            if d % 2:
                axis = q[:, d - 1]
                self._models_fixed = np.outer(self._models @ axis, axis)
            else:
                self._models_fixed = np.zeros((n, d))
            self._models_rot = self._models - self._models_fixed
            self._models_perp = self._models_rot @ self._rot_k.T

        self._cache_blocks = cache_blocks if cache_blocks > 0 else max(64, 4 * n)
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self._test_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    # -- properties ---------------------------------------------------------------------
    @property
    def num_learners(self) -> int:
        """Number of learners ``n``."""
        return self.config.num_learners

    @property
    def dim(self) -> int:
        """Feature (and model) dimension ``d``."""
        return self.config.dim

    @property
    def feature_means(self) -> np.ndarray:
        """``v_i`` for every learner, shape ``(n, d)`` (a copy)."""
        return self._means.copy()

    @property
    def biases(self) -> np.ndarray:
        """``b_i`` for every learner, shape ``(n,)`` (a copy)."""
        return self._biases.copy()

    @property
    def feature_std(self) -> np.ndarray:
        """``√diag(Σ)``: per-coordinate standard deviation of ``x − v_i``, shape ``(d,)``."""
        return self._sqrt_sigma.copy()

    def true_models(self, position: int = 0) -> np.ndarray:
        """The learners' labelling models ``w_i(position)``, shape ``(n, d)``.

        With ``drift = 0`` these do not depend on ``position``.
        """
        return self._models_at(_check_position("position", position))

    def _models_at(self, position: int) -> np.ndarray:
        if self.config.drift == 0.0:
            return self._models.copy()
        phi = self.config.drift * position
        return (
            self._models_fixed
            + math.cos(phi) * self._models_rot
            + math.sin(phi) * self._models_perp
        )

    # -- streams ------------------------------------------------------------------------
    def learner_batch(self, learner: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Data at stream positions ``start .. start+count−1`` of ``learner``.

        Returns:
            ``(features, labels)`` with shapes ``(count, d)`` and ``(count,)``; labels are
            ``−1.0`` or ``+1.0``. The arrays are fresh copies (safe to modify).

        The datum at a position is the same however the positions are requested (one at a
        time, in chunks, out of order), because each block of :data:`BLOCK_SIZE`
        positions has its own generator.
        """
        learner = self._check_learner(learner)
        start = _check_position("start", start)
        count = _check_position("count", count)
        d = self.dim
        if count == 0:
            return np.empty((0, d)), np.empty(0)
        end = start + count
        first, last = start // BLOCK_SIZE, (end - 1) // BLOCK_SIZE
        if first == last:
            feats, labels = self._block(learner, first)
            lo = start - first * BLOCK_SIZE
            return feats[lo : lo + count].copy(), labels[lo : lo + count].copy()
        out_x = np.empty((count, d))
        out_y = np.empty(count)
        filled = 0
        for blk in range(first, last + 1):
            feats, labels = self._block(learner, blk)
            lo = max(start, blk * BLOCK_SIZE) - blk * BLOCK_SIZE
            hi = min(end, (blk + 1) * BLOCK_SIZE) - blk * BLOCK_SIZE
            out_x[filled : filled + hi - lo] = feats[lo:hi]
            out_y[filled : filled + hi - lo] = labels[lo:hi]
            filled += hi - lo
        return out_x, out_y

    def test_set(self, size: int, position: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A held-out sample of the equal-weight mixture of all learners' distributions.

        Point ``j`` comes from learner ``j mod n`` (so every learner is equally
        represented) with fresh within-learner noise, independent of all training streams;
        its label uses the models at stream ``position`` (only matters with drift), and
        the same ``label_noise``. ``test_set(m)`` is a prefix of ``test_set(m')`` for
        ``m < m'`` at the same position, so a larger test set only adds points.

        The features of the last requested size are cached, so evaluating every round at
        a new ``position`` (drift) only recomputes the labels.
        """
        size = _check_position("size", size)
        position = _check_position("position", position)
        d, n = self.dim, self.num_learners
        if size == 0:
            return np.empty((0, d)), np.empty(0)
        cached = self._test_cache
        if cached is not None and cached[0] == size:
            eps, unif = cached[1], cached[2]
        else:
            num_blocks = -(-size // BLOCK_SIZE)
            eps = np.empty((num_blocks * BLOCK_SIZE, d))
            unif = np.empty(num_blocks * BLOCK_SIZE)
            for blk in range(num_blocks):
                rng = np.random.default_rng([self.config.seed, _TAG_TEST, 0, blk])
                sl = slice(blk * BLOCK_SIZE, (blk + 1) * BLOCK_SIZE)
                eps[sl], unif[sl] = self._draw_noise(rng)
            eps, unif = eps[:size], unif[:size]
            self._test_cache = (size, eps, unif)
        learners = np.arange(size) % n
        models = self._models_at(position)
        feats = self._means[learners] + eps
        inputs = eps if self.config.centered else feats
        margins = np.einsum("ij,ij->i", inputs, models[learners]) + self._biases[learners]
        return feats, self._labels(margins, unif)

    # -- internals ----------------------------------------------------------------------
    def _check_learner(self, learner: int) -> int:
        if (
            isinstance(learner, bool)
            or not isinstance(learner, int | np.integer)
            or not 0 <= learner < self.num_learners
        ):
            raise ValueError(f"learner must be an int in [0, {self.num_learners}), got {learner!r}")
        return int(learner)

    def _draw_noise(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Within-learner feature noise ``x − v ~ N(0, Σ)`` and one uniform per datum.

        The uniform (for label flips) is drawn even when ``label_noise = 0`` so that data
        with different ``label_noise`` differ only in the flipped labels.
        """
        eps = rng.standard_normal((BLOCK_SIZE, self.dim)) * self._sqrt_sigma
        return eps, rng.random(BLOCK_SIZE)

    def _labels(self, margins: np.ndarray, unif: np.ndarray) -> np.ndarray:
        labels = np.where(margins >= 0.0, 1.0, -1.0)
        if self.config.label_noise > 0.0:
            labels[unif < self.config.label_noise] *= -1.0
        return labels

    def _block(self, learner: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        key = (learner, block)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        rng = np.random.default_rng([self.config.seed, _TAG_DATA, learner, block])
        eps, unif = self._draw_noise(rng)
        feats = self._means[learner] + eps
        positions = block * BLOCK_SIZE + np.arange(BLOCK_SIZE)
        phi = self.config.drift * positions
        inputs = eps if self.config.centered else feats
        if self.config.drift == 0.0:
            margins = inputs @ self._models[learner]
        else:
            margins = (
                inputs @ self._models_fixed[learner]
                + np.cos(phi) * (inputs @ self._models_rot[learner])
                + np.sin(phi) * (inputs @ self._models_perp[learner])
            )
        labels = self._labels(margins + self._biases[learner], unif)
        feats.flags.writeable = False
        labels.flags.writeable = False
        with self._lock:
            self._cache[key] = (feats, labels)
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
        return feats, labels

    def __getstate__(self) -> dict[str, Any]:
        # Ship the parameters, not the cache or the lock (e.g. to a Ray worker).
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        state["_test_cache"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
