"""Why a run stopped before its last round, and the exit code that says "run me again"."""

from __future__ import annotations

from flwr.app.exception import AppExitException
from flwr.serverapp.strategy import Result
from flwr.supercore.exit import ExitCode

# Exit code of a process stopped by SIGTERM/SIGINT after writing its checkpoint (EX_TEMPFAIL):
# run the same command again to continue.
EXIT_PREEMPTED = 75


class QuorumError(RuntimeError):
    """A round could not gather enough valid replies within its retries (or the model kept diverging).

    ``result``, set by ``RobustStrategy.start()``, is Flower's Result up to the last completed round: its
    ``arrays`` are that round's model (the initial arrays when none completed), its metrics those rounds'.
    Where FedAvg would go on with the next round, a caller that wants the model so far takes it from here.
    """

    result: Result | None = None


class ClientFailureError(QuorumError):
    """Every reply of a round failed on the clients, all with the same error: retrying cannot help."""


class NoNodesError(QuorumError):
    """Not enough nodes connected within the wait: nothing could be trained."""


class NodesBusyError(NoNodesError):
    """Enough nodes connected, too few answered the partition query within the wait: they may only be slow
    (a loaded machine, a node working through a killed run's messages), so the same command may work later."""


class AggregationError(RuntimeError):
    """The aggregation rule raised on a round's valid replies (a rule's bug, e.g. a user rule's): the
    message names the rule, the round and the error; the cause is the rule's own exception."""


class CheckpointStorageError(ValueError):
    """The checkpoint directory or mirror cannot be used (not writable, no credentials, ...): nothing was
    trained; the message names the location and the storage's own reason."""


class Preempted(RuntimeError, AppExitException):
    """The run was asked to stop (SIGTERM/SIGINT).

    ``checkpointed`` tells whether a checkpoint of the last completed round exists, i.e. whether
    running the same command again continues instead of starting over.

    A Flower ``AppExitException`` with a graceful exit code: a ServerApp that lets it through ends
    ``flwr-serverapp`` as Flower's own signal handling does (exit status 0), not as a failure (1).
    """

    exit_code = ExitCode.GRACEFUL_EXIT_SIGTERM
    #: As :attr:`QuorumError.result`: Flower's Result up to the last completed round, set by ``start()``.
    result: Result | None = None

    def __init__(self, message: str, *, checkpointed: bool = False) -> None:
        super().__init__(message)
        self.checkpointed = checkpointed
