"""Opening a file a user names (a config, a dataset): a regular file only, and bounded.

The path comes from a config or the command line, and a config is often someone else's file.
Reading it must not hang (``open`` on a FIFO blocks until a writer comes), must not read without
end (``/dev/zero``, a file in ``/proc`` that reports size 0) and must not allocate more than the
caller's documented cap (a 1 GiB sparse file is 1 GiB of reads). So:

- the path is stat'ed before it is opened, and anything but a regular file is refused without
  opening it (opening some devices has effects of its own);
- it is then opened with ``O_NONBLOCK`` (a FIFO swapped in after the stat cannot block the open)
  and checked again on the open descriptor, so what is read is what was checked;
- its size is checked against the cap before a byte is read, and at most cap + 1 bytes are
  ever read (``/proc`` files and files that grow report a size that is not what they yield).

Every refusal is an ``InputFileError`` (a ``ValueError``) whose ``reason`` is one line without
the path; callers put the path and the config key in front.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class InputFileError(ValueError):
    """A user-named file that is not a regular file, is too big, or cannot be read."""

    def __init__(self, path: str | os.PathLike, reason: str, *, size: int | None = None,
                 strerror: str | None = None):
        self.path = os.fspath(path)
        self.reason = reason  # "is a FIFO (named pipe), not a regular file", "cannot read: ..."
        self.size = size  # set when the file is over the cap: its size in bytes
        self.strerror = strerror  # set when the OS refused: "No such file or directory"
        super().__init__(f"{self.path!r} {reason}")


def _os_error(path: str, exc: OSError) -> InputFileError:
    why = exc.strerror or str(exc)
    return InputFileError(path, f"cannot be read: {why}", strerror=why)


def _check(st: os.stat_result, path: str, max_bytes: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a plain file")
        raise InputFileError(path, f"is {kind}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise InputFileError(path, f"is {st.st_size} bytes; the limit is {max_bytes}", size=st.st_size)


def open_regular(path: str | os.PathLike, *, max_bytes: int | None) -> BinaryIO:
    """Open `path` for binary reading if it is a regular file of at most `max_bytes` (None: any
    size; the caller then bounds what it reads itself, e.g. a prefix of a text)."""
    name = os.fspath(path)
    try:
        _check(os.stat(name), name, max_bytes)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise _os_error(name, exc) from None
    try:
        _check(os.fstat(fd), name, max_bytes)  # the path may have been swapped since the stat
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, *, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes`; never reads more than max_bytes + 1."""
    with open_regular(path, max_bytes=max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise _os_error(os.fspath(path), exc) from None
    if len(data) > max_bytes:  # it grew after the stat, or reports a size that is not its length
        raise InputFileError(path, f"holds more than {max_bytes} bytes; the limit is {max_bytes}", size=len(data))
    return data
