"""Files perfsim reads and writes, checked where they enter and leave.

Reading: only a regular file is opened (a FIFO would block, a device node such as /dev/zero never
ends), it may not exceed what a file of its kind plausibly holds, and text must be UTF-8 without
NUL bytes. Writing: only a regular file, or a new one in an existing folder; a file perfsim did not
create keeps its permissions. Every problem is a one-line PerfsimError naming the file.
"""

from __future__ import annotations

import os
import stat

from perfsim.errors import PerfsimError

MIB = 2**20
# The largest file of each kind perfsim reads: far above any real one (a profile is ~20 KB, the
# committed calibration ledger 2.7 MB for 2,276 measurements, a long Megatron log ~100 MB).
MAX_TOML_BYTES = 8 * MIB
MAX_LEDGER_BYTES = 1024 * MIB
MAX_LOG_BYTES = 1024 * MIB

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    return f"{n / MIB:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def _os_problem(exc: OSError) -> str:
    return exc.strerror or str(exc)


def open_input(path: str, what: str, expect: str = "file", limit: int = MAX_TOML_BYTES):
    """`path` opened for reading in binary, or a PerfsimError naming `what` and why: missing, a
    directory, not a regular file, larger than `limit` bytes, unreadable."""
    if not path:
        raise PerfsimError(f"{what}: the path is empty; give the {expect}")
    try:
        # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except ValueError:
        raise PerfsimError(f"{what} {path!r} is not a valid path (it holds a NUL character)") from None
    except FileNotFoundError:
        raise PerfsimError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise PerfsimError(f"{what} {path} is a directory; give the {expect}") from None
    except OSError as exc:
        raise PerfsimError(f"{what} {path} cannot be read: {_os_problem(exc)}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise PerfsimError(f"{what} {path} is a directory; give the {expect}")
        if not stat.S_ISREG(info.st_mode):
            raise PerfsimError(f"{what} {path} is {_kind(info.st_mode)}, not a regular file; give the {expect}")
        if info.st_size > limit:
            raise PerfsimError(f"{what} {path} is {_size(info.st_size)}, more than any {expect} perfsim reads "
                               f"(at most {_size(limit)}); is it the right file?")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def decode_text(data: bytes, where: str, first_line: int = 1) -> str:
    """UTF-8 text of `data` (a leading byte-order mark dropped), or a PerfsimError that says where
    it is binary or not UTF-8. `first_line` numbers the first line of `data` in its file."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise PerfsimError(f"{where} is UTF-16 text; save it as UTF-8")
    nul = data.find(b"\0")
    if nul >= 0:
        line = first_line + data.count(b"\n", 0, nul)
        raise PerfsimError(f"{where} is binary, not text (a NUL byte on line {line})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        raise PerfsimError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); "
                           f"save it as UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def read_text(path: str, what: str, expect: str = "file", limit: int = MAX_TOML_BYTES) -> str:
    """The whole of a text file, checked as open_input and decode_text check it."""
    with open_input(path, what, expect, limit) as fh:
        data = fh.read(limit + 1)
    return decode_text(data, f"{what} {path}")


def check_output(path: str, flag: str, example: str = "out.txt") -> bool:
    """Fail before any work when `path` cannot take a file written by perfsim: an empty path, a
    directory, something other than a regular file (a device node, a FIFO), or a folder that does
    not exist. Returns whether the file exists already."""
    if not path:
        raise PerfsimError(f"{flag}: the path is empty; give a file name such as {example}")
    try:
        info = os.stat(path)
    except ValueError:
        raise PerfsimError(f"{flag} {path!r} is not a valid path (it holds a NUL character)") from None
    except FileNotFoundError:
        info = None  # a new file (or a dangling link, which writing creates)
    except OSError as exc:
        raise PerfsimError(f"{flag} {path} cannot be written: {_os_problem(exc)}") from None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise PerfsimError(f"{flag} {path} is a directory; give a file name such as {os.path.join(path, example)}")
        if not stat.S_ISREG(info.st_mode):
            raise PerfsimError(f"{flag} {path} is {_kind(info.st_mode)}; perfsim writes only regular files, "
                               f"give a file name such as {example}")
        return True
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PerfsimError(f"{flag} {path}: folder {folder} does not exist; create it or choose another path")
    return False


def write_output(path: str, flag: str, text: str, executable: bool = False, example: str = "out.txt") -> None:
    """Write `text` to `path` (checked as check_output checks it). A new file is created with the
    usual permissions (executable ones if `executable`), under the umask; an existing file keeps
    its own."""
    check_output(path, flag, example)
    # O_NONBLOCK: a FIFO put there since the check fails to open rather than waiting for a reader
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o777 if executable else 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the check
                raise PerfsimError(f"{flag} {path} is not a regular file; perfsim writes only regular files")
            os.set_blocking(fd, True)
            fh.write(text)
    except OSError as exc:
        raise PerfsimError(f"{flag} {path} cannot be written: {_os_problem(exc)}") from None
