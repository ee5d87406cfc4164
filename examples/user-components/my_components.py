"""A user's own model, data set and aggregation rule for fedrobust, named in a config by _target_."""

import math

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    """Any torch.nn.Module; input_shape and num_classes come from the data set when named here."""

    def __init__(self, input_shape, num_classes, hidden=32):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.body(x)


def load(seed=0, test_fraction=0.2):
    """(train, test): torch Datasets of (x, y) pairs (or Hugging Face Datasets with x and label columns)."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[: int(len(y) * (1 - test_fraction))], order[int(len(y) * (1 - test_fraction)):]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class CoordinateMedian:
    """A rule: called with f (and params), maps [n, d] client updates to one [d] update."""

    def __init__(self, f=0):
        self.f = f

    def min_n(self):  # fewest updates it accepts for its f
        return 2 * self.f + 1

    def __call__(self, updates):
        return updates.median(dim=0).values
