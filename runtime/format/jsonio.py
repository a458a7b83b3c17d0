"""Plain JSON files for graphs and plans: canonical hashing, atomic writes, reads with clear errors.

Torch-free. Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def canonical(obj: Any) -> str:
    """The canonical JSON text of `obj`: sorted keys, no whitespace (the input of every hash)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256_hex(obj: Any) -> str:
    """SHA-256 hex digest of `canonical(obj)`."""
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


READABLE = 0o666 & ~_umask()
"""Mode of the files memplan shares (plans, index rows): what the umask allows, not mkstemp's 0600."""


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path` via a temporary file in the same folder and `os.replace`.

    The temporary name starts with a dot and ends in `.tmp`, so globs over `*.json` never see it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, READABLE)                  # mkstemp makes 0600; plans are shared files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class _NonFinite(ValueError):
    """A NaN or infinity in a JSON text (Python's json parses them; canonical JSON has none)."""


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)


def read_json(path: str | os.PathLike, what: str, error: type[Exception]) -> Any:
    """Parse the JSON file `path`; raise `error` naming the file and the fault when it is missing,
    unreadable, truncated or malformed. `what` names the expected content ("plan", "graph")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc.strerror or exc}. Check the path.") from exc
    except UnicodeDecodeError as exc:
        raise error(f"{what} file {path} is not text (byte {exc.object[exc.start]:#04x} at offset {exc.start} is "
                    f"not UTF-8): it is binary or corrupt. Give the {what} JSON that memplan wrote.") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except _NonFinite as exc:
        raise error(f"{what} file {path} holds {exc.args[0]}, which JSON does not allow and memplan never writes; "
                    f"it was hand-edited or written by another tool. Regenerate it with memplan.") from None
    except RecursionError:
        raise error(f"{what} file {path} nests JSON too deeply to be a memplan {what}.") from None
    except json.JSONDecodeError as exc:
        raise error(
            f"{what} file {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            f"it may be truncated or hand-edited. Regenerate it with memplan."
        ) from exc
