"""The `perfsim` command line (README.md, "Use"): the commands by name, and one-line errors.

Each command is a module of perfsim/commands/ with `register(subparsers)`; its flags come from
perfsim/commands/flags.py and its case from perfsim/spec/case.py. A command named on the command
line is the only one imported and built (what `perfsim predict` loads is what it needs); with no
command, or an unknown one, every command is, so that help and errors list them all.
"""

from __future__ import annotations

import importlib
import sys

from perfsim.commands.flags import Parser
from perfsim.errors import PerfsimError, one_line

# command name -> module under perfsim/commands/, in the order `perfsim --help` lists them
COMMANDS = {name: f"perfsim.commands.{name}" for name in (
    "predict", "profiles", "calibrate", "chart", "report", "scale", "search", "sensitivity", "simulate", "validate")}


def make_parser(argv=None) -> Parser:
    """The parser of every command, or of the one `argv` names (its first word)."""
    parser = Parser(prog="perfsim", description="Predict and explain LLM training performance on HPC systems.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for name in [named] if named else COMMANDS:
        importlib.import_module(COMMANDS[name]).register(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = make_parser(argv).parse_args(argv)
        args.run(args)
    except PerfsimError as exc:  # one line, whatever a quoted path or value holds
        message = one_line(exc)
        if len(message) > 2000:  # a value quoted whole (a megabyte-long flag, a table)
            message = message[:2000] + "... (cut)"
        print(f"perfsim: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
