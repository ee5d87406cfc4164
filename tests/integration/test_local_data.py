"""Device-local data: each node trains on files prepared on the device (node config ``data-path``)."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import safetensors.torch
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from experiments.inprocess import run_inprocess
from fedrobust import data
from fedrobust.clients.client_app import make_client_app
from tests.support.simulation import small_config


def _write(kind: str, x: torch.Tensor, y: torch.Tensor, where: Path) -> Path:
    if kind == "npz":
        path = where / "train.npz"
        np.savez(path, x=x.numpy(), y=y.numpy())
    elif kind == "safetensors":
        path = where / "train.safetensors"
        safetensors.torch.save_file({"x": x.contiguous(), "y": y.contiguous()}, str(path))
    else:
        path = where / "train"
        datasets.Dataset.from_dict({"x": x.numpy(), "label": y.numpy()}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["npz", "safetensors", "save_to_disk"])
def test_each_format_loads_as_written(tmp_path: Path, kind: str) -> None:
    x, y = data.load_partition("digits", 0, 4, seed=0).tensors
    loaded = data.load_local(_write(kind, x, y, tmp_path), "digits")
    assert torch.equal(loaded.tensors[0], x) and torch.equal(loaded.tensors[1], y)


def test_bad_local_data_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        data.load_local(tmp_path / "nothing.npz", "digits")
    np.savez(tmp_path / "wrong.npz", x=np.zeros((5, 10)), y=np.zeros(5))
    with pytest.raises(ValueError, match="do not fit digits"):
        data.load_local(tmp_path / "wrong.npz", "digits")
    np.savez(tmp_path / "labels.npz", x=np.zeros((5, 64)), y=np.full(5, 12))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        data.load_local(tmp_path / "labels.npz", "digits")
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="unknown data format"):
        data.load_local(tmp_path / "data.csv", "digits")


def test_nodes_train_on_their_own_files_without_partition_ids(tmp_path: Path) -> None:
    """Every node has only a data-path (no partition-id): the run trains well above chance (10 classes)."""
    cfg = small_config(tmp_path, num_rounds=3, num_byzantine=0, **{"aggregator.name": "mean"})
    kinds = ["npz", "safetensors", "save_to_disk", "npz", "safetensors"]
    paths = []
    for i, kind in enumerate(kinds):
        device = tmp_path / f"device-{i}"
        device.mkdir()
        x, y = data.load_partition("digits", i, len(kinds), seed=0).tensors
        paths.append(_write(kind, x, y, device))
    honest = make_client_app(cfg)
    app = ClientApp()
    seen: set[int] = set()

    def on_device(msg: Message, context: Context) -> Message:
        # The in-process grid gives node i partition i; a device knows only its files.
        config = context.node_config
        if "partition-id" in config:
            config["data-path"] = str(paths[int(config.pop("partition-id"))])
        seen.add(context.node_id)
        return honest(msg, context)

    app.query()(on_device)
    app.train()(on_device)
    rows = run_inprocess(cfg, tmp_path / "out", client_app=app)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["accepted"] == len(kinds) for r in rows)
    assert rows[-1]["accuracy"] > 0.6, rows[-1]
    assert len(seen) == len(kinds)
