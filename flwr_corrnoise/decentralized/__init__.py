"""Decentralized (peer-to-peer) locally differentially private online learning.

Pure NumPy/SciPy: graphs and mixing matrices, Laplace (pure-DP) machinery, the algorithms of
papers 003 (Chen & Wang) and 004 (Wang et al.) as per-node update rules, their privacy
accountants and a vectorized in-process engine. Nothing here imports Flower; the Flower relay
(``flwr_corrnoise.flower.relay``) calls these same functions.
"""

# One `import name as name` line per public name, so that modules can append theirs.
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
