"""The papers' named data sets as decentralized tasks: ``mushrooms`` (Chen & Wang, "Locally
Differentially Private Distributed Online Learning with Guaranteed Optimality"), ``letter`` and
``poker`` (Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for
Decentralized Online Learning"). Importing this module registers them with
:func:`flwr_corrnoise.decentralized.tasks.register_task`, the same hook any user's task uses.

Why here and not in the library: their loaders read files from paper-specific places (Debian R
packages, the LIBSVM site's files) and are experiment code. ``simulations/`` imports this
module; ``flwr-corrnoise decentralized --task mushrooms`` imports it from the source checkout.
A Flower relay node that should run one of these tasks must import it in its app module too
(each process registers its own tasks).

Config keys: ``data-path`` (the user's file; default: the loader's offline source),
``num-nodes``; ``mushrooms`` also ``reg``, ``horizon``, ``data-seed``, ``feature-bound`` (as
``synthetic-logreg``); ``letter``/``poker`` the multiclass keys (``copies``, ``horizon``,
``classes``, ``data-seed``; ``poker`` also ``rows``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr_corrnoise.decentralized.multiclass import _task_from
from flwr_corrnoise.decentralized.tasks import LogisticTask, Task, register_task

__all__ = ["DATASET_TASKS"]

#: the task names this module registers
DATASET_TASKS = ("mushrooms", "letter", "poker")


@register_task("mushrooms")
def _mushrooms(cfg: Mapping[str, Any]) -> Task:
    from experiments.data.mushrooms import load_mushrooms, split_by_class

    X, y, _source = load_mushrooms(cfg.get("data-path") or None)
    n = int(cfg.get("num-nodes", 5))
    return LogisticTask(split_by_class(X, y, n), reg=float(cfg.get("reg", 1e-3)),
                        horizon=int(cfg.get("horizon", 2000)), seed=int(cfg.get("data-seed", 0)),
                        feature_bound=float(cfg.get("feature-bound", 1.0)), name="mushrooms")


@register_task("letter")
def _letter(cfg: Mapping[str, Any]) -> Task:
    from experiments.data.letter import load_letter

    X, y, source = load_letter(cfg.get("data-path") or None)
    return _task_from(X, y, cfg, source, 10 * int(cfg.get("num-nodes", 9)))


@register_task("poker")
def _poker(cfg: Mapping[str, Any]) -> Task:
    from experiments.data.poker import load_poker

    X, y, source = load_poker(cfg.get("data-path") or None, int(cfg.get("rows", 1_000_000)),
                              int(cfg.get("data-seed", 0)))
    return _task_from(X, y, cfg, source, int(cfg.get("num-nodes", 9)))
