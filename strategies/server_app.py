"""fedrobust's own ServerApp: ``flwr run .`` and the deployment engine start here.

It is the first user of the library API: the run config (``[tool.flwr.app.config]`` plus
``--run-config`` overrides) becomes a :class:`~fedrobust.config.RunConfig`, then a
:class:`RobustStrategy` (:func:`strategy_from_config`), whose ``start()`` runs the rounds. Hydra
experiments build the same app with :func:`make_server_app` from their own config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from safetensors.torch import save as safetensors_bytes

from fedrobust import attacks, components, plot
from fedrobust.checkpoint import CheckpointMismatchError
from fedrobust.config import ConfigError, RunConfig, from_flat
from fedrobust.data import DataUnavailableError
from fedrobust.dir_lock import DirectoryInUseError
from fedrobust.run_setup import byzantine_partitions, config_problems, validate
from fedrobust.strategies.checkpointing import NoValidCheckpointError
from fedrobust.strategies.errors import CheckpointStorageError, Preempted, QuorumError
from fedrobust.strategies.evaluation import central_evaluate_fn, initial_arrays
from fedrobust.strategies.from_config import strategy_from_config
from fedrobust.strategies.reporting import say
from fedrobust.strategies.robust_strategy import RobustStrategy, UpdateHook

log = logging.getLogger(__name__)


# Errors whose message says in one line what went wrong and what to do (as experiments.run prints them):
# a refused config (checked_run_config logs it line by line), a resume refused, a checkpoint directory in
# use or not writable, data that cannot be read, nothing (more) trainable. Not AggregationError: its
# traceback shows where in the user's rule the error is.
ONE_LINE_ERRORS = (
    ConfigError, CheckpointMismatchError, NoValidCheckpointError, DirectoryInUseError, CheckpointStorageError,
    DataUnavailableError, QuorumError,
)
_SAID = "_fedrobust_said"  # set on such an error once its line is logged


class _SaidWithoutTraceback(logging.Filter):
    """On Flower's logger: Flower logs a ServerApp's exception with its traceback, some fifteen lines of
    Flower's own frames under the one line fedrobust already logged. For an error of
    :data:`ONE_LINE_ERRORS` that line is the message; Flower's record keeps its text, without the frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and getattr(error, _SAID, False):
            record.exc_info = record.exc_text = None
        return True


def _say_in_one_line(error: BaseException) -> None:
    if not isinstance(error, ConfigError):  # checked_run_config has logged its lines
        log.error("fedrobust: run failed: %s", " ".join(str(error).split()))
    setattr(error, _SAID, True)


def checked_run_config(run_config: Mapping[str, Any], *, local_devices: bool = False) -> RunConfig:
    """The :class:`RunConfig` of Flower's run config, with every problem logged on its own line.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config``: ``[tool.flwr.app.config]`` with the ``--run-config`` overrides.
    local_devices : bool
        The clients run on this machine (a simulation): a ``client.device`` it lacks (``cuda`` without
        a GPU) is refused here, rather than failing in every ClientApp of round 1.

    Returns
    -------
    RunConfig
        The checked config.

    Raises
    ------
    ConfigError
        After logging ``fedrobust: invalid configuration:`` and one line per problem, so that the run
        fails before its first round and ``flwr log`` shows why.
    """
    try:
        run_cfg = from_flat(run_config)
    except ConfigError as err:
        problems = err.problems
        if err.partial is not None:
            # The other settings' problems too, in the same pass; a problem that names a setting whose value
            # was refused is left out: it would be about the default put in its place.
            refused = {line.split("=", 1)[0] for line in problems}
            problems += [line for line in config_problems(err.partial) if not any(k in line for k in refused)]
    else:
        problems = config_problems(run_cfg, local_devices=local_devices)
        omniscient = run_cfg.attack.name in attacks.omniscient_names()
        if run_cfg.attack._target_ and not problems:  # a user attack says which kind it is once built
            built = components.build_attack(run_cfg)
            omniscient = built is not None and built.omniscient
        if omniscient:
            # They need every honest update of a round, which only the Hydra simulation's hook hands
            # them (experiments.adversary); here they would silently do nothing.
            key = "attack._target_" if run_cfg.attack._target_ else "attack.name"
            problems.append(
                f"{key}={run_cfg.attack.label}: omniscient attacks run only in Hydra simulation "
                f"(python -m experiments.run); under flwr run use a client-side attack "
                f"({', '.join(attacks.client_names())}, or one of your own with omniscient = False)"
            )
    if problems:
        _refuse(problems)
    return run_cfg


def _refuse(problems: list[str]) -> NoReturn:
    """Log ``fedrobust: invalid configuration:`` and one line per problem (``flwr log`` shows why), then raise."""
    log.error("fedrobust: invalid configuration:")
    for line in problems:
        log.error("  %s", line)
    raise ConfigError(problems)


def run_experiment(
    grid: Grid,
    cfg: RunConfig,
    out_dir: Path,
    *,
    update_hook: UpdateHook | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
    progress: bool = True,
    picture: bool = True,
) -> Result:
    """Train ``cfg`` on ``grid`` with its strategy; write metrics, the final model and the summary to ``out_dir``.

    ``on_strategy`` sees the strategy before it starts (e.g. to wire a stop request to it). With ``picture``,
    the rounds are drawn into ``rounds.png`` at the end (:mod:`fedrobust.plot`).
    """
    validate(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    attackers = sorted(byzantine_partitions(cfg))
    if attackers:  # so that the rounds' rejected, filtered and excluded nodes can be read against them
        say(f"attack {cfg.attack.label} played by partitions {', '.join(map(str, attackers))}", echo=progress)
    strategy = strategy_from_config(cfg, out_dir=out_dir, update_hook=update_hook, progress=progress)
    say_if_more_nodes_than_clients(grid, cfg, strategy)
    if on_strategy is not None:
        on_strategy(strategy)
    result = strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(cfg),
        num_rounds=cfg.num_rounds,
        timeout=cfg.fault.round_timeout,
        evaluate_fn=central_evaluate_fn(cfg),
    )
    say_if_at_chance(cfg, result)
    state = {k: v.contiguous() for k, v in result.arrays.to_torch_state_dict().items()}
    # Written whole, then renamed: a run is finished when the file exists (docs/flwr_run.md), so a crash
    # while writing must not leave a partial one. Mode as the other outputs (the umask's).
    final = out_dir / "final_model.safetensors"
    partial = final.with_name(final.name + ".partial")
    partial.write_bytes(safetensors_bytes(state))
    os.replace(partial, final)
    if picture:
        _draw_rounds(out_dir)
    return result


def check_resume(cfg: RunConfig) -> int | None:
    """The round a run of ``cfg`` would resume after (None: round 1), raising the checkpoint errors the run
    would raise once its nodes are up (:meth:`RobustStrategy.check_resume`)."""
    if not cfg.checkpoint.dir:
        return None
    strategy = strategy_from_config(cfg, progress=False)
    return strategy.check_resume(initial_arrays(cfg), cfg.num_rounds)


def say_if_more_nodes_than_clients(grid: Grid, cfg: RunConfig, strategy: RobustStrategy) -> None:
    """Warn when more nodes are connected at the start than ``num_clients``, e.g. a simulation whose
    num-supernodes was raised and not num_clients: each round samples the fraction clients_per_round /
    num_clients of the connected nodes (Flower's fraction_train), so every extra node trains too, and a
    simulation cuts the data by its num-supernodes, not by num_clients."""
    connected = len(list(grid.get_node_ids()))
    if connected <= cfg.num_clients:
        return
    sampled = min(connected, strategy.sample_size(connected) + strategy.over_select)  # as its rounds sample
    seed_keys = cfg.signing.require and not cfg.signing.trust_dir
    keys = (f"; signing.require without a trust_dir has keys for partitions 0-{cfg.num_clients - 1} only, so "
            "the other nodes' replies are refused (unknown_key)") if seed_keys else ""
    from flwr.superlink.grid import HttpGrid

    # A simulation's nodes each hold 1/num-supernodes of the data; a deployment's devices hold their own.
    shares = "" if isinstance(grid, HttpGrid) else f", and the simulation cuts the data into {connected} shares"
    log.warning(
        "%d nodes are connected, num_clients=%d: each round trains %d of them (clients_per_round / num_clients of "
        "the connected nodes), not clients_per_round=%d%s%s. Set num_clients=%d (and clients_per_round), or run "
        "%d nodes",
        connected, cfg.num_clients, sampled, cfg.clients_per_round, shares, keys, connected, cfg.num_clients,
    )


CHANCE_MARGIN = 0.05  # accuracy points above 1 / num_classes that still count as guessing


def say_if_at_chance(cfg: RunConfig, result: Result) -> None:
    """Warn when a run without an attack ends at chance accuracy: the model did not learn, which neither the
    divergence guard (a loss of ln(num_classes) is finite and steady) nor the rows say. A drill's attack may
    bring any model there, so runs with one are left to their rows."""
    evaluations = result.evaluate_metrics_serverapp
    if cfg.attack.active or cfg.num_rounds < 3 or not evaluations:
        return
    accuracy = evaluations[max(evaluations)].get("accuracy")
    num_classes = components.dataset_spec(cfg).num_classes
    if not isinstance(accuracy, int | float) or accuracy > 1 / num_classes + CHANCE_MARGIN:
        return
    c = cfg.client
    log.warning(
        "final accuracy %.4f is chance level for %d classes after %d rounds, with no attack: the model did not "
        "learn. Usual causes: training settings too strong or too weak for this model (client.lr=%g, "
        "client.momentum=%g, client.local_epochs=%d), or labels that do not match the inputs",
        accuracy, num_classes, max(evaluations), c.lr, c.momentum, c.local_epochs,
    )


def _draw_rounds(out_dir: Path) -> None:
    """``rounds.png`` beside ``metrics.jsonl``; one that cannot be drawn costs a warning, not the finished run."""
    try:
        plot.draw(out_dir / plot.METRICS_FILE)
    except Exception as problem:  # the model is written: whatever the picture's failure, only warn
        log.warning("no %s: %s", plot.PICTURE_FILE, problem, exc_info=not isinstance(problem, OSError | ValueError))


def seed_keys_on_a_deployment(grid: Grid, cfg: RunConfig) -> bool:
    """Whether ``cfg`` requires signatures without a trust store on Flower's Deployment Engine (its
    ``HttpGrid``), where the seed-derived keys of a simulation (``trust_store_for``) guard nothing."""
    from flwr.superlink.grid import HttpGrid

    return isinstance(grid, HttpGrid) and cfg.signing.require and not cfg.signing.trust_dir


def make_server_app(
    cfg: RunConfig | None = None,
    *,
    out_dir: Path | None = None,
    update_hook: UpdateHook | None = None,
    on_strategy: Callable[[RobustStrategy], None] | None = None,
) -> ServerApp:
    """A ServerApp running ``cfg`` (or, when None, the run config Flower passes in).

    A stop (SIGTERM, SIGINT, SIGQUIT, ``flwr stop``) makes the round loop checkpoint the last completed
    round and end: :meth:`RobustStrategy.start` takes Flower's signal handlers and exit path for the run
    (:mod:`fedrobust.strategies.stopping`), and gives them back after it. The app then ends with
    :class:`Preempted`, in one line and, for ``flwr-serverapp``, a graceful exit.
    """
    app = ServerApp()
    flower_log = logging.getLogger("flwr")
    if cfg is None and not any(isinstance(f, _SaidWithoutTraceback) for f in flower_log.filters):
        flower_log.addFilter(_SaidWithoutTraceback())

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run(grid, context)
        except ONE_LINE_ERRORS as error:
            if cfg is None:  # under flwr run; experiments.run prints its own line for these
                _say_in_one_line(error)
            raise  # the run ends failed, as Flower reports it (flwr ls: finished:failed)
        except Preempted as stop:
            setattr(stop, _SAID, True)  # the round loop has said how far the checkpoints got
            raise

    def run(grid: Grid, context: Context) -> None:
        from flwr.superlink.grid import HttpGrid

        # Flower's simulation runs the ClientApps on this machine; a deployment's run on devices of their own.
        simulated = not isinstance(grid, HttpGrid)
        run_cfg = cfg if cfg is not None else checked_run_config(context.run_config, local_devices=simulated)
        if seed_keys_on_a_deployment(grid, run_cfg):
            # The devices sign with keygen keys: every reply would be refused as unknown_key, round after round;
            # and keys derived from the run's seed, which anyone who knows the run config can derive, prove nothing.
            _refuse(["signing.require=true: on a deployment it needs signing.trust_dir, the trust store of python -m "
                     "fedrobust.keygen (docs/deployment.md, sections 2 and 7); without it replies would be checked "
                     "against keys derived from the run's seed, which anyone who knows the run config can derive"])
        target = out_dir if out_dir is not None else Path(run_cfg.output_dir or f"outputs/run-{grid.run.run_id}")
        run_experiment(grid, run_cfg, target, update_hook=update_hook, on_strategy=on_strategy)

    return app


app = make_server_app()
