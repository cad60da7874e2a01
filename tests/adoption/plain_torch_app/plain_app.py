"""A plain Message-API Flower app in PyTorch: online logistic regression, no privacy.

Each learner reads its own stream of examples, keeps its stream position in
``context.state`` and runs local SGD with ``torch.optim.SGD``; the server runs FedAvg on
the model's ``state_dict`` and evaluates centrally. The adoption tests apply the PyTorch
diff of ``docs/adopt.md`` to this file.
"""

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

TRUE_W = np.array([1.5, -2.0, 1.0, 0.5])
RESULTS: list = []  # the Result of each run, for whoever started it in this process


def datum(partition: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``position`` of learner ``partition``'s stream, as a batch of one."""
    rng = np.random.default_rng([partition, position])
    x = rng.normal(size=TRUE_W.size)
    y = float(rng.random() < 1 / (1 + np.exp(-x @ TRUE_W)))
    return torch.tensor(x[None], dtype=torch.float32), torch.tensor([[y]])


def accuracy(w: np.ndarray) -> float:
    rng = np.random.default_rng(12345)
    x = rng.normal(size=(500, TRUE_W.size))
    return float(np.mean((x @ w.ravel() > 0) == (x @ TRUE_W > 0)))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    model = torch.nn.Linear(TRUE_W.size, 1, bias=False)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    lr = float(context.run_config["learning-rate"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    partition = int(context.node_config["partition-id"])
    position = int(context.state["stream"]["position"]) if "stream" in context.state else 0
    for _ in range(int(context.run_config["local-steps"])):
        x, y = datum(partition, position)
        position += 1
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        optimizer.step()
    context.state["stream"] = ConfigRecord({"position": position})
    metrics = MetricRecord({"num-examples": int(context.run_config["local-steps"])})
    arrays = ArrayRecord(model.state_dict())
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0)
    initial = torch.nn.Linear(TRUE_W.size, 1, bias=False)
    torch.nn.init.zeros_(initial.weight)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial.state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=lambda _, a: MetricRecord({"accuracy": accuracy(a.to_numpy_ndarrays()[0])}),
    )
    RESULTS.append(result)
