"""Crash-consistency checker for every store mode: writers killed with SIGKILL at random moments.

For each mode a long-lived parent imports torch once and forks one writer per attempt; the writer resumes
from the store's latest valid checkpoint and saves round after round, printing each round once its save
is committed. The test kills it after a random delay and then checks, with a fresh reader, that the store
loads a checkpoint at least as new as the last one reported committed, holding exactly that round's data
(bit for bit; never a mix of rounds). Modes: local (sync and background writes), incremental (deltas),
S3 through moto's server, incremental on S3, and the local-first mirror to S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from fedrobust.checkpoint import CheckpointStore
from fedrobust.checkpoint_mirror import MirroredStore

pytestmark = [
    pytest.mark.slow(seconds=10),  # each mode
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL"),
]

_WRITER = r"""
import json
import os
import sys

import torch

from fedrobust.checkpoint import CheckpointStore
from fedrobust.checkpoint_mirror import MirroredStore


def state(round_):
    base = torch.linspace(-1, 1, 256 * 1024).reshape(256, 1024)
    return {
        "model/w": base + round_ * 1e-3,
        "model/b": torch.rand(512, generator=torch.Generator().manual_seed(round_)).to(torch.bfloat16),
        "model/frozen": torch.ones(64, 1024),
        "model/step": torch.full((8,), round_, dtype=torch.int64),
    }


def open_store(spec):
    if spec["mirror"]:
        return MirroredStore(spec["url"], spec["mirror"], keep=2, full_every=spec["full_every"],
                             storage_options=spec["options"], initial_backoff=0.05)
    return CheckpointStore(spec["url"], keep=2, full_every=spec["full_every"], storage_options=spec["options"])


def write_forever(spec, background):
    store = open_store(spec)
    latest = store.latest_valid()
    round_ = 0 if latest is None else latest.round + 1
    say(f"ready {os.getpid()}")

    def report(future, r):
        if future.exception() is None:
            say(f"committed {r}")

    while True:
        meta = {"round": round_, "history": list(range(round_))}
        if background:
            store.save_async(round_, state(round_), meta).add_done_callback(lambda f, r=round_: report(f, r))
        else:
            store.save(round_, state(round_), meta)
            say(f"committed {round_}")
        round_ += 1


def say(line):
    # One write(2) per line: a pipe write this small is atomic, so a kill never leaves half a line
    # for the parent's "exited" line to be glued to (print writes text and newline separately).
    os.write(1, (line + "\n").encode())


spec = json.loads(sys.argv[1])
for command in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            write_forever(spec, command.strip() == "async")
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    say(f"exited {os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}")
"""


def _expected(round_: int) -> dict[str, torch.Tensor]:
    base = torch.linspace(-1, 1, 256 * 1024).reshape(256, 1024)
    return {
        "model/w": base + round_ * 1e-3,
        "model/b": torch.rand(512, generator=torch.Generator().manual_seed(round_)).to(torch.bfloat16),
        "model/frozen": torch.ones(64, 1024),
        "model/step": torch.full((8,), round_, dtype=torch.int64),
    }


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class _Writers:
    """Drives _WRITER: start a writer, kill it after a delay, report what it said it committed."""

    def __init__(self, spec: dict[str, object], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **env},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.child: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def _next(self) -> str:
        try:
            return self.lines.get(timeout=60)
        except queue.Empty:
            pytest.fail(f"writer process went silent (exit code {self.proc.poll()})")

    def run_and_kill(self, background: bool, delay: float, after_commits: int = 0) -> int:
        """Kill the writer ``delay`` seconds after its ``after_commits``-th commit (0: after it started).

        Returns the last round it reported as committed (-1 if none). Waiting for commits first makes the
        kills land in later saves (deltas, pruning) however slow the shared machine is.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(("async" if background else "sync") + "\n")
        self.proc.stdin.flush()
        line = self._next()
        assert line.startswith("ready "), line
        pid = self.child = int(line.split()[1])
        committed = [-1]
        while len(committed) <= after_commits:
            line = self._next()
            assert line.startswith("committed "), line
            committed.append(int(line.split()[1]))
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        while not (line := self._next()).startswith("exited "):
            assert line.startswith("committed "), line
            committed.append(int(line.split()[1]))
        self.child = None
        assert int(line.split()[1]) == signal.SIGKILL
        return max(committed)

    def close(self) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from experiments.local_s3 import local_s3

    with local_s3(bucket="crash") as server:
        yield server


MODES = {
    # mode: (remote?, mirror?, full_every, attempts, max delay in seconds)
    "local": (False, False, 1, 12, 0.3),
    "incremental": (False, False, 3, 12, 0.3),
    "s3": (True, False, 1, 6, 0.5),
    "s3-incremental": (True, False, 3, 6, 0.5),
    "mirror-incremental": (True, True, 3, 8, 0.5),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_writer_leaves_a_loadable_committed_round(mode: str, tmp_path, request: pytest.FixtureRequest) -> None:
    remote, mirror, full_every, attempts, max_delay = MODES[mode]
    options: dict[str, object] | None = None
    env: dict[str, str] = {}
    url = str(tmp_path / "ckpt")
    mirror_url = None
    if remote:
        server = request.getfixturevalue("s3")
        options, env = server.storage_options, server.env()
        remote_url = f"s3://{server.bucket}/{mode}-{uuid.uuid4().hex[:8]}"
        if mirror:
            mirror_url = remote_url
        else:
            url = remote_url
    spec = {"url": url, "mirror": mirror_url, "options": options, "full_every": full_every}

    def reader() -> CheckpointStore | MirroredStore:
        if mirror_url:
            return MirroredStore(url, mirror_url, keep=2, storage_options=options)
        return CheckpointStore(url, keep=2, storage_options=options)

    rng = random.Random(f"crash-{mode}")
    writers = _Writers(spec, env)
    resumed_from, kinds_seen = -1, set()
    try:
        for attempt in range(attempts):
            last_reported = writers.run_and_kill(
                background=attempt % 2 == 1, delay=rng.uniform(0.0, max_delay), after_commits=attempt % 4
            )
            store = reader()
            checkpoint = store.latest_valid()
            if checkpoint is None:
                assert last_reported < 0 and resumed_from < 0, f"attempt {attempt}: a committed checkpoint was lost"
                continue
            r = checkpoint.round
            # Everything reported committed survived the kill (durability) ...
            assert r >= max(last_reported, resumed_from), (attempt, r, last_reported, resumed_from)
            # ... and the checkpoint is one round's data, bit for bit, never a mix.
            assert checkpoint.meta == {"round": r, "history": list(range(r))}
            expected = _expected(r)
            assert sorted(checkpoint.tensors) == sorted(expected)
            for key, tensor in expected.items():
                assert _bits(checkpoint.tensors[key]) == _bits(tensor), (attempt, r, key)
            if mirror_url:
                # The mirror lags, but what it holds is never corrupt.
                assert isinstance(store, MirroredStore)
                uploaded = store.remote.latest_valid()
                if uploaded is not None:
                    assert uploaded.round <= r
                    assert _bits(uploaded.tensors["model/w"]) == _bits(_expected(uploaded.round)["model/w"])
            base = store.local if isinstance(store, MirroredStore) else store
            for round_ in base.rounds():
                manifest = json.loads(base._fs.cat_file(base._join(f"round-{round_:06d}", "manifest.json")))
                kinds_seen.add(manifest.get("kind", "full"))
            resumed_from = r
    finally:
        writers.close()
    assert resumed_from > 0, "no writer ever committed a checkpoint: the kills came too early"
    if full_every > 1:
        assert kinds_seen == {"full", "delta"}, kinds_seen
