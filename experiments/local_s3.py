"""A throwaway S3-compatible server on loopback (moto), for checkpoint tests and benchmarks.

``moto_server`` (from ``moto[server]``) runs as a child process on 127.0.0.1 on a port the OS picks; it keeps
every object in memory and forgets them when it stops. Nothing here is used by a real run.

Use::

    with local_s3() as s3:
        store = CheckpointStore(f"s3://{s3.bucket}/run", storage_options=s3.storage_options)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Any fixed values work with moto; they only have to be present so botocore signs requests.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_RUNNING = re.compile(r"Running on http://127\.0\.0\.1:(\d+)")


@dataclass
class LocalS3:
    """A running moto server: its endpoint and a bucket created in it."""

    endpoint_url: str
    bucket: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """Environment variables that point botocore-based clients (s3fs, boto3) at this server."""
        return {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}


@contextlib.contextmanager
def local_s3(bucket: str = "fedrobust", startup_timeout: float = 60.0) -> Iterator[LocalS3]:
    """Start moto's S3 server on a free loopback port, create ``bucket``, stop the server (by pid) after.

    Raises
    ------
    RuntimeError
        If the server does not come up within ``startup_timeout`` seconds.
    """
    import s3fs  # noqa: F401 - fail here, clearly, when the optional test dependency is missing

    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, **FAKE_CREDENTIALS}
    # The server's request log goes to a file: a pipe nobody drains would fill up and stall the server.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from moto.server import main; sys.exit(main())", "-H", "127.0.0.1",
         "-p", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        port = _wait_for_port(log.name, proc, startup_timeout)
        endpoint = f"http://127.0.0.1:{port}"
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        server = LocalS3(endpoint_url=endpoint, bucket=bucket, storage_options=options)
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        fs.mkdir(bucket)
        logger.debug("moto S3 server pid %d at %s with bucket %s", proc.pid, endpoint, bucket)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        os.unlink(log.name)


def _wait_for_port(log_path: str, proc: subprocess.Popen[bytes], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            match = _RUNNING.search(fh.read())
        if match:
            return int(match.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        output = fh.read()[-2000:]
    raise RuntimeError(f"moto S3 server did not start (exit code {proc.poll()}); its output:\n{output}")
