"""Decentralized (peer-to-peer) locally differentially private online learning.

Pure NumPy/SciPy: graphs and mixing matrices, Laplace (pure-DP) machinery, the algorithms of
Chen & Wang ("Locally Differentially Private Distributed Online Learning with Guaranteed
Optimality") and Wang, Yang, Yao, Song & Wan ("Revisiting Differentially Private Algorithms for
Decentralized Online Learning") as per-node update rules, their privacy
accountants and a vectorized in-process engine. Nothing here imports Flower; the Flower relay
(``flwr_corrnoise.flower.relay``) calls these same functions.
"""

# One `import name as name` line per public name, so that modules can append theirs.
from flwr_corrnoise.decentralized.baselines import DOLA as DOLA
from flwr_corrnoise.decentralized.baselines import DSGD as DSGD
from flwr_corrnoise.decentralized.baselines import PDOP as PDOP
from flwr_corrnoise.decentralized.chen_wang import ChenWang as ChenWang
from flwr_corrnoise.decentralized.chen_wang import StepSizes as StepSizes
from flwr_corrnoise.decentralized.engine import RunResult as RunResult
from flwr_corrnoise.decentralized.engine import run as run
from flwr_corrnoise.decentralized.engine import run_from_config as run_from_config
from flwr_corrnoise.decentralized.gossip import gossip_polynomial as gossip_polynomial
from flwr_corrnoise.decentralized.gossip import mixing_matrix as mixing_matrix
from flwr_corrnoise.decentralized.graphs import Graph as Graph
from flwr_corrnoise.decentralized.graphs import GraphError as GraphError
from flwr_corrnoise.decentralized.graphs import complete as complete
from flwr_corrnoise.decentralized.graphs import cycle as cycle
from flwr_corrnoise.decentralized.graphs import eigenvalues as eigenvalues
from flwr_corrnoise.decentralized.graphs import from_adjacency as from_adjacency
from flwr_corrnoise.decentralized.graphs import from_edges as from_edges
from flwr_corrnoise.decentralized.graphs import is_doubly_stochastic as is_doubly_stochastic
from flwr_corrnoise.decentralized.graphs import laplacian_weights as laplacian_weights
from flwr_corrnoise.decentralized.graphs import make_graph as make_graph
from flwr_corrnoise.decentralized.graphs import metropolis_hastings as metropolis_hastings
from flwr_corrnoise.decentralized.graphs import ring as ring
from flwr_corrnoise.decentralized.graphs import second_singular_value as second_singular_value
from flwr_corrnoise.decentralized.graphs import spectral_gap as spectral_gap
from flwr_corrnoise.decentralized.graphs import watts_strogatz as watts_strogatz
from flwr_corrnoise.decentralized.laplace import LaplaceStream as LaplaceStream
from flwr_corrnoise.decentralized.laplace import ScaleSchedule as ScaleSchedule
from flwr_corrnoise.decentralized.laplace import basic_composition as basic_composition
from flwr_corrnoise.decentralized.laplace import epsilon_of_laplace as epsilon_of_laplace
from flwr_corrnoise.decentralized.laplace import laplace as laplace
from flwr_corrnoise.decentralized.laplace import scale_for_epsilon as scale_for_epsilon
from flwr_corrnoise.decentralized.multiclass import MulticlassTask as MulticlassTask
from flwr_corrnoise.decentralized.protocol import ALGORITHMS as ALGORITHMS
from flwr_corrnoise.decentralized.protocol import Inbox as Inbox
from flwr_corrnoise.decentralized.protocol import NodeAlgorithm as NodeAlgorithm
from flwr_corrnoise.decentralized.protocol import PrivacyProposalError as PrivacyProposalError
from flwr_corrnoise.decentralized.protocol import build_algorithm as build_algorithm
from flwr_corrnoise.decentralized.protocol import register as register
from flwr_corrnoise.decentralized.sets import L2Ball as L2Ball
from flwr_corrnoise.decentralized.sets import NuclearBall as NuclearBall
from flwr_corrnoise.decentralized.tasks import LogisticTask as LogisticTask
from flwr_corrnoise.decentralized.tasks import Task as Task
from flwr_corrnoise.decentralized.tasks import build_task as build_task
from flwr_corrnoise.decentralized.tasks import register_task as register_task
from flwr_corrnoise.decentralized.wang import PDFTGL as PDFTGL
from flwr_corrnoise.decentralized.wang import PDOCG as PDOCG
from flwr_corrnoise.decentralized.wang import PDOGD as PDOGD
