"""The report describes the clients' training its runs recorded, or says the stored runs predate it."""

from __future__ import annotations

from experiments import report

CLIENT = {"local_epochs": 3, "lr": 0.3, "momentum": 0.9, "batch_size": 16, "weight_decay": 0.0}


def test_recorded_training_is_described_as_recorded() -> None:
    assert report._clients([{"client": CLIENT}, {"client": CLIENT}]) == (
        "3 local epochs of SGD (lr 0.3, momentum 0.9, batch 16)")


def test_runs_from_before_the_record_say_how_to_rerun_them() -> None:
    line = report._clients([{}, {}])
    assert line.startswith("2 local epochs of SGD") and "--set client.local_epochs=2" in line


def test_runs_that_trained_differently_are_not_described_as_one() -> None:
    for mixed in ([{"client": CLIENT}, {}], [{"client": CLIENT}, {"client": CLIENT | {"local_epochs": 5}}]):
        assert "differs between runs" in report._clients(mixed)
