"""The one door from perfsim to the validate/ harness: real training steps and microbenchmarks
run on this machine (README.md, "Documents": docs/real-steps.md, docs/calibration.md).

validate/ builds on perfsim (it imports the model, the plans and the cost model); perfsim's model
never imports validate. The two commands that drive real runs, `perfsim calibrate` and `perfsim
validate` (perfsim/commands/), reach the harness only through `harness(name)`, when a run needs it,
so the edge between the packages points one way everywhere else and perfsim works where validate/
(and torch) are not installed. tests/test_import_graph.py keeps every other perfsim module from
naming validate.
"""

from __future__ import annotations

import importlib

from perfsim.errors import PerfsimError

INSTALL = "pip install torch==2.13.0 -e \".[validate]\""


def harness(name: str):
    """The module validate.`name` (campaign, device, launcher, ledger, ranks, slurm, timing, ...);
    a one-line error when the harness is not installed with this perfsim."""
    try:
        return importlib.import_module(f"validate.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("validate", f"validate.{name}"):
            raise  # a module the harness needs (torch): its own error
        raise PerfsimError(f"the validate/ harness is not installed with this perfsim; install from the repository "
                           f"with `{INSTALL}`") from None
