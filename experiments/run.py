"""Hydra entry point: one experiment on Flower's simulation engine, in this process.

    python -m experiments.run                                  # the default experiment
    python -m experiments.run aggregator=krum num_rounds=10    # override anything
    python -m experiments.run -m aggregator=median,krum seed=0,1   # a sweep

Metrics (metrics.jsonl), the resolved config and the final model land in Hydra's
run directory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from experiments.simulate import simulate  # noqa: E402
from fedrobust.config import RunConfig, from_nested  # noqa: E402
from fedrobust.strategies.errors import EXIT_PREEMPTED, Preempted  # noqa: E402

log = logging.getLogger(__name__)

ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """The typed run config of a composed Hydra config (the hydra node itself dropped)."""
    values: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    values.pop("hydra", None)
    return from_nested(values)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    run_cfg = to_run_config(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        rows = simulate(run_cfg, out_dir)
    except Preempted as stopped:
        if stopped.checkpointed:
            print(f"{stopped}; checkpoint written, run the same command again to resume", flush=True)
        else:
            print(f"{stopped}; no checkpoint (checkpoint.dir is empty): the same command starts over", flush=True)
        sys.exit(EXIT_PREEMPTED)
    final = rows[-1]["accuracy"] if rows else float("nan")
    (out_dir / "final.json").write_text(json.dumps({"accuracy": final, "rounds": len(rows)}))
    return final


if __name__ == "__main__":
    main()
