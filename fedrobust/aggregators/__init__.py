"""Robust aggregation of stacked client updates.

>>> import torch
>>> from fedrobust import aggregators
>>> aggregators.names()[:3]
['mean', 'median', 'trimmed_mean']
>>> agg = aggregators.build("trimmed_mean", f=1)
>>> agg(torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [100.0, -100.0]]))
tensor([1.5000, 1.5000])

See ``docs/contracts.md`` for the contract and ``docs/benchmarks.md`` for measured speed.
"""

# Importing the rule modules registers them; the order here is the order of names() and pre_names() (pre's
# stages before DnC's filter).
from fedrobust.aggregators import mean  # noqa: F401  isort: skip
from fedrobust.aggregators import coordinate  # noqa: F401  isort: skip
from fedrobust.aggregators import distance  # noqa: F401  isort: skip
from fedrobust.aggregators import geometric  # noqa: F401  isort: skip
from fedrobust.aggregators import bulyan  # noqa: F401  isort: skip
from fedrobust.aggregators import pre  # noqa: F401  isort: skip
from fedrobust.aggregators import filters  # noqa: F401  isort: skip
from fedrobust.aggregators import consistency  # noqa: F401  isort: skip
from fedrobust.aggregators import dnc  # noqa: F401  isort: skip
from fedrobust.aggregators import signguard  # noqa: F401  isort: skip
from fedrobust.aggregators import clustering  # noqa: F401  isort: skip
from fedrobust.aggregators import foolsgold  # noqa: F401  isort: skip
from fedrobust.aggregators import fltrust  # noqa: F401  isort: skip
import torch  # isort: skip

from fedrobust.aggregators._backend import numba_kernels
from fedrobust.aggregators._registry import (
    PIPELINE_SEPARATOR,
    build,
    names,
    pipeline_order_hint,
    pre_names,
    split_pipeline,
)
from fedrobust.aggregators.pipeline import Aggregator

__all__ = [
    "PIPELINE_SEPARATOR",
    "Aggregator",
    "build",
    "load_kernels",
    "names",
    "pipeline_order_hint",
    "pre_names",
    "split_pipeline",
]


def load_kernels(device: torch.device | str = "cpu") -> bool:
    """Load the rules' compiled CPU kernels now instead of in the first aggregation (about 1 s; compiled the
    first time on a machine). Returns whether they serve ``device``: False off the CPU or without numba."""
    return numba_kernels(torch.device(device)) is not None
