"""Study result files (``experiments/study.py --out DIR``) written by hand, for the report and selection tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def study_run(partition: str, rule: str, attack: str, seed: int, acc: float, *, status: str = "ok",
              asr: float | None = None) -> dict[str, Any]:
    """One run's result as ``experiments.study`` writes it, reduced to what the reports read."""
    row: dict[str, Any] = {"round": 15, "accuracy": acc}
    if asr is not None:
        row["backdoor_asr"] = asr
    return {"partition": partition, "rule": rule, "attack": attack, "seed": seed, "status": status,
            "rows": [row] if status == "ok" else [], "num_clients": 20, "num_byzantine": 4, "num_rounds": 15}


def write_sweep(directory: Path, runs: list[dict[str, Any]], extra: list[str] | None = None) -> Path:
    """A study's results directory holding ``runs``, swept with the Hydra overrides ``extra``."""
    directory.mkdir(parents=True)
    for r in runs:
        (directory / f"{r['partition']}__{r['rule']}__{r['attack']}__s{r['seed']}.json").write_text(json.dumps(r))
    (directory / "study.json").write_text(json.dumps({"command": "python -m experiments.study ...",
                                                      "settings": {"extra": extra or []}}))
    return directory
