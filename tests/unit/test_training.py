"""Tests for fedrobust.training: learning on digits, determinism, RNG hygiene, AMP, devices and seeds."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedrobust import data, models, training

ROOT = Path(__file__).resolve().parents[2]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return models.build_model("mlp", input_shape=(64,), num_classes=10)


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and sa[k].numpy().tobytes() == sb[k].numpy().tobytes() for k in sa
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # These models are tiny: intra-op threads only add synchronization, and on a shared 2-core machine a second
    # thread that is descheduled makes every parallel region wait (10x slower). Restored for other test modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_train() -> TensorDataset:
    return data.load_partition("digits", 0, 1, seed=0)


@pytest.fixture(scope="module")
def digits_client() -> TensorDataset:
    return data.load_partition("digits", 3, 20, seed=0)


def test_central_training_learns_digits(digits_train: TensorDataset) -> None:
    model = _mlp()
    test = data.load_test_set("digits", seed=0)
    before = training.evaluate(model, test, device="cpu")
    metrics = training.train(
        model, digits_train, epochs=5, batch_size=32, lr=0.1, momentum=0.9, device="cpu", seed=0
    )
    after = training.evaluate(model, test, device="cpu")
    assert metrics["num_examples"] == len(digits_train)
    assert metrics["seconds"] > 0 and 0.0 <= metrics["accuracy"] <= 1.0
    assert after["loss"] < before["loss"] / 4
    assert after["accuracy"] > 0.9
    assert after["num_examples"] == len(test) == 360


def test_one_client_round_reduces_training_loss(digits_client: TensorDataset) -> None:
    model = _mlp()
    before = training.evaluate(model, digits_client, device="cpu")["loss"]
    training.train(model, digits_client, epochs=3, batch_size=32, lr=0.1, momentum=0.9, device="cpu", seed=1)
    assert training.evaluate(model, digits_client, device="cpu")["loss"] < before


def test_train_is_byte_identical_for_a_seed(digits_client: TensorDataset) -> None:
    kwargs = {"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "device": "cpu"}
    a, b, c = _mlp(), _mlp(), _mlp()
    metrics_a = training.train(a, digits_client, seed=7, **kwargs)
    metrics_b = training.train(b, digits_client, seed=7, **kwargs)
    training.train(c, digits_client, seed=8, **kwargs)
    assert _same_state(a, b)
    assert metrics_a["loss"] == metrics_b["loss"]
    assert not _same_state(a, c)  # another seed, another batch order


def test_resnet_training_is_deterministic_with_batchnorm() -> None:
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(24, 3, 16, 16, generator=generator), torch.randint(0, 10, (24,), generator=generator)
    )

    def run() -> nn.Module:
        torch.manual_seed(0)
        model = models.build_model("resnet", input_shape=(3, 16, 16), num_classes=10, widths=(8, 16))
        training.train(model, dataset, epochs=1, batch_size=8, lr=0.05, momentum=0.9, device="cpu", seed=3)
        return model

    a, b = run(), run()
    assert _same_state(a, b)
    assert int(a.state_dict()["stem.1.num_batches_tracked"]) == 3  # one BatchNorm update per batch


def test_deterministic_changes_nothing_on_the_cpu(digits_client: TensorDataset) -> None:
    kwargs = {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "device": "cpu", "seed": 7}
    a, b = _mlp(), _mlp()
    training.train(a, digits_client, deterministic=True, **kwargs)
    training.train(b, digits_client, deterministic=False, **kwargs)
    assert _same_state(a, b)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resnet_round_on_cuda_gives_the_same_bytes_every_time() -> None:
    """cuDNN's convolution backward is not deterministic on its own: on an H200, three such rounds with
    deterministic=False gave three different models (experiments/bench_client_train.py)."""
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(512, 3, 32, 32, generator=generator), torch.randint(0, 10, (512,), generator=generator)
    )

    def run() -> nn.Module:
        torch.manual_seed(0)
        model = models.build_model("resnet", input_shape=(3, 32, 32), num_classes=10)
        training.train(model, dataset, epochs=1, batch_size=32, lr=0.05, momentum=0.9, device="cuda", seed=3)
        return model.cpu()

    torch.use_deterministic_algorithms(False)
    models_ = [run() for _ in range(3)]
    assert all(_same_state(models_[0], other) for other in models_[1:])
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back
    torch.use_deterministic_algorithms(True)  # and a caller's strict setting is kept, not made warn-only
    try:
        run()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_train_leaves_global_rng_alone_and_seeds_dropout(digits_client: TensorDataset) -> None:
    def dropout_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))

    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = dropout_model(), dropout_model()
    torch.set_rng_state(state)
    training.train(a, digits_client, epochs=1, batch_size=16, lr=0.1, device="cpu", seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)  # a different caller RNG state must not change the result
    training.train(b, digits_client, epochs=1, batch_size=16, lr=0.1, device="cpu", seed=5)
    assert _same_state(a, b)


def test_bf16_autocast_runs_on_cpu(digits_train: TensorDataset) -> None:
    model = _mlp()
    metrics = training.train(
        model, digits_train, epochs=2, batch_size=64, lr=0.1, momentum=0.9, device="cpu", amp="bf16", seed=0
    )
    assert math.isfinite(metrics["loss"]) and metrics["accuracy"] > 0.5
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast keeps float32 master weights


def test_amp_validation(digits_client: TensorDataset) -> None:
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        training.train(_mlp(), digits_client, epochs=1, batch_size=8, lr=0.1, device="cpu", amp="fp16", seed=0)
    with pytest.raises(ValueError, match="'fp8'.*none, bf16, fp16"):
        training.train(_mlp(), digits_client, epochs=1, batch_size=8, lr=0.1, device="cpu", amp="fp8", seed=0)


@pytest.mark.parametrize("kwargs", [{"epochs": 0}, {"batch_size": 0}, {"lr": 0.0}])
def test_train_rejects_bad_hyperparameters(digits_client: TensorDataset, kwargs: dict[str, float]) -> None:
    arguments = {"epochs": 1, "batch_size": 8, "lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match="need epochs >= 1"):
        training.train(_mlp(), digits_client, device="cpu", seed=0, **arguments)


def test_empty_dataset_is_rejected() -> None:
    empty = TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty dataset"):
        training.train(_mlp(), empty, epochs=1, batch_size=8, lr=0.1, device="cpu", seed=0)
    with pytest.raises(ValueError, match="empty dataset"):
        training.evaluate(_mlp(), empty, device="cpu")


def test_evaluate_matches_direct_computation(digits_client: TensorDataset) -> None:
    model = _mlp()
    x, y = digits_client.tensors
    with torch.no_grad():
        logits = model(x)
    expected_loss = nn.functional.cross_entropy(logits, y).item()
    expected_accuracy = (logits.argmax(1) == y).float().mean().item()
    for batch_size in (7, 256):
        result = training.evaluate(model, digits_client, device="cpu", batch_size=batch_size)
        assert result["num_examples"] == len(y)
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
        assert result["accuracy"] == pytest.approx(expected_accuracy)


def test_pick_device_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.pick_device() == torch.device("cpu")
    assert training.pick_device("cpu") == torch.device("cpu")
    for request in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            training.pick_device(request)


def test_pick_device_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert training.pick_device("auto") == torch.device("cuda")
    assert training.pick_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        training.pick_device("cuda:1")


@pytest.mark.parametrize("request_", ["gpu", "mps", ""])
def test_pick_device_rejects_unknown(request_: str) -> None:
    with pytest.raises(ValueError, match="valid: 'auto', 'cpu', 'cuda'"):
        training.pick_device(request_)


def test_derive_seed() -> None:
    # Pinned: changing the derivation would silently change every run's results.
    assert training.derive_seed(0, 1, 2) == training.derive_seed(0, 1, 2) == 0x6B5BEE41B4D0DF46
    triples = list(itertools.product(range(12), repeat=3))
    seeds = {training.derive_seed(*triple) for triple in triples}
    assert len(seeds) == len(triples)
    assert all(0 <= s < 2**63 for s in seeds)
    assert training.derive_seed(1, 23, 4) != training.derive_seed(12, 3, 4)  # no ambiguity in the encoding
    # Negative ids are allowed (e.g. -1 for a server-side stream) and distinct from their absolute values.
    assert 0 <= training.derive_seed(0, 1, -1) < 2**63
    assert training.derive_seed(0, 1, -1) != training.derive_seed(0, 1, 1)
    with pytest.raises(TypeError):
        training.derive_seed(0.5, 1, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 0.0), (0.0, 0.0), (0.9, 1e-3)])
def test_local_sgd_steps_exactly_as_torch_optim_sgd(momentum: float, weight_decay: float) -> None:
    """The training loop's SGD (torch's functional form, which does not import torch._dynamo) gives the bytes
    of torch.optim.SGD, a frozen parameter and a parameter without a gradient in some steps included."""
    def make() -> nn.Module:
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 3))
        net[0].bias.requires_grad_(False)
        return net

    reference, ours = make(), make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    our_opt = training._FunctionalSGD(ours.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
        for net, opt in ((reference, ref_opt), (ours, our_opt)):
            opt.zero_grad(set_to_none=True)
            head = net[:3] if step % 2 else net  # every other step the last layer gets no gradient
            out = head(x)
            nn.functional.cross_entropy(out[:, :3] if out.shape[1] > 3 else out, y).backward()
            opt.step()
    for a, b in zip(reference.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_training_does_not_import_torch_dynamo(tmp_path: Path) -> None:
    """A ClientApp process (one per message on a SuperNode) must not pay torch._dynamo's import for SGD."""
    script = (
        "import sys, torch\n"
        "from torch.utils.data import TensorDataset\n"
        "from fedrobust import training\n"
        "net = torch.nn.Linear(4, 2)\n"
        "ds = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))\n"
        "training.train(net, ds, epochs=1, batch_size=4, lr=0.1, device='cpu', seed=0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr
