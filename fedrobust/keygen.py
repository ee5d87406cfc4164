"""Generate Ed25519 update-signing keys for N clients and the server's trust store.

Usage::

    python -m fedrobust.keygen --out keys --clients 4 [--force]
    python -m fedrobust.keygen --out keys --clients 6 --add     # keys for clients 4 and 5; 0-3 kept
    python -m fedrobust.keygen --out keys --replace 3          # a new key for client 3 (its old one leaked)

writes, under ``--out``:

- ``client-<i>.key``: client ``i``'s private key (PKCS8 PEM, mode 0600); copy it to that client only.
- ``client-<i>.pub``: its public key (SubjectPublicKeyInfo PEM).
- ``trust/``: the server's trust store, the public keys plus ``trust.json`` binding partition id
  ``i`` to its key id and file; point the server at it (``signing.trust_dir``).

Every key is pinned to the node of its first verified reply (see `fedrobust.signing.TrustStore`).
No private key material is printed.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedrobust.signing import TRUST_FILE, TrustStore, generate_keypair, key_id, write_private_key, write_public_key

TRUST_DIR = "trust"
#: More clients than this is almost certainly a typo (and thousands of files).
MAX_CLIENTS = 100_000


def _client_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 1 <= count <= MAX_CLIENTS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_CLIENTS}, got {count}")
    return count


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m fedrobust.keygen",
        description="Generate Ed25519 update-signing keys for N clients and the server trust store.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    parser.add_argument("--clients", type=_client_count, help="number of clients N (partition ids 0..N-1)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--force", action="store_true", help="overwrite existing key files: every client a new key "
                                                          "(and the key files of clients >= --clients removed)")
    how.add_argument(
        "--add", action="store_true",
        help="keep the existing keys and trust store; make keys for the clients 0..N-1 that have none",
    )
    how.add_argument(
        "--replace", type=int, nargs="+", metavar="ID",
        help="a new key for each of these clients; the trust store stops trusting their old keys",
    )
    return parser


def planned_paths(out: Path, clients: int) -> list[Path]:
    """Return every file `generate` writes for `clients` clients under `out`."""
    paths = []
    for index in range(clients):
        paths += [out / f"client-{index}.key", out / f"client-{index}.pub", out / TRUST_DIR / f"client-{index}.pub"]
    return [*paths, out / TRUST_DIR / TRUST_FILE]


def generate(out: Path, clients: int, *, force: bool = False) -> list[str]:
    """Write the key pairs and trust store; return one line per thing written.

    Parameters
    ----------
    out : Path
        Output directory (created if missing).
    clients : int
        Number of clients; partition ids are ``0 .. clients - 1``.
    force : bool
        Overwrite existing files, and remove the key files of clients ``clients`` and up (an earlier, larger set,
        which the new trust store does not trust).

    Raises
    ------
    FileExistsError
        Without `force`, when any output file exists; checked before anything is written, so a
        refused run leaves no partial set behind.
    """
    if not force:
        existing = [path for path in planned_paths(out, clients) if path.exists()]
        if existing:
            raise FileExistsError(
                f"{len(existing)} output file(s) exist, e.g. {existing[0]}; pass --force to overwrite"
            )
    out.mkdir(parents=True, exist_ok=True)
    store = TrustStore()
    lines = []
    for index in range(clients):
        line, public_key = _write_pair(out, index, overwrite=force)
        store.add(public_key, partition_id=index)
        lines.append(line)
    binding = store.save(out / TRUST_DIR, overwrite=force)
    lines.append(f"trust store: {binding.parent}/ ({clients} public keys + {binding.name})")
    if force:
        lines += _remove_untrusted(out, clients)
    return lines


def _remove_untrusted(out: Path, clients: int) -> list[str]:
    """Remove the key files of clients ``clients`` and up, from an earlier, larger set that ``--force`` replaced:
    the new trust store does not trust them, and a device given one would have every reply refused."""
    pattern = re.compile(r"client-(0|[1-9]\d*)\.(key|pub)")  # the names generate() writes, and no others
    gone: dict[int, list[Path]] = {}
    for path in [*out.glob("client-*"), *(out / TRUST_DIR).glob("client-*")]:
        match = pattern.fullmatch(path.name)
        if match and int(match.group(1)) >= clients and path.is_file():
            gone.setdefault(int(match.group(1)), []).append(path)
    for paths in gone.values():
        for path in paths:
            path.unlink()
    if not gone:
        return []
    ids = sorted(gone)
    return [f"removed the keys of client(s) {', '.join(map(str, ids))} of the earlier set: the new trust store does "
            "not trust them"]


def _write_pair(out: Path, index: int, *, overwrite: bool) -> tuple[str, Ed25519PublicKey]:
    """A new key pair for client ``index`` under ``out``: its line of output and its public key."""
    private_key, public_key = generate_keypair()
    private_path = write_private_key(out / f"client-{index}.key", private_key, overwrite=overwrite)
    public_path = write_public_key(out / f"client-{index}.pub", public_key, overwrite=overwrite)
    line = f"client {index}: {private_path} (private, mode 0600), {public_path}  key id {key_id(public_key)}"
    return line, public_key


def add(out: Path, clients: int) -> list[str]:
    """Keys for the clients ``0 .. clients - 1`` that have none in ``out`` (a device added); the existing
    keys and their trust-store entries are kept, and the trust store is written again with the new ones.

    Raises
    ------
    ValueError
        ``out`` holds no trust store (make one without ``--add``), or one to which a client's key file is
        unknown (the folder and its trust store do not belong together).
    """
    store = _existing_store(out)
    trusted = store.partitions()
    lines = []
    for index in range(clients):
        if (out / f"client-{index}.key").exists():
            if index not in trusted:
                raise ValueError(
                    f"{out / f'client-{index}.key'} exists, but {out / TRUST_DIR} has no key of client {index}"
                )
            continue
        if index in trusted:
            raise ValueError(f"{out / TRUST_DIR} trusts a key of client {index}, but {out} has no client-{index}.key")
        line, public_key = _write_pair(out, index, overwrite=False)
        store.add(public_key, partition_id=index)
        lines.append(line)
    if not lines:
        return [f"every client 0..{clients - 1} has a key already: nothing written"]
    binding = store.save(out / TRUST_DIR, overwrite=True)
    lines.append(f"trust store: {binding.parent}/ ({len(store)} public keys + {binding.name})")
    return lines


def _existing_store(out: Path) -> TrustStore:
    """The trust store ``out`` holds; ValueError saying how to make one where it holds none."""
    if not (out / TRUST_DIR).is_dir():
        raise ValueError(f"{out} holds no trust store ({out / TRUST_DIR}): make the keys first, without --add or "
                         f"--replace (python -m fedrobust.keygen --out {out} --clients N)")
    return TrustStore.load(out / TRUST_DIR)


def replace(out: Path, indices: Sequence[int]) -> list[str]:
    """A new key pair for each client of ``indices``; the trust store then trusts the new keys only.

    Raises
    ------
    ValueError
        ``out`` holds no trust store, or it trusts no key of one of the clients.
    """
    store = _existing_store(out)
    negative = sorted(i for i in set(indices) if i < 0)
    if negative:
        raise ValueError(f"--replace takes client ids >= 0, got {negative}")
    unknown = sorted(set(indices) - store.partitions())
    if unknown:
        raise ValueError(f"{out / TRUST_DIR} trusts no key of client(s) {unknown}: add them with --clients N --add")
    lines = []
    for index in sorted(set(indices)):
        old = store.remove_partition(index)
        line, public_key = _write_pair(out, index, overwrite=True)
        store.add(public_key, partition_id=index)
        lines.append(f"{line} (replaces key id {', '.join(old)})")
    binding = store.save(out / TRUST_DIR, overwrite=True)
    lines.append(f"trust store: {binding.parent}/ ({len(store)} public keys + {binding.name})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if args.clients is not None and args.replace is not None:
        parser.error("--clients and --replace cannot be combined: --replace ID [ID ...] writes new keys for the "
                     "devices named; --clients N (with --add to keep the existing keys) writes keys for N devices")
    if args.clients is None and args.replace is None:
        parser.error("give --clients N (with --add to keep the existing keys), or --replace ID [ID ...]")
    try:
        if args.replace is not None:
            lines = replace(args.out, args.replace)
        elif args.add:
            lines = add(args.out, args.clients)
        else:
            lines = generate(args.out, args.clients, force=args.force)
    except FileExistsError as err:
        print(f"error: {err}; or --add to keep the existing keys and add the missing ones", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"error: cannot write keys under {args.out}: {err}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
