"""The gateway's state directory: the batch jobs' SQLite database, the local output
store, and the secret that signs the local store's links and names each API key's
files and batches (so that ownership survives a change in the order of `--api-key`s,
and the database holds no key).

Default: `$XDG_DATA_HOME/diffslot/gateway` (`~/.local/share/diffslot/gateway`);
`--state-dir` chooses another. Gateways that share one (Ray replicas on one node)
share the jobs: each runs lines of any of them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import secrets

SECRET_FILE = "gateway.secret"
DATABASE_FILE = "jobs.sqlite"


def default_state_dir(environ=os.environ) -> pathlib.Path:
    data_home = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return pathlib.Path(data_home) / "diffslot" / "gateway"


def secret_key(directory: pathlib.Path) -> bytes:
    """The state dir's own random key, made on first use (readable by its owner only).
    Several gateways starting at once on a fresh dir agree on one: the first link wins."""
    path = directory / SECRET_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fresh = directory / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fresh.write_text(secrets.token_hex(32))
    fresh.chmod(0o600)
    try:
        os.link(fresh, path)  # atomic, and fails if another gateway made it first
    except FileExistsError:
        pass
    finally:
        fresh.unlink()
    return bytes.fromhex(path.read_text().strip())


def owner_tag(key: bytes, api_key: str) -> str:
    """The name under which an API key's files and batches are kept."""
    return hmac.new(key, b"owner\n" + api_key.encode(), hashlib.sha256).hexdigest()[:32]


OPEN_OWNER = "open"  # a gateway without API keys: every caller sees every file and batch
