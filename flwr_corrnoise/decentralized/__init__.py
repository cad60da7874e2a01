"""Decentralized (peer-to-peer) locally differentially private online learning.

Pure NumPy/SciPy: graphs and mixing matrices, Laplace (pure-DP) machinery, the algorithms of
Chen & Wang ("Locally Differentially Private Distributed Online Learning with Guaranteed
Optimality") and Wang, Yang, Yao, Song & Wan ("Revisiting Differentially Private Algorithms for
Decentralized Online Learning") as per-node update rules, their privacy
accountants and a vectorized in-process engine. Nothing here imports Flower; the Flower relay
(``flwr_corrnoise.flower.relay``) calls these same functions.
"""

# One `import name as name` line per public name (the rest is one level down: `graphs`,
# `laplace`, `sets`, `gossip`, `tasks`, …, imported as submodules).
# imported for its registration of the "synthetic-multiclass" task (the class stays one level down)
from flwr_corrnoise.decentralized import multiclass as _multiclass  # noqa: F401
from flwr_corrnoise.decentralized.baselines import DOLA as DOLA
from flwr_corrnoise.decentralized.baselines import DSGD as DSGD
from flwr_corrnoise.decentralized.baselines import PDOP as PDOP
from flwr_corrnoise.decentralized.chen_wang import ChenWang as ChenWang
from flwr_corrnoise.decentralized.chen_wang import StepSizes as StepSizes
from flwr_corrnoise.decentralized.engine import RunResult as RunResult
from flwr_corrnoise.decentralized.engine import run as run
from flwr_corrnoise.decentralized.engine import run_from_config as run_from_config
from flwr_corrnoise.decentralized.graphs import Graph as Graph
from flwr_corrnoise.decentralized.graphs import GraphError as GraphError
from flwr_corrnoise.decentralized.graphs import make_graph as make_graph
from flwr_corrnoise.decentralized.protocol import ALGORITHMS as ALGORITHMS
from flwr_corrnoise.decentralized.protocol import Inbox as Inbox
from flwr_corrnoise.decentralized.protocol import NodeAlgorithm as NodeAlgorithm
from flwr_corrnoise.decentralized.protocol import PrivacyProposalError as PrivacyProposalError
from flwr_corrnoise.decentralized.protocol import build_algorithm as build_algorithm
from flwr_corrnoise.decentralized.protocol import register as register
from flwr_corrnoise.decentralized.tasks import Task as Task
from flwr_corrnoise.decentralized.tasks import build_task as build_task
from flwr_corrnoise.decentralized.tasks import register_task as register_task
from flwr_corrnoise.decentralized.wang import PDFTGL as PDFTGL
from flwr_corrnoise.decentralized.wang import PDOCG as PDOCG
from flwr_corrnoise.decentralized.wang import PDOGD as PDOGD

__all__ = [
    "ALGORITHMS",
    "DOLA",
    "DSGD",
    "PDFTGL",
    "PDOCG",
    "PDOGD",
    "PDOP",
    "ChenWang",
    "Graph",
    "GraphError",
    "Inbox",
    "NodeAlgorithm",
    "PrivacyProposalError",
    "RunResult",
    "StepSizes",
    "Task",
    "build_algorithm",
    "build_task",
    "make_graph",
    "register",
    "register_task",
    "run",
    "run_from_config",
]
