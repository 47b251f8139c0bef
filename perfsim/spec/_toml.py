"""Reading TOML input files (profiles, model files): one error message per way a file can fail to
open or parse.

tomllib on Python >= 3.11, the tomli backport before that."""

from perfsim.errors import PerfsimError
from perfsim.files import open_input, read_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["tomllib", "open_input", "read_toml"]


def read_toml(path: str, what: str) -> dict:
    """The parsed TOML file, or a one-line PerfsimError that says what is wrong (perfsim.files
    checks the file: a regular file of at most 8 MiB of UTF-8 text)."""
    text = read_text(path, what, ".toml file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PerfsimError(f"{what} {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise PerfsimError(f"{what} {path} is not valid TOML: arrays or tables nested too deeply") from None
    except ValueError:  # int's string-conversion limit
        raise PerfsimError(f"{what} {path} holds an integer of thousands of digits; no number perfsim reads is "
                           f"that large") from None
