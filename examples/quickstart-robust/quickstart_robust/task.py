"""Model, data, training and evaluation: the part of a Flower app that fedrobust leaves alone.

scikit-learn's 8x8 digits ship with its wheel, so this example runs offline; swap in your own
model and data set (e.g. flwr-datasets' MNIST) exactly as in Flower's quickstart-pytorch.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small MLP for 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _digits() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.long)
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def load_data(partition_id: int, num_partitions: int, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """This node's IID share of the training set, and the common test set."""
    train, test = _digits()
    part = torch.utils.data.Subset(train, range(partition_id, len(train), num_partitions))
    generator = torch.Generator().manual_seed(partition_id)
    return DataLoader(part, batch_size=batch_size, shuffle=True, generator=generator), DataLoader(test, batch_size=256)


def load_centralized_dataset() -> DataLoader:
    return DataLoader(_digits()[1], batch_size=256)


def train(net: nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """Plain SGD; returns the mean training loss."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Loss and accuracy."""
    criterion = nn.CrossEntropyLoss(reduction="sum")
    net.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(criterion(out, y))
            correct += int((out.argmax(1) == y).sum())
            count += len(y)
    return loss / count, correct / count
