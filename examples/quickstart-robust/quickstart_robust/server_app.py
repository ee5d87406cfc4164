"""A ServerApp with fedrobust's RobustStrategy in place of FedAvg: robust, checkpointed, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedrobust import RobustStrategy, plot
from quickstart_robust.task import Net, load_centralized_dataset
from quickstart_robust.task import test as test_fn

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    out = Path(str(config["output-dir"])) if config["output-dir"] else None
    strategy = RobustStrategy(
        aggregator=str(config["aggregator"]),
        num_byzantine=int(config["num-byzantine"]),
        fraction_train=float(config["fraction-train"]),
        max_update_norm=50.0,
        checkpoint_dir=str(config["checkpoint-dir"]) or None,
        metrics_path=out / "metrics.jsonl" if out else None,  # one row per round: what became of each reply
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=int(config["num-server-rounds"]),
        evaluate_fn=global_evaluate,
    )
    if out:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result.arrays.to_torch_state_dict(), out / "final_model.pt")
        history = {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()}
        (out / "history.json").write_text(json.dumps(history, indent=1))
        try:  # rounds.png: accuracy per round, and what became of each round's replies
            plot.draw(out / "metrics.jsonl")
        except (OSError, ValueError) as problem:  # e.g. no round was trained: the run itself is fine
            print(f"no rounds.png: {problem}")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Central evaluation on the held-out test set."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test_fn(model, load_centralized_dataset())
    return MetricRecord({"loss": loss, "accuracy": accuracy})
