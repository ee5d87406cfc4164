"""Local training and evaluation loops, device selection and per-(round, client) seeds.

Determinism: :func:`train` draws every random number from its ``seed``: batch order from a seeded
:class:`torch.Generator`, and any stochastic layer (dropout) from the global RNG, which is forked, seeded for the
call and restored afterwards, so the caller's RNG state is left as it was. On the CPU, training the same initial
weights on the same data with the same seed and thread count gives byte-identical weights. On CUDA some kernels
(e.g. cuDNN's convolution backward) are not deterministic: with ``deterministic=True`` (the default) :func:`train`
turns on ``torch.use_deterministic_algorithms`` (warn-only) for the call, sets ``CUBLAS_WORKSPACE_CONFIG`` if it is
unset, and restores the caller's setting afterwards. On an H200 that made a ResNet's round give the same bytes every
time, at a cost within the spread of single rounds (docs/benchmarks.md, "GPU clients"); on the CPU it changes
nothing.

Mixed precision (``amp``): ``"bf16"`` runs the forward pass under :func:`torch.autocast` with bfloat16 on the
model's device type (CPU or CUDA). ``"fp16"`` is for CUDA only, with a :class:`torch.amp.GradScaler`; on other
devices it raises ``ValueError`` rather than silently training in another precision than the one configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import operator
import os
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.sgd import sgd
from torch.utils.data import DataLoader, Dataset

__all__ = ["AMP_MODES", "derive_seed", "evaluate", "pick_device", "train"]

logger = logging.getLogger(__name__)

AMP_MODES: tuple[str, ...] = ("none", "bf16", "fp16")
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:<index>'"


def pick_device(requested: str = "auto") -> torch.device:
    """Resolve a device request.

    Parameters
    ----------
    requested : str, default "auto"
        ``"auto"`` (CUDA when available, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``.

    Returns
    -------
    torch.device

    Raises
    ------
    ValueError
        If the request is not one of the forms above, or asks for CUDA (or a CUDA device index) that this machine
        does not have.
    """
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {requested!r}; valid: {_DEVICE_CHOICES}") from err
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {requested!r}; valid: {_DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available here; use 'auto' or 'cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {requested!r} requested but only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return device


def derive_seed(seed: int, round: int, partition_id: int) -> int:
    """Derive the seed of one client's work in one round.

    Parameters
    ----------
    seed : int
        The run's seed.
    round : int
        The server round.
    partition_id : int
        The client's partition.

    Returns
    -------
    int
        A seed in ``[0, 2**63)``: the first 8 bytes of a BLAKE2b hash of the three numbers, so it is the same on
        every platform and Python version, and different triples give unrelated seeds.
    """
    values = [operator.index(value) for value in (seed, round, partition_id)]
    message = "/".join(str(value) for value in values).encode()
    digest = hashlib.blake2b(message, digest_size=8, person=b"fedrobust-seed").digest()
    return int.from_bytes(digest, "big") >> 1


def _check_amp(amp: str, device: torch.device) -> None:
    if amp not in AMP_MODES:
        raise ValueError(f"unknown amp mode {amp!r}; valid: {', '.join(AMP_MODES)}")
    if amp == "fp16" and device.type != "cuda":
        raise ValueError(
            f"amp='fp16' needs a CUDA device (float16 training relies on CUDA's GradScaler), got {device}; "
            "use amp='bf16' or 'none'"
        )


def _autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_AMP_DTYPES[amp])


@contextlib.contextmanager
def _deterministic_cuda(enabled: bool) -> Iterator[None]:
    """Deterministic algorithms for a block (warn-only: an op without one warns instead of failing the round)."""
    if not enabled:
        yield
        return
    # cuBLAS is deterministic only with a fixed workspace; PyTorch reads the variable when a matmul runs.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the global RNG (CPU, and the CUDA device in use) for a block, restoring the caller's state after."""
    cuda_devices = []
    if device.type == "cuda":
        cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda_devices, device_type="cuda"):
        # Only the forked generators are seeded: torch.manual_seed would also reseed every other CUDA device.
        torch.default_generator.manual_seed(seed)
        for index in cuda_devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


class _LoneSampleProbe:
    """Watches the batch norms' inputs during one forward pass in training: would a batch of one sample give
    any of them a single value per channel? Then it fails ("Expected more than 1 value per channel when
    training"): BatchNorm1d on ``[N, C]``, BatchNorm2d on 1x1 maps. The shapes decide, not the layer's type:
    BatchNorm1d on sequences and BatchNorm2d on larger maps (the built-in resnet's) train on one sample."""

    def __init__(self, model: nn.Module) -> None:
        self.fails = False
        self._handles = [
            m.register_forward_pre_hook(self._look)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]

    def _look(self, module: nn.Module, args: tuple[object, ...]) -> None:
        # A frozen batch norm (eval mode, running statistics) normalises one sample; only batch statistics fail.
        uses_batch = module.training or getattr(module, "running_mean", None) is None
        x = args[0]
        if uses_batch and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] > 0 and x[0, 0].numel() == 1:
            self.fails = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_logged: set[str] = set()


def _log_once(message: str, *args: object) -> None:
    """Log ``message`` at the first call per process: a client trains every round, and once says it."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message, *args)


def _check_dataset_size(dataset: Dataset, what: str) -> int:
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise ValueError(f"cannot {what} on an empty dataset")
    return size


def train(
    model: nn.Module,
    dataset: Dataset,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    device: torch.device | str,
    amp: str = "none",
    seed: int,
    deterministic: bool = True,
) -> dict[str, float]:
    """Train a model in place with mini-batch SGD and cross-entropy loss.

    Parameters
    ----------
    model : torch.nn.Module
        The model; it is moved to ``device`` and left there, in training mode.
    dataset : torch.utils.data.Dataset
        Samples ``(x, y)``: float inputs and int64 labels, e.g. from :func:`fedrobust.data.load_partition`.
    epochs : int
        Passes over the dataset (>= 1).
    batch_size : int
        Mini-batch size (>= 1); the last batch of an epoch may be smaller. A last batch of one sample is dropped
        from each epoch when a batch norm of the model would see a single value per channel on it (BatchNorm1d on
        ``[N, C]``, BatchNorm2d on 1x1 maps), which it cannot normalise while training.
    lr : float
        Learning rate (> 0).
    momentum : float, default 0.0
        SGD momentum; the optimizer is created per call, so momentum does not carry over between calls.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient by SGD.
    device : torch.device or str
        Where to train, e.g. from :func:`pick_device`.
    amp : str, default "none"
        One of :data:`AMP_MODES`: ``"none"``, ``"bf16"`` (autocast; CPU or CUDA) or ``"fp16"`` (autocast and
        gradient scaling; CUDA only).
    seed : int
        Seeds the batch order and any stochastic layer, e.g. ``derive_seed(run_seed, round, partition_id)``.
    deterministic : bool, default True
        On CUDA, use deterministic algorithms for the call, so that the same seed gives the same weights.
        Ignored on the CPU, whose kernels are deterministic already.

    Returns
    -------
    dict[str, float]
        ``loss`` and ``accuracy``: mean cross-entropy and accuracy over the batches of the last epoch, measured
        while training; ``num_examples``: the dataset size (int), a dropped sample included; ``seconds``: wall
        time of the call.

    Raises
    ------
    ValueError
        For an empty dataset, a non-positive ``epochs``, ``batch_size`` or ``lr``, or an invalid ``amp`` for the
        device.
    """
    start = time.perf_counter()
    device = torch.device(device)
    _check_amp(amp, device)
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need epochs >= 1, batch_size >= 1 and lr > 0, got {epochs}, {batch_size}, {lr}")
    num_examples = _check_dataset_size(dataset, "train")

    model.to(device)
    model.train()
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    optimizer: torch.optim.Optimizer | _FunctionalSGD
    if scaler is not None:  # GradScaler steps a torch.optim.Optimizer
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        optimizer = _FunctionalSGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    # Batch norm in training mode cannot normalise a batch of one sample ("Expected more than 1 value per channel
    # when training"): that lone last sample is left out, as drop_last would, when the first batch shows that a
    # batch norm would get a single value per channel; only then, so that every other case keeps its bytes. The
    # sampler draws the same order either way: only which sample sits out changes, per epoch.
    lone_last = num_examples > batch_size and num_examples % batch_size == 1
    probe = _LoneSampleProbe(model) if lone_last else None
    skip_lone = False
    # The generator alone decides the batch order (RandomSampler and the loader's base seed draw from it).
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=device.type == "cuda",
    )
    non_blocking = device.type == "cuda"

    try:
        with _seeded_global_rng(seed, device), _deterministic_cuda(deterministic and device.type == "cuda"):
            for _ in range(epochs):
                # Sums stay on the device so that the loop does not wait for the GPU after every batch.
                loss_sum = torch.zeros((), device=device)
                correct = torch.zeros((), dtype=torch.int64, device=device)
                for inputs, targets in loader:
                    if skip_lone and len(targets) == 1:  # fetched, as drop_last would not: a Dataset whose
                        continue  # __getitem__ draws from the global RNG draws once more
                    inputs = inputs.to(device, non_blocking=non_blocking)
                    targets = targets.to(device, non_blocking=non_blocking)
                    optimizer.zero_grad(set_to_none=True)
                    with _autocast(amp, device):
                        logits = model(inputs)
                        loss = F.cross_entropy(logits, targets)
                    if probe is not None:  # the first batch has run through every batch norm
                        probe.close()
                        skip_lone, probe = probe.fails, None
                        if skip_lone:
                            _log_once(
                                "the model has a batch norm that sees one value per channel on a single sample "
                                "(BatchNorm1d on [N, C] or BatchNorm2d on 1x1 maps) and a partition of %d examples "
                                "leaves a last batch of 1 (batch_size %d): that sample is left out of each epoch "
                                "(a different one each epoch)",
                                num_examples,
                                batch_size,
                            )
                    if scaler is not None:
                        scaler.scale(loss).backward()
                        assert isinstance(optimizer, torch.optim.Optimizer)  # built so above
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        loss.backward()
                        optimizer.step()
                    loss_sum += loss.detach().float() * targets.shape[0]
                    correct += (logits.detach().argmax(dim=1) == targets).sum()
    finally:
        if probe is not None:  # the forward pass failed before the probe had its answer: leave no hook behind
            probe.close()

    seen = num_examples - 1 if skip_lone else num_examples
    mean_loss = loss_sum.item() / seen
    if not math.isfinite(mean_loss):
        logger.warning("training loss is %s (lr=%s): the local model diverged", mean_loss, lr)
    return {
        "loss": mean_loss,
        "accuracy": correct.item() / seen,
        "num_examples": num_examples,
        "seconds": time.perf_counter() - start,
    }


class _FunctionalSGD:
    """``torch.optim.SGD``'s step through its functional form, :func:`torch.optim.sgd.sgd`: the same arithmetic.

    Building a ``torch.optim.Optimizer`` imports ``torch._dynamo`` (about 1.3 s of CPU, more than the rest of
    a small training round). A SuperNode starts one ClientApp process per message, so a device would pay that
    on every message; the functional form does not import it.
    """

    def __init__(self, params: Iterator[nn.Parameter], *, lr: float, momentum: float, weight_decay: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        # As torch.optim.SGD.step: only parameters with a gradient, each with its own momentum buffer.
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [grad for grad in (self.params[i].grad for i in live) if grad is not None]
        buffers = [self.momentum_buffers[i] for i in live]
        sgd(
            [self.params[i] for i in live],
            grads,
            buffers,
            has_sparse_grad=any(g.is_sparse for g in grads),
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
        for i, buffer in zip(live, buffers, strict=True):
            self.momentum_buffers[i] = buffer


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    *,
    device: torch.device | str,
    batch_size: int = 256,
) -> dict[str, float]:
    """Evaluate a model's cross-entropy loss and accuracy.

    Parameters
    ----------
    model : torch.nn.Module
        The model; it is moved to ``device`` and left there, in evaluation mode.
    dataset : torch.utils.data.Dataset
        Samples ``(x, y)`` as for :func:`train`.
    device : torch.device or str
        Where to evaluate.
    batch_size : int, default 256
        Batch size; it does not change the result beyond floating-point rounding.

    Returns
    -------
    dict[str, float]
        ``loss`` (mean cross-entropy), ``accuracy`` and ``num_examples`` (int).

    Raises
    ------
    ValueError
        For an empty dataset or a non-positive ``batch_size``.
    """
    device = torch.device(device)
    if batch_size < 1:
        raise ValueError(f"need batch_size >= 1, got {batch_size}")
    num_examples = _check_dataset_size(dataset, "evaluate")
    model.to(device)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, pin_memory=device.type == "cuda")
    with torch.inference_mode():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            logits = model(inputs)
            loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").double()
            correct += (logits.argmax(dim=1) == targets).sum()
    return {
        "loss": loss_sum.item() / num_examples,
        "accuracy": correct.item() / num_examples,
        "num_examples": num_examples,
    }
