"""A Flower app written the way Flower's quickstart-pytorch is: a CNN, a fixed local
partition, local epochs over it with a ``DataLoader``, FedAvg, no privacy.

The images are an offline stand-in for Fashion-MNIST (12×12 class templates plus noise,
drawn from a fixed seed), so the test runs without a download. The adoption tests apply
the quickstart diffs of ``docs/adopt.md`` to this file.
"""

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import DataLoader, TensorDataset

RESULTS: list = []  # the Result of each run, for whoever started it in this process


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(4 * 5 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def load_data(partition_id: int, size: int = 64, seed: int = 0) -> TensorDataset:
    templates = np.random.default_rng(99).normal(size=(10, 1, 12, 12))
    rng = np.random.default_rng([seed, partition_id])
    labels = rng.integers(0, 10, size=size)
    images = templates[labels] + 0.8 * rng.normal(size=(size, 1, 12, 12))
    return TensorDataset(torch.tensor(images, dtype=torch.float32), torch.tensor(labels))


def test_accuracy(net: Net) -> float:
    data = load_data(10**6, size=500, seed=1)
    with torch.no_grad():
        return float((net(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean())


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainset = load_data(int(context.node_config["partition-id"]))
    trainloader = DataLoader(trainset, batch_size=16, shuffle=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=float(context.run_config["lr"]))
    criterion = torch.nn.CrossEntropyLoss()
    for _ in range(int(context.run_config["local-epochs"])):
        for images, labels in trainloader:
            optimizer.zero_grad()
            criterion(net(images), labels).backward()
            optimizer.step()
    metrics = MetricRecord({"num-examples": len(trainset)})
    arrays = ArrayRecord(net.state_dict())
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": test_accuracy(net)})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=evaluate,
    )
    RESULTS.append(result)
