"""The scrambled Sobol designs behind every draw are remembered in $PERFSIM_CACHE_DIR (issue 16
item 7: importing scipy.stats took 1.9 s of `predict --uncertainty`'s 2.5): a second process draws
the same numbers without importing scipy.stats, and an unreadable cache is recomputed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys
from perfsim.spec.system import load_system
from perfsim.uncertainty.sampling import draw
d = draw(load_system("dgx-a100"), 96, seed=5, comm_points=12)
print(json.dumps({"stats": "scipy.stats" in sys.modules, "values": d.values.tolist()}))
"""


def _draw(cache) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], check=True, capture_output=True, text=True,
                         env=os.environ | {"PERFSIM_CACHE_DIR": str(cache)})
    return json.loads(out.stdout)


def test_a_warm_draw_reads_the_design_and_never_imports_scipy_stats(tmp_path):
    cold, warm = _draw(tmp_path), _draw(tmp_path)
    assert cold["stats"] and not warm["stats"]
    assert warm["values"] == cold["values"]
    designs = sorted(p.name for p in tmp_path.iterdir())
    assert len(designs) == 2 and all(name.startswith("sobol-") for name in designs)
    for p in tmp_path.iterdir():  # a damaged cache is recomputed, not an error
        p.write_bytes(b"not an array")
    again = _draw(tmp_path)
    assert again["stats"] and again["values"] == cold["values"]
