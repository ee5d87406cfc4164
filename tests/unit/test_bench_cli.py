"""The benchmark's command line refuses a wrong entry before it starts any measuring process."""

from __future__ import annotations

import pytest

from experiments import bench_server_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--flower", "FedAvg"], "--flower: unknown entry 'FedAvg'; valid: flower_fedavg, flower_trimmed_mean"),
        (["--rules", "trimmed_men"],
         "unknown aggregation rule 'trimmed_men' (did you mean 'trimmed_mean'?); valid names: mean, "),
    ],
)
def test_an_unknown_entry_names_the_valid_ones(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_server_path.main(argv)
    assert str(stop.value).startswith(message)
