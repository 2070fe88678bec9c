"""Signatures for the one pickled part of a checkpoint: the sync vector envs' snapshot (exact resume).

Unpickling runs code, so a snapshot is unpickled only when it carries an HMAC-SHA256 made with this
installation's key, which a checkpoint from anywhere else (another machine, a download, a crafted file)
cannot have. The key (32 random bytes, hex) lives in `$PPO_FABRIC_KEY_FILE`, else in
`$XDG_CONFIG_HOME/ppo-fabric/key` (default `~/.config/ppo-fabric/key`), and is created on first use. A run
over several nodes needs the same key file on every node (copy it, or point PPO_FABRIC_KEY_FILE at a
shared one); otherwise it resumes with `resume_env=fresh`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

KEY_FILE_ENV = "PPO_FABRIC_KEY_FILE"
_KEY_BYTES = 32
_WRITE_WAIT_S = 5.0  # how long a reader waits for the creator of a new key file to finish writing it
_DOMAIN = b"ppo-fabric env snapshot\0"  # so a signature is valid for nothing but a snapshot


def key_path() -> Path:
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "ppo-fabric" / "key"


def key() -> bytes:
    """This installation's key, created on first use (mode 0600). O_EXCL lets exactly one of several
    processes starting together (the ranks of a run) create it; the others read the winner's file."""
    path = key_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return _read_key(path)
    text = secrets.token_hex(_KEY_BYTES)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return bytes.fromhex(text)


def _read_key(path: Path) -> bytes:
    """Read an existing key, waiting briefly while it is shorter than a key (created, not yet written)."""
    deadline = time.monotonic() + _WRITE_WAIT_S
    try:
        text = path.read_bytes().decode("ascii").strip()
        while len(text) < 2 * _KEY_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
            text = path.read_bytes().decode("ascii").strip()
        if len(text) != 2 * _KEY_BYTES:
            raise ValueError(len(text))
        return bytes.fromhex(text)
    except OSError as exc:
        raise ValueError(
            f"the key file {path} cannot be read ({exc.strerror or exc}); see {KEY_FILE_ENV}"
        ) from None
    except ValueError:  # UnicodeDecodeError too: random bytes, not hex text
        raise ValueError(
            f"{path} is not a ppo-fabric key ({2 * _KEY_BYTES} hex digits); delete it and a new one is made "
            "(snapshots signed with the old key then resume only with resume_env=fresh)"
        ) from None


def check_key() -> None:
    """Raise ValueError (one line) when the key file exists but holds no key: found before a run, it ended
    the run at its first checkpoint with a traceback and no checkpoint written. A missing file is fine (the
    first checkpoint creates it)."""
    path = key_path()
    if path.exists():
        _read_key(path)


def sign(data: bytes) -> str:
    """The hex HMAC-SHA256 of `data` under this installation's key."""
    return hmac.new(key(), _DOMAIN + data, hashlib.sha256).hexdigest()


def verify(data: bytes, signature: object) -> bool:
    """Whether `signature` is this installation's signature of `data` (constant-time comparison)."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign(data).encode(), signature.encode())
