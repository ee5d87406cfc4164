"""A resumed study reuses a stored result only if it ran as the run would now, defaults included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from experiments import study


def _store(out: Path, spec: study.RunSpec, overrides: list[str], client: dict | None) -> None:
    result = {**dataclasses.asdict(spec), "status": study.OK, "overrides": overrides, "rows": []}
    if client is not None:
        result["client"] = client
    study.result_path(out, spec).write_text(json.dumps(result))


def _sweep(extra: list[str]) -> tuple[list[study.RunSpec], dict[str, list[str]], dict]:
    specs = [study.RunSpec(partition="iid", rule="mean", attack="none", seed=s) for s in range(4)]
    overrides = {s.key: study.overrides_for(s, rounds=2, extra=extra) for s in specs}
    now = dataclasses.asdict(study.compose({specs[0].key: overrides[specs[0].key]})[specs[0].key].client)
    return specs, overrides, now


def test_a_result_from_other_client_defaults_is_run_again(tmp_path: Path) -> None:
    specs, overrides, now = _sweep([])
    assert now["local_epochs"] == 3  # the default since 2026-11-26
    _store(tmp_path, specs[0], overrides[specs[0].key], now)
    _store(tmp_path, specs[1], overrides[specs[1].key], now | {"lr": 0.1})  # conf/config.yaml said otherwise
    _store(tmp_path, specs[2], overrides[specs[2].key], None)  # from before the record: 2 local epochs
    _store(tmp_path, specs[3], [*overrides[specs[3].key], "client.lr=0.1"], now)  # other overrides
    assert study._up_to_date({s.key: s for s in specs}, overrides, tmp_path) == {specs[0].key}


def test_a_result_from_before_the_record_holds_where_its_overrides_set_the_changed_default(
    tmp_path: Path,
) -> None:
    """Swept with --set client.local_epochs=3 before results recorded their client: the same run today."""
    specs, overrides, now = _sweep(["client.local_epochs=3"])
    _store(tmp_path, specs[0], overrides[specs[0].key], None)
    _store(tmp_path, specs[1], overrides[specs[1].key], now)
    specs_2, overrides_2, _ = _sweep(["client.local_epochs=2"])
    assert study._up_to_date({s.key: s for s in specs[:2]}, overrides, tmp_path) == {specs[0].key, specs[1].key}
    # With 2 local epochs set explicitly, a record-less result of the same overrides is that run too.
    old = tmp_path / "old"
    old.mkdir()
    _store(old, specs_2[0], overrides_2[specs_2[0].key], None)
    assert study._up_to_date({specs_2[0].key: specs_2[0]}, overrides_2, old) == {specs_2[0].key}
