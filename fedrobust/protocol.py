"""Names of the records and fields exchanged between server and clients.

Both sides of the wire (strategies/ and clients/) use these, so that neither
imports the other.
"""

# Message record keys.
ARRAYS = "arrays"  # server -> client: the global model; client -> server (Flower's convention): local weights
UPDATE = "update"  # client -> server: local model minus global model
CONFIG = "config"  # server -> client: server-round, nonce, local training settings
METRICS = "metrics"  # client -> server: num-examples and training metrics
SIGNATURE = "signature"  # client -> server: key id and Ed25519 signature
INFO = "info"  # client -> server: answer to the hello query

# Fields.
SERVER_ROUND = "server-round"  # as Flower's strategies name it
NONCE = "nonce"
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"  # as Flower's simulation names it in the node config
# server -> client, next to the nonce, only where the strategy names them otherwise than the defaults
# (weighted_by_key, arrayrecord_key): the record names a signing client mod signs.
NUM_EXAMPLES_KEY = "num-examples-key"
ARRAYS_KEY = "arrays-key"
KEY_ID = "key-id"
SIG = "sig"
# Set by a simulated Byzantine client so that the simulation-only adversary hook can
# find the rows it controls; the production strategy never reads it.
SIM_BYZANTINE = "sim-byzantine"


def record_int(value: object, field: str) -> int:
    """``int(value)`` of a scalar record value (e.g. the server round); TypeError naming ``field`` otherwise."""
    if isinstance(value, int | float | str | bytes):
        return int(value)
    raise TypeError(f"record field {field!r} must be a number, got {type(value).__name__}")
