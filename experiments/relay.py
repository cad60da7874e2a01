"""The relay's results files, for experiments and tests: ``relay.npz`` (every relayed array,
``<key>`` → ``[steps, n, ...]``) and ``summary.json`` (per-node ε reported at the end).

The library's relay ServerApp writes nothing; it hands a
:class:`~flwr_corrnoise.flower.relay.RelayResult` to its ``on_result`` hook.
:func:`relay_apps` here is the library's ``relay_apps`` with a hook that writes the files to
the config's ``results-dir`` (if set), as the experiments and tests read them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from flwr_corrnoise.flower import relay as _relay
from flwr_corrnoise.flower.relay import RelayResult

__all__ = ["relay_apps", "write_relay_results"]


def write_relay_results(out: str | Path, result: RelayResult) -> None:
    """``relay.npz`` and ``summary.json`` in ``out`` (created if missing)."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / "relay.npz", **result.relayed)
    n = result.graph.num_nodes
    (path / "summary.json").write_text(json.dumps(
        {"steps": result.steps, "num-nodes": n, "graph": result.graph.name,
         "nodes": {str(i): result.node_metrics[i] for i in range(n)}}, indent=2))


def _write_to_results_dir(result: RelayResult) -> None:
    out_dir = result.config.get("results-dir")
    if out_dir:
        write_relay_results(str(out_dir), result)


def relay_apps(config: Mapping[str, Any]) -> tuple[ServerApp, ClientApp]:
    """The library's relay apps; the ServerApp writes the results files to ``results-dir``
    (a key of ``config`` or the run config) when the run ends."""
    return _relay.relay_apps(config, on_result=_write_to_results_dir)
