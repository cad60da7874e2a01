"""A plain Message-API Flower app: online logistic regression, no privacy.

Each learner reads its own stream of examples, keeps its stream position in
``context.state`` and runs local SGD; the server runs FedAvg and evaluates centrally.
The adoption tests apply the diffs of ``docs/adopt.md`` to this file.
"""

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

TRUE_W = np.array([1.5, -2.0, 1.0, 0.5])
RESULTS: list = []  # the Result of each run, for whoever started it in this process


def datum(partition: int, position: int) -> tuple[np.ndarray, float]:
    """Example ``position`` of learner ``partition``'s stream."""
    rng = np.random.default_rng([partition, position])
    x = rng.normal(size=TRUE_W.size)
    return x, float(rng.random() < 1 / (1 + np.exp(-x @ TRUE_W)))


def accuracy(w: np.ndarray) -> float:
    rng = np.random.default_rng(12345)
    x = rng.normal(size=(500, TRUE_W.size))
    return float(np.mean((x @ w > 0) == (x @ TRUE_W > 0)))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    lr = float(context.run_config["learning-rate"])
    partition = int(context.node_config["partition-id"])
    position = int(context.state["stream"]["position"]) if "stream" in context.state else 0
    for _ in range(int(context.run_config["local-steps"])):
        x, y = datum(partition, position)
        position += 1
        grad = (1 / (1 + np.exp(-x @ w)) - y) * x
        w = w - lr * grad
    context.state["stream"] = ConfigRecord({"position": position})
    metrics = MetricRecord({"num-examples": int(context.run_config["local-steps"])})
    return Message(RecordDict({"arrays": ArrayRecord([w]), "metrics": metrics}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(TRUE_W.size)]),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=lambda _, a: MetricRecord({"accuracy": accuracy(a.to_numpy_ndarrays()[0])}),
    )
    RESULTS.append(result)
