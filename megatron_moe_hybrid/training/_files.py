"""Files that appear whole: written under a temporary name beside their place, then renamed.

tempfile.mkstemp makes its file readable by its owner only; published files get the mode a
plain open() would give them (0666 less the umask), so a cache or dataset directory shared by
several users or the ranks of another account stays readable.
"""

import os
import tempfile
from pathlib import Path


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
