"""pytorchexample: A Flower / PyTorch app."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

# Flower's examples/quickstart-pytorch (https://github.com/adap/flower, Apache-2.0,
# Copyright Flower Labs GmbH), reproduced for tests/flower/test_flower_quickstart.py. Only the
# data loading is changed: instead of downloading CIFAR-10 (flwr-datasets, datasets,
# torchvision), load_data and load_centralized_dataset build an offline stand-in of the
# same shape (3×32×32 images, 10 classes, normalized to about [-1, 1], batches of
# {"img", "label"}) from a fixed seed, at a toy size. Net, train and test are Flower's.
# ruff: noqa: N812, UP008  (Flower's code as Flower writes it)


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


#: the offline stand-in's size: examples per partition (80% train, 20% test), test set
EXAMPLES_PER_PARTITION = 50
CENTRAL_TEST_EXAMPLES = 100


def offline_images(seed: int, size: int) -> list[dict]:
    """``size`` CIFAR-10-shaped examples: a class template plus noise, normalized."""
    templates = torch.rand(10, 3, 32, 32, generator=torch.Generator().manual_seed(99))
    rng = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=rng)
    pixels = (templates[labels] + 0.3 * torch.randn(size, 3, 32, 32, generator=rng)).clamp(0, 1)
    images = (pixels - 0.5) / 0.5  # Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    return [{"img": img, "label": int(label)} for img, label in zip(images, labels, strict=True)]


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition CIFAR10 data (offline stand-in)."""
    partition = offline_images(1000 + partition_id, EXAMPLES_PER_PARTITION)
    # Divide data on each node: 80% train, 20% test
    order = torch.randperm(len(partition), generator=torch.Generator().manual_seed(42))
    cut = int(0.8 * len(partition))
    train = [partition[i] for i in order[:cut]]
    test = [partition[i] for i in order[cut:]]
    # Construct dataloaders
    trainloader = DataLoader(train, batch_size=batch_size, shuffle=True)
    testloader = DataLoader(test, batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader (offline stand-in)."""
    return DataLoader(offline_images(7, CENTRAL_TEST_EXAMPLES), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
