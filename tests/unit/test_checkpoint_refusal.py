"""A resume over corrupt checkpoints names each one and its reason; a fresh start keeps them aside."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedrobust.strategies.checkpointing import GuardState, NoValidCheckpointError, RoundCheckpointer


def _checkpointer(url: Path, resume: str = "auto") -> RoundCheckpointer:
    return RoundCheckpointer(str(url), settings={"lr": 0.1}, keep=3, resume=resume)


def _save_rounds(url: Path, rounds: int) -> None:
    checkpointer = _checkpointer(url)
    assert checkpointer.restore() is None
    for r in range(1, rounds + 1):
        checkpointer.save(r, {"w": torch.full((4,), float(r))}, ({}, {}), [], GuardState(), wait=True)


def test_all_corrupt_checkpoints_stop_the_resume_with_each_reason(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _save_rounds(url, 2)
    (url / "round-000002" / "meta.json").write_text("{ not json")
    tensors = next(p for p in (url / "round-000001").iterdir() if p.suffix == ".safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-3])  # truncated
    with pytest.raises(NoValidCheckpointError) as refused:
        _checkpointer(url).restore()
    message = str(refused.value)
    assert "round-000002" in message and "round-000001" in message, message
    assert message.index("round-000002") < message.index("round-000001")  # newest first, as tried
    assert "Start fresh with resume='never': they are moved aside" in message  # as a library user writes it
    # Nothing was touched by the refusal.
    assert sorted(p.name for p in url.iterdir()) == ["round-000001", "round-000002"]
    # A run of fedrobust's apps (its settings hold the run config) names the run config's key.
    app_run = RoundCheckpointer(str(url), settings={"run": {"seed": 0}}, keep=3)
    with pytest.raises(NoValidCheckpointError, match=r"Start fresh with checkpoint.resume=never: they are moved"):
        app_run.restore()


def test_a_fresh_start_moves_earlier_checkpoints_aside_and_never_deletes_them(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _save_rounds(url, 2)
    before = {p.name: p.read_bytes() for p in (url / "round-000002").iterdir()}
    fresh = _checkpointer(url, resume="never")
    assert fresh.restore() is None
    fresh.save(1, {"w": torch.zeros(4)}, ({}, {}), [], GuardState(), wait=True)
    names = sorted(p.name for p in url.iterdir())
    aside = [n for n in names if n.startswith("aside-")]
    assert [n.rsplit("-", 1)[-1] for n in aside] == ["000001", "000002"], names
    assert "round-000001" in names and "round-000002" not in names
    kept = next(url / n for n in aside if n.endswith("round-000002"))
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before  # byte for byte
    # The moved checkpoints no longer count: a resume now finds the fresh run's round 1.
    resumed = _checkpointer(url).restore()
    assert resumed is not None and resumed.round == 1


def test_an_earlier_hydra_checkpoint_is_not_said_to_lack_what_its_run_config_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Hydra path records its whole run config (server optimizer schedule and client settings in it): a
    checkpoint of a version that recorded no ``server_lr_schedule`` or ``train_config`` still compared them."""
    url = tmp_path / "ck"
    run = {"server_optimizer": {"schedule": "constant"}, "client": {"lr": 0.3}}
    earlier = RoundCheckpointer(str(url), settings={"run": run, "seed": 0})
    assert earlier.restore() is None
    earlier.save(1, {"w": torch.zeros(4)}, ({}, {}), [], GuardState(), wait=True)
    later = {"train_config": {"lr": 0.3}, "server_lr_schedule": "constant", "server_lr_min_ratio": 0.0}
    with caplog.at_level("WARNING"):
        assert RoundCheckpointer(str(url), settings={"run": run, "seed": 0, **later}).restore() is not None
    assert not [r for r in caplog.records if "records no" in r.getMessage()]
    # Without a run config the same checkpoint says what it could not compare.
    plain = tmp_path / "plain"
    earlier = RoundCheckpointer(str(plain), settings={"seed": 0})
    assert earlier.restore() is None
    earlier.save(1, {"w": torch.zeros(4)}, ({}, {}), [], GuardState(), wait=True)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert RoundCheckpointer(str(plain), settings={"seed": 0, **later}).restore() is not None
    assert any("records no train_config, server_lr_schedule, server_lr_min_ratio" in r.getMessage()
               for r in caplog.records)


def test_a_resume_past_a_corrupt_newest_checkpoint_keeps_it_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 3 does not verify: the resume takes round 2, and round 3 is moved aside for inspection instead
    of being deleted by the resumed run's save of round 3."""
    url = tmp_path / "ck"
    _save_rounds(url, 3)
    tensors = next(p for p in (url / "round-000003").iterdir() if p.suffix == ".safetensors")
    corrupt = tensors.read_bytes()[:-3]
    tensors.write_bytes(corrupt)
    resumed = _checkpointer(url)
    with caplog.at_level("WARNING"):
        point = resumed.restore()
    assert point is not None and point.round == 2
    aside = [p for p in url.iterdir() if p.name.startswith("aside-")]
    assert [p.name.rsplit("-", 1)[-1] for p in aside] == ["000003"]
    assert (aside[0] / tensors.name).read_bytes() == corrupt
    assert any("moved 1 checkpoint(s) that did not verify aside, kept for inspection" in r.getMessage()
               for r in caplog.records)
    resumed.save(3, {"w": torch.full((4,), 3.0)}, ({}, {}), [], GuardState(), wait=True)
    assert (aside[0] / tensors.name).read_bytes() == corrupt  # the new round 3 left it alone
    assert sorted(p.name for p in url.iterdir() if p.name.startswith("round-")) == [
        "round-000001", "round-000002", "round-000003"]


def test_a_write_that_never_finished_is_not_kept_aside(tmp_path: Path) -> None:
    """A round-* directory without a manifest is an interrupted write, not evidence: the resume leaves it to
    be replaced, as before, instead of keeping one more aside-* directory after every crash."""
    url = tmp_path / "ck"
    _save_rounds(url, 2)
    (url / "round-000003").mkdir()
    (url / "round-000003" / "meta.json").write_text("{}")  # written, never committed
    point = _checkpointer(url).restore()
    assert point is not None and point.round == 2
    assert not [p for p in url.iterdir() if p.name.startswith("aside-")]


def test_a_closure_rule_is_compared_by_what_it_captured_unless_an_earlier_checkpoint_lacks_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedrobust.checkpoint import CheckpointMismatchError
    from fedrobust.components import rule_identity

    def clipped_mean(clip: float):  # type: ignore[no-untyped-def]
        return lambda rows: rows.clamp(-clip, clip).mean(0)

    def save(url: Path, aggregator: dict) -> None:
        checkpointer = RoundCheckpointer(str(url), settings={"aggregator": aggregator})
        assert checkpointer.restore() is None
        checkpointer.save(1, {"w": torch.zeros(4)}, ({}, {}), [], GuardState(), wait=True)

    one, two = rule_identity(clipped_mean(1.0)), rule_identity(clipped_mean(2.0))
    save(tmp_path / "now", one)
    with pytest.raises(CheckpointMismatchError, match=r"aggregator.captured.clip: 1.0 -> 2.0"):
        RoundCheckpointer(str(tmp_path / "now"), settings={"aggregator": two}).restore()
    # As an earlier version recorded a function: no captured values. Resumed, and said.
    save(tmp_path / "earlier", {k: v for k, v in one.items() if k != "captured"})
    with caplog.at_level("WARNING"):
        assert RoundCheckpointer(str(tmp_path / "earlier"), settings={"aggregator": two}).restore() is not None
    assert any("records no values captured by the function of aggregator" in r.getMessage() for r in caplog.records)


def test_a_change_the_run_config_records_is_said_once_under_its_own_key(tmp_path: Path) -> None:
    """Fedrobust's apps record the run config and the strategy's settings: a new seed differs in both."""
    from fedrobust.checkpoint import CheckpointMismatchError

    url = tmp_path / "ck"
    first = RoundCheckpointer(str(url), settings={"run": {"seed": 0, "num_clients": 4}, "seed": 0, "keep_me": 1})
    assert first.restore() is None
    first.save(1, {"w": torch.zeros(4)}, ({}, {}), [], GuardState(), wait=True)
    later = RoundCheckpointer(str(url), settings={"run": {"seed": 1, "num_clients": 4}, "seed": 1, "keep_me": 2})
    with pytest.raises(CheckpointMismatchError) as refused:
        later.restore()
    message = str(refused.value)
    assert "run.seed: 0 -> 1" in message and "; seed: 0 -> 1" not in message, message
    assert "keep_me: 1 -> 2" in message, message  # a setting the run config does not hold is still said
