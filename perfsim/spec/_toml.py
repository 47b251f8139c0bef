"""Reading the project's input files: one error message per way a file can fail to open or parse.

tomllib on Python >= 3.11, the tomli backport before that."""

from perfsim.errors import PerfsimError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["tomllib", "open_input", "read_toml"]


def open_input(path: str, what: str, expect: str = "file"):
    """The file opened for reading in binary, or a PerfsimError naming `what` and why."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise PerfsimError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise PerfsimError(f"{what} {path} is a directory; give the {expect}") from None
    except OSError as exc:
        raise PerfsimError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None


def read_toml(path: str, what: str) -> dict:
    """The parsed TOML file, or a one-line PerfsimError that says what is wrong."""
    with open_input(path, what, ".toml file") as fh:
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise PerfsimError(f"{what} {path} is not valid TOML: {exc}") from None
