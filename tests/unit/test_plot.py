"""fedrobust.plot: a run's metrics rows read back and drawn into a real PNG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedrobust.plot import plot_rounds, read_rows, reply_counts, rounds_figure

REPO = Path(__file__).resolve().parents[2]


def _row(round_: int, accuracy: float, **counts: object) -> dict[str, object]:
    row: dict[str, object] = {"round": round_, "accuracy": accuracy, "accepted": 10, "dropped": 0, "rejected": {},
                              "rollbacks": 0}
    return row | counts


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_come_in_round_order_and_a_repeated_round_s_last_row_counts(tmp_path: Path) -> None:
    rows_written = [_row(1, 0.5), _row(2, 0.6), _row(3, 0.1), _row(3, 0.7), _row(2, 0.65)]
    metrics = _write(tmp_path / "metrics.jsonl", rows_written)
    rows = read_rows(tmp_path)  # the folder works as well as the file
    assert [(r["round"], r["accuracy"]) for r in rows] == [(1, 0.5), (2, 0.65), (3, 0.7)]
    assert read_rows(metrics) == rows


def test_what_became_of_the_replies_adds_up_to_the_sampled_nodes() -> None:
    row = _row(1, 0.9, accepted=14, filtered=2, excluded=3, dropped=1, rejected={"non_finite": 2, "bad_signature": 3})
    counts = reply_counts(row)
    assert counts == {"used": 9, "filtered": 2, "excluded": 3, "rejected": 5, "dropped": 1}
    assert sum(counts.values()) == 20
    # Rows written before filtering and exclusion were reported count every accepted reply as used.
    assert reply_counts({"round": 1, "accepted": 7, "dropped": 2})["used"] == 7


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"round": 1, "accepted": 3}\nnot json\n', "metrics.jsonl:2: not a JSON metrics row"),
        ('{"accepted": 3}\n', "metrics.jsonl:1: not a metrics row (no integer 'round')"),
        ("\n", "no metrics rows"),
        ('{"round": 1, "accepted": 3}\n{"round": 2, "rejected": ["non_finite"]}\n',
         "metrics.jsonl:2: not a metrics row ('rejected' is ['non_finite'], not a count per reason)"),
        ('{"round": 1, "rejected": {"non_finite": "two"}}\n', "metrics.jsonl:1: not a metrics row ('rejected'"),
        ('{"round": 1, "accepted": -1}\n', "metrics.jsonl:1: not a metrics row ('accepted' is -1, not a count)"),
        ('{"round": 1, "dropped": 2.5}\n', "metrics.jsonl:1: not a metrics row ('dropped' is 2.5, not a count)"),
    ],
    ids=["bad-line", "no-round", "empty", "rejected-list", "rejected-text", "negative", "fraction"],
)
def test_a_file_that_is_not_a_run_s_metrics_is_named_with_its_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_rows(tmp_path / "metrics.jsonl")


def test_the_picture_is_a_png_and_differs_when_the_replies_do(tmp_path: Path) -> None:
    clean = [_row(r, 0.5 + 0.1 * r) for r in range(1, 4)]
    attacked = [_row(r, 0.5 + 0.1 * r, accepted=10, filtered=4) for r in range(1, 4)]
    plot_rounds(clean, tmp_path / "clean.png")
    plot_rounds(attacked, tmp_path / "attacked.png")
    first, second = (tmp_path / "clean.png").read_bytes(), (tmp_path / "attacked.png").read_bytes()
    assert first.startswith(b"\x89PNG") and second.startswith(b"\x89PNG")
    assert first != second  # the filtered band is drawn


@pytest.mark.parametrize("rolled_back", [1, 3], ids=["first-round", "later-round"])
def test_a_rollback_is_marked_in_its_round(tmp_path: Path, rolled_back: int) -> None:
    # rollbacks counts the run's rollbacks so far: the round where it rises had one, the first round too.
    rows = [_row(r, 0.5 + 0.1 * r) for r in range(1, 5)]
    plot_rounds(rows, tmp_path / "none.png")
    marked = [r | {"rollbacks": int(r["round"] >= rolled_back)} for r in rows]
    plot_rounds(marked, tmp_path / "marked.png")
    assert (tmp_path / "marked.png").read_bytes() != (tmp_path / "none.png").read_bytes()


def test_a_retried_round_is_marked_above_its_bands() -> None:
    rows = [_row(1, 0.6), _row(2, 0.7, attempts=3, accepted=6, dropped=4), _row(3, 0.8, attempts=1)]
    replies = rounds_figure(rows).axes[1]
    (marks,) = replies.collections
    assert [tuple(xy) for xy in marks.get_offsets()] == [(2.0, 10.5)]  # above the 6 + 4 replies of round 2
    assert "retried (bands: last attempt)" in [t.get_text() for t in replies.get_legend().get_texts()]
    assert not rounds_figure([_row(1, 0.6), _row(2, 0.7)]).axes[1].collections


def test_a_long_run_is_one_band_per_kind_of_reply(tmp_path: Path) -> None:
    # A bar per round and kind made a 10,000-round run's picture take about a minute at the end of the run.
    rows = [_row(r, 0.9, accepted=18, filtered=2, dropped=r % 3) for r in range(1, 5001)]
    replies = rounds_figure(rows).axes[1]
    assert len(replies.patches) == 3  # used, filtered, dropped
    assert len(rounds_figure(rows[:3]).axes[1].patches) == 3  # as for a short run
    plot_rounds(rows, tmp_path / "long.png")
    assert (tmp_path / "long.png").read_bytes().startswith(b"\x89PNG")


def test_the_command_writes_beside_the_metrics_and_refuses_a_missing_file(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_row(1, 0.8), _row(2, 0.9)])
    done = subprocess.run([sys.executable, "-m", "fedrobust.plot", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rounds.png").read_bytes().startswith(b"\x89PNG")
    missing = subprocess.run([sys.executable, "-m", "fedrobust.plot", str(tmp_path / "nowhere.jsonl")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "fedrobust.plot:" in missing.stderr and "nowhere.jsonl" in missing.stderr
    _write(tmp_path / "edited.jsonl", [_row(1, 0.8, rejected=3)])  # a hand-edited row: named, no traceback
    edited = subprocess.run([sys.executable, "-m", "fedrobust.plot", str(tmp_path / "edited.jsonl")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert edited.returncode == 2 and "edited.jsonl:1: not a metrics row ('rejected' is 3" in edited.stderr
    assert "Traceback" not in edited.stderr
    # --out: a folder (ending in /) gets rounds.png in it; a name without a suffix gets .png, as matplotlib adds it.
    for out, written in (("pics/", "pics/rounds.png"), ("picture", "picture.png")):
        done = subprocess.run([sys.executable, "-m", "fedrobust.plot", str(tmp_path), "--out", f"{tmp_path}/{out}"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == f"wrote {tmp_path / written}", done
        assert (tmp_path / written).read_bytes().startswith(b"\x89PNG")


def test_a_last_row_cut_off_by_a_killed_run_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole = json.dumps(_row(1, 0.8)) + "\n" + json.dumps(_row(2, 0.9))
    (tmp_path / "metrics.jsonl").write_text(whole[:-7])  # the second row's append was cut short
    assert [r["round"] for r in read_rows(tmp_path)] == [1]
    assert "metrics.jsonl:2: the last row is cut off" in caplog.text
    (tmp_path / "metrics.jsonl").write_text(whole[:-7] + "\n")  # a whole line that is not JSON is refused
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON metrics row"):
        read_rows(tmp_path)


@pytest.mark.filterwarnings("error")  # matplotlib warns about a legend with nothing in it
def test_rows_without_an_evaluation_still_draw(tmp_path: Path) -> None:
    # A ServerApp without evaluate_fn writes no accuracy: the replies panel alone says what happened.
    rows = [{"round": r, "accepted": 4, "dropped": 1, "rejected": {"unknown_key": 1}, "rollbacks": r - 1}
            for r in (1, 2)]
    plot_rounds(rows, tmp_path / "rounds.png")
    assert (tmp_path / "rounds.png").read_bytes().startswith(b"\x89PNG")
