"""Models for the data sets in :mod:`fedrobust.data`.

``mlp``
    A small fully connected network (digits: 64 -> 64 -> 10, 4,810 parameters).
``cnn``
    Two 3x3 convolutions with 2x2 max pooling and two fully connected layers (MNIST: about 0.2M parameters).
``resnet``
    A ResNet-style network for CIFAR-10: a convolutional stem and one residual block per stage with BatchNorm
    (widths 32, 64, 128: about 0.3M parameters). Its ``state_dict`` includes the BatchNorm buffers
    ``running_mean``, ``running_var`` (float32) and ``num_batches_tracked`` (int64).

None of them uses dropout. :func:`build_model` draws initial weights from PyTorch's global RNG: the caller seeds it
(``torch.manual_seed``, or inside ``torch.random.fork_rng`` to leave the global state untouched) so that every
participant starts from the same weights.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["build_model", "names"]

logger = logging.getLogger(__name__)


def _mlp(input_shape: tuple[int, ...], num_classes: int, *, hidden: int | Sequence[int] = (64,)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for size in (hidden,) if isinstance(hidden, int) else hidden:  # +model.params.hidden=64: one layer
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _image_shape(name: str, input_shape: tuple[int, ...], min_size: int) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_size:
        raise ValueError(
            f"model {name!r} needs input_shape (channels, height, width) with height and width >= {min_size}, "
            f"got {input_shape}"
        )
    return input_shape[0], input_shape[1], input_shape[2]


def _cnn(
    input_shape: tuple[int, ...], num_classes: int, *, channels: Sequence[int] = (16, 32), hidden: int = 128
) -> nn.Module:
    in_channels, height, width = _image_shape("cnn", input_shape, min_size=4)
    if len(channels) != 2:
        raise ValueError(f"model 'cnn' takes two convolution widths, got channels={tuple(channels)}")
    c1, c2 = channels
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        # Two 2x2 poolings with floor division, as MaxPool2d does.
        nn.Linear(c2 * (height // 4) * (width // 4), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1 projection) shortcut (He et al. 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _ResNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int], blocks_per_stage: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        previous = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                # Every stage after the first halves the resolution in its first block.
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(_BasicBlock(previous, width, stride))
                previous = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def _resnet(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    widths: Sequence[int] = (32, 64, 128),
    blocks_per_stage: int = 1,
) -> nn.Module:
    if not widths or blocks_per_stage < 1:
        raise ValueError(
            f"model 'resnet' needs at least one stage and one block per stage, got widths={tuple(widths)}, "
            f"blocks_per_stage={blocks_per_stage}"
        )
    in_channels, _, _ = _image_shape("resnet", input_shape, min_size=2 ** (len(widths) - 1))
    return _ResNet(in_channels, num_classes, widths, blocks_per_stage)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "resnet": _resnet}


def names() -> list[str]:
    """Return the names of the registered models, sorted.

    Returns
    -------
    list[str]
        ``["cnn", "mlp", "resnet"]``.
    """
    return sorted(_BUILDERS)


def build_model(name: str, *, input_shape: Sequence[int], num_classes: int, **params: object) -> nn.Module:
    """Build a freshly initialized model.

    Initial weights come from PyTorch's global RNG; seed it before calling (``torch.manual_seed``) for the same
    weights on every participant.

    Parameters
    ----------
    name : str
        One of :func:`names`.
    input_shape : Sequence[int]
        Shape of one input without the batch dimension, e.g. ``dataset_spec(name).input_shape``. ``mlp`` takes
        any shape (it flattens); ``cnn`` and ``resnet`` need ``(channels, height, width)``.
    num_classes : int
        Number of output logits.
    **params
        Model options: ``mlp``: ``hidden`` (widths of the hidden layers, or one width, default ``(64,)``);
        ``cnn``: ``channels`` (two convolution widths, default ``(16, 32)``), ``hidden`` (default 128); ``resnet``:
        ``widths`` (one per stage, default ``(32, 64, 128)``), ``blocks_per_stage`` (default 1).

    Returns
    -------
    torch.nn.Module
        The model on the CPU, in training mode, mapping ``[batch, *input_shape]`` float32 to ``[batch, num_classes]``
        logits.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the valid ones), an unknown option (the message lists the model's
        options), a non-positive ``num_classes`` or an input shape the model cannot take.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(names())}")
    builder = _BUILDERS[name]
    options = [p.name for p in inspect.signature(builder).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(options))
    if unknown:
        raise ValueError(f"model {name!r} has no option(s) {', '.join(unknown)}; its options: {', '.join(options)}")
    shape = tuple(int(size) for size in input_shape)
    if num_classes < 1 or not shape or min(shape) < 1:
        raise ValueError(
            f"model {name!r} needs num_classes >= 1 and a non-empty input_shape of positive sizes, got "
            f"num_classes={num_classes}, input_shape={shape}"
        )
    model = builder(shape, num_classes, **params)
    logger.debug("built model %s for input %s: %d parameters", name, shape, sum(p.numel() for p in model.parameters()))
    return model
