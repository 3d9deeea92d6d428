"""Files that appear whole: written under a temporary name beside their place, then renamed.

tempfile.mkstemp makes its file readable by its owner only; published files get the mode a
plain open() would give them (0666 less the umask), so a cache or dataset directory shared by
several users or the ranks of another account stays readable.
"""

import io
import os
import tempfile
from pathlib import Path
from typing import Callable


def temp_beside(path: str | os.PathLike, suffix: str = ".tmp") -> tuple[int, str]:
    """(fd, name) of a new temporary file in path's directory, hidden, named after path."""
    path = Path(path)
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)


def publish(tmp: str, path: str | os.PathLike) -> None:
    """Gives tmp (written and synced) the mode open() would have and renames it to path."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> None:
    """path written by write(f) into a temporary file beside it, synced and renamed: readers see
    either no file or the whole file, never a partial one; nothing is left on an error."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
