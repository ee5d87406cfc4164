"""Start and stop real Flower processes (SuperLink, SuperNodes) for process-level tests.

Flower 1.41 facts this module relies on (checked against the installed ``flwr``):

- ``flower-superlink`` serves *one* HTTP port (``--host``/``--port``, default 8000) for the
  Control API (``flwr run``/``flwr ls``), the Fleet API (SuperNodes) and the ServerAppIo
  runtime API. ``--control-api-address``/``--fleet-api-address`` are deprecated no-ops for
  the HTTP transport. ``GET /health`` answers 200 once the server is up.
- A SuperLink (and a SuperNode) started with the default ``--isolation subprocess`` spawns
  ``flower-superexec`` *by name from PATH*, in a new session, and that one spawns
  ``flwr-serverapp`` / ``flwr-simulation`` / ``flwr-clientapp``. The helpers put the
  interpreter's ``bin`` directory first on PATH. Each child watches its parent's pid and
  exits when it is gone, but a SIGKILLed tree can leave them behind, so :func:`stop` also
  signals every descendant it saw before stopping the root.
- ``flower-supernode`` connects with ``--superlink host:port`` and serves its own runtime
  HTTP API on ``--host``/``--port`` (default 9094): every SuperNode on a machine needs its
  own ``--port``.
- TLS: the SuperLink takes ``--ssl-ca-certfile --ssl-certfile --ssl-keyfile`` (or
  ``--insecure``); a SuperNode takes ``--root-certificates CA`` (or ``--insecure``; both at
  once is an error). Node authentication: ``flower-superlink --enable-supernode-auth`` and
  ``flower-supernode --auth-supernode-private-key KEY``, the public key registered with
  ``flwr supernode register KEY <superlink-connection>``.
- ``flwr`` reads SuperLink connections from ``$FLWR_HOME/config.toml``
  (see :func:`write_flwr_home`).

Every process gets its own log file under the test's ``tmp_path``; :meth:`Proc.tail`
returns its end for a failure message.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
OFFLINE_ENV = {
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}

TlsFiles = tuple[Path, Path, Path]  # (ca certificate, server certificate, server private key)


# --------------------------------------------------------------------------- the app `flwr run` packs


def app_copy(root: Path, dest: Path) -> Path:
    """``dest``: the Flower app at ``root`` as its FAB holds it, ``pyproject.toml`` and the files its
    ``fab-include`` names (plus ``.gitignore``), for ``flwr run dest``.

    ``flwr run <dir>`` first walks every file under ``dir`` (Flower's ``collect_files``), ``.venv``'s
    ~60,000 included when ``dir`` is this repository: 4.5 CPU-s per run on the 2-core CI machine. The
    FAB built from the copy has the same bytes (tests/integration/test_components.py checks it).
    """
    import shutil
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = project["tool"]["flwr"]["app"]["fab-include"]
    files = {"pyproject.toml", ".gitignore"} | {
        path.relative_to(root).as_posix() for pattern in patterns for path in root.glob(pattern) if path.is_file()
    }
    for name in sorted(files):
        if (root / name).exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
    return dest


# --------------------------------------------------------------------------- ports, env


def free_port(host: str = HOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the kernel picks it at random)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def bin_dir() -> Path:
    """Directory of the running interpreter's console scripts (``flwr``, ``flower-*``)."""
    return Path(sys.executable).parent


def executable(name: str) -> str:
    """Full path of a Flower console script installed next to this interpreter."""
    path = bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{name!r} not found in {bin_dir()}; is flwr installed in this environment?")
    return str(path)


def flower_env(flwr_home: Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for Flower processes: offline switches, one thread, PATH with our ``bin`` first, FLWR_HOME."""
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    # One thread per process: a test runs several ClientApps at once on 2 cores, and with two threads
    # each they spent half their CPU time waiting on each other (2 nodes, 2 rounds: the ClientApp
    # processes took 49 CPU-s instead of 25, and each round 24-28 s instead of 8-9 s).
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = os.pathsep.join([str(bin_dir()), env.get("PATH", "")])
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    if extra:
        env.update(extra)
    return env


# --------------------------------------------------------------------------- $FLWR_HOME


def write_flwr_home(
    tmp_path: Path,
    federation_name: str,
    address: str,
    *,
    insecure: bool = True,
    root_certificates: Path | str | None = None,
    options: Mapping[str, Any] | None = None,
    default: bool = True,
    home: Path | None = None,
) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection; return FLWR_HOME.

    The format is what Flower 1.41's ``flwr.cli.flower_config`` reads::

        [superlink]
        default = "<federation_name>"

        [superlink.<federation_name>]
        address = "127.0.0.1:PORT"       # the SuperLink's HTTP port (--port)
        insecure = true                  # or root-certificates = "/abs/ca.crt"
        options.num-supernodes = 5       # simulation only (deprecated in 1.41, still read)
        options.backend.client-resources.num-cpus = 1

    ``options`` may be nested (``{"backend": {"client-resources": {"num-cpus": 1}}}``) or
    dotted (``{"backend.client-resources.num-cpus": 1}``). Keys Flower knows under options:
    ``num-supernodes``, ``verbose``, ``backend.name``, ``backend.client-resources.num-cpus``,
    ``backend.client-resources.num-gpus``, ``backend.init-args.{num-cpus, num-gpus,
    logging-level, log-to-driver}``. ``root_certificates`` must be an absolute path.
    """
    import tomli_w  # a dependency of flwr

    home = home if home is not None else tmp_path / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    connection: dict[str, Any] = {"address": address}
    if insecure:
        if root_certificates is not None:
            raise ValueError("insecure=True and root_certificates are mutually exclusive")
        connection["insecure"] = True
    elif root_certificates is not None:
        cert = Path(root_certificates)
        if not cert.is_absolute():
            raise ValueError(f"root_certificates must be an absolute path, got {cert}")
        connection["root-certificates"] = str(cert)
    if options:
        connection["options"] = _nest(options)
    config: dict[str, Any] = {"superlink": {federation_name: connection}}
    if default:
        config["superlink"] = {"default": federation_name, **config["superlink"]}
    (home / "config.toml").write_text(tomli_w.dumps(config), encoding="utf-8")
    return home


def _nest(flat_or_nested: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat_or_nested.items():
        if isinstance(value, Mapping):
            value = _nest(value)
        *parents, leaf = str(key).split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return nested


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A Flower process started by this module."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""  # host:port the process serves (SuperLink: HTTP API; SuperNode: runtime API)
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"<no log at {self.log_path}: {err}>"
        return "\n".join(text.splitlines()[-lines:])


def _spawn(name: str, args: Sequence[str], log_dir: Path, env: Mapping[str, str], cwd: Path) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen(
            list(args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,  # own process group: stop() signals the whole group
        )
    return Proc(name=name, popen=popen, log_path=log_path, args=list(args))


def wait_for_http(proc: Proc, url: str, *, timeout: float = 60.0, cafile: Path | None = None) -> None:
    """Wait until ``url`` answers 200 (or raise with the process log if it dies or times out)."""
    context = ssl.create_default_context(cafile=str(cafile)) if cafile is not None else None
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was ready; log tail:\n"
                f"{proc.tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last_error = err
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name} not ready at {url} after {timeout:.0f}s ({last_error}); log tail:\n{proc.tail()}")


def wait_for_port(proc: Proc, host: str, port: int, *, timeout: float = 60.0) -> None:
    """Wait until ``host:port`` accepts TCP connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was ready; log tail:\n"
                f"{proc.tail()}"
            )
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name} not listening on {host}:{port} after {timeout:.0f}s; log tail:\n{proc.tail()}")


def start_superlink(
    tmp_path: Path,
    *,
    simulation: bool,
    port: int | None = None,
    host: str = HOST,
    tls: TlsFiles | None = None,
    database: Path | str | None = None,
    enable_supernode_auth: bool = False,
    health_port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    flwr_home: Path | None = None,
    name: str = "superlink",
    wait: bool = True,
    ready_timeout: float = 60.0,
) -> Proc:
    """Start ``flower-superlink`` on ``host:port`` (a free port when None) and wait for ``/health``.

    ``tls`` is ``(ca_cert, server_cert, server_key)``; None starts it with ``--insecure``.
    ``database`` None keeps the state in memory. The process runs in ``tmp_path`` (the
    ServerApp subprocess inherits that cwd) with ``FLWR_HOME`` = ``flwr_home`` or
    ``tmp_path/"flwr_home"`` (installed FABs land under it). Its log is
    ``tmp_path/"logs"/"<name>.log"``.
    """
    port = port if port is not None else free_port(host)
    args = [executable("flower-superlink"), "--host", host, "--port", str(port)]
    if simulation:
        args.append("--simulation")
    if tls is None:
        args.append("--insecure")
    else:
        ca, cert, key = (Path(p) for p in tls)
        args += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    if database is not None:
        args += ["--database", str(database)]
    if enable_supernode_auth:
        args.append("--enable-supernode-auth")
    if health_port is not None:
        args += ["--health-server-address", f"{host}:{health_port}"]
    args += list(extra_args)
    home = flwr_home if flwr_home is not None else tmp_path / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    proc = _spawn(name, args, tmp_path / "logs", env if env is not None else flower_env(home), cwd=tmp_path)
    proc.address = f"{host}:{port}"
    if wait:
        try:
            scheme = "https" if tls is not None else "http"
            wait_for_http(proc, f"{scheme}://{proc.address}/health", timeout=ready_timeout,
                          cafile=Path(tls[0]) if tls is not None else None)
        except BaseException:
            stop(proc)
            raise
    return proc


def start_supernode(
    tmp_path: Path,
    *,
    superlink: str,
    port: int | None = None,
    host: str = HOST,
    node_config: str | Mapping[str, Any] = "",
    root_certificates: Path | None = None,
    auth_private_key: Path | None = None,
    runtime_tls: TlsFiles | None = None,
    max_retries: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    flwr_home: Path | None = None,
    name: str | None = None,
    wait: bool = True,
    ready_timeout: float = 60.0,
) -> Proc:
    """Start ``flower-supernode`` connected to ``superlink`` (the SuperLink's ``host:port``).

    Each SuperNode serves its own runtime (ClientAppIo) HTTP API on ``host:port`` (a free
    port when None). ``root_certificates`` None means ``--insecure`` towards the SuperLink.
    ``node_config`` is a Flower config string (``'partition-id=0 num-partitions=5'``) or a
    mapping rendered as one (strings quoted). ``wait`` waits until the runtime port listens
    (not until the node registered with the SuperLink).
    """
    port = port if port is not None else free_port(host)
    name = name or f"supernode-{port}"
    args = [executable("flower-supernode"), "--superlink", superlink, "--host", host, "--port", str(port)]
    if root_certificates is None:
        args.append("--insecure")
    else:
        args += ["--root-certificates", str(root_certificates)]
    if auth_private_key is not None:
        args += ["--auth-supernode-private-key", str(auth_private_key)]
    if runtime_tls is not None:
        ca, cert, key = (Path(p) for p in runtime_tls)
        args += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    config_str = node_config if isinstance(node_config, str) else node_config_string(node_config)
    if config_str:
        args += ["--node-config", config_str]
    if max_retries is not None:
        args += ["--max-retries", str(max_retries)]
    args += list(extra_args)
    home = flwr_home if flwr_home is not None else tmp_path / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    proc = _spawn(name, args, tmp_path / "logs", env if env is not None else flower_env(home), cwd=tmp_path)
    proc.address = f"{host}:{port}"
    if wait:
        try:
            wait_for_port(proc, host, port, timeout=ready_timeout)
        except BaseException:
            stop(proc)
            raise
    return proc


def node_config_string(config: Mapping[str, Any]) -> str:
    """Render a node config mapping as ``--node-config`` wants it: ``k=v`` pairs, TOML values."""
    parts = []
    for key, value in config.items():
        if isinstance(value, bool):
            rendered = "true" if value else "false"
        elif isinstance(value, str):
            if '"' in value or " " in value and "'" in value:
                raise ValueError(f"node config value for {key!r} cannot be quoted: {value!r}")
            rendered = f'"{value}"'
        else:
            rendered = repr(value)
        parts.append(f"{key}={rendered}")
    return " ".join(parts)


# --------------------------------------------------------------------------- stopping


def _proc_stat(pid: int) -> tuple[int, str, int, int] | None:
    """(ppid, state, start time, process group) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19]), int(fields[2])


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux; elsewhere an empty list)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return []
    members = []
    for entry in proc_dir.iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[3] == pgid and stat[1] != "Z":
                members.append(int(entry.name))
    return members


def descendants(pid: int) -> list[tuple[int, int]]:
    """All live descendants of ``pid`` as (pid, start time), parents before children.

    Linux only (reads /proc); elsewhere returns an empty list.
    """
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return []
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[2]))
    found: list[tuple[int, int]] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child[0])
    return found


def _is_running(pid: int, start_time: int | None = None) -> bool:
    """True when ``pid`` is a live (non-zombie) process, and the same one if ``start_time`` is given."""
    stat = _proc_stat(pid)
    if stat is None:
        if Path("/proc").is_dir():
            return False
        try:  # no /proc: fall back to signal 0
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[1] != "Z" and (start_time is None or stat[2] == start_time)


def _signal(pid: int, sig: int, *, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop(proc: Proc, *, timeout: float = 10.0, grace: float = 5.0) -> int | None:
    """Stop ``proc`` and everything it started; return its exit code.

    SIGTERM to its process group, wait ``timeout`` seconds, then SIGKILL. Its descendants
    in other sessions (Flower's SuperExec, the ServerApp/ClientApp/simulation processes,
    Ray's workers) are recorded *before* signalling; they exit on their own once their
    parent is gone, and whatever is left after ``grace`` seconds gets SIGTERM, then SIGKILL.
    """
    if proc.popen.poll() is not None:
        # Already gone (and reaped, so its pid may be reused): only its group's leftovers.
        for pid in _group_members(proc.pid):
            _signal(pid, signal.SIGKILL)
        return proc.popen.returncode
    tree = descendants(proc.pid)
    _signal(proc.pid, signal.SIGTERM, group=True)
    try:
        proc.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal(proc.pid, signal.SIGKILL, group=True)
        proc.popen.wait(timeout=timeout)
    for pid in _group_members(proc.pid):  # stragglers in its group
        _signal(pid, signal.SIGKILL)
    _reap_tree(tree, grace)
    return proc.popen.returncode


def _reap_tree(tree: list[tuple[int, int]], grace: float) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_is_running(p, t) for p, t in tree):
        time.sleep(0.1)
    left = [(p, t) for p, t in tree if _is_running(p, t)]
    for pid, _ in left:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(_is_running(p, t) for p, t in left):
        time.sleep(0.1)
    for pid, start in left:
        if _is_running(pid, start):
            _signal(pid, signal.SIGKILL)


class FlowerProcesses:
    """Context manager that starts Flower processes and always stops them, newest first.

    >>> with FlowerProcesses(tmp_path) as fp:                    # doctest: +SKIP
    ...     link = fp.start_superlink(simulation=True)
    ...     home = write_flwr_home(tmp_path, "sim", link.address, options={"num-supernodes": 5})
    """

    def __init__(self, tmp_path: Path, *, flwr_home: Path | None = None) -> None:
        self.tmp_path = tmp_path
        self.flwr_home = flwr_home if flwr_home is not None else tmp_path / "flwr_home"
        self.procs: list[Proc] = []  # running, oldest first
        self.started: list[Proc] = []  # everything started, for log tails
        self.exit_codes: dict[str, int | None] = {}

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return flower_env(self.flwr_home, extra)

    def start_superlink(self, **kwargs: Any) -> Proc:
        kwargs.setdefault("flwr_home", self.flwr_home)
        proc = start_superlink(self.tmp_path, **kwargs)
        self.procs.append(proc)
        self.started.append(proc)
        return proc

    def start_supernode(self, **kwargs: Any) -> Proc:
        kwargs.setdefault("flwr_home", self.flwr_home)
        proc = start_supernode(self.tmp_path, **kwargs)
        self.procs.append(proc)
        self.started.append(proc)
        return proc

    def stop(self, proc: Proc) -> int | None:
        code = stop(proc)
        self.exit_codes[proc.name] = code
        if proc in self.procs:
            self.procs.remove(proc)
        return code

    def stop_all(self) -> None:
        while self.procs:
            self.stop(self.procs[-1])

    def tails(self, lines: int = 40) -> str:
        """The end of every started process's log, for an assertion message."""
        return "\n".join(f"----- {p.name} ({p.log_path}) -----\n{p.tail(lines)}" for p in self.started)

    def __enter__(self) -> FlowerProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@contextlib.contextmanager
def running(proc: Proc) -> Iterator[Proc]:
    """Yield ``proc`` and stop it on the way out, whatever happens."""
    try:
        yield proc
    finally:
        stop(proc)
