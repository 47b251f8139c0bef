"""A tiny TOML writer for system profiles, so tests can make broken variants of a real profile."""

from __future__ import annotations

import copy
import json
import math
import os

from perfsim.spec._toml import tomllib

HWPROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hwprofiles")


def load_raw(name: str) -> dict:
    with open(os.path.join(HWPROFILES, name + ".toml"), "rb") as fh:
        return tomllib.load(fh)


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r}")


def dumps(data: dict) -> str:
    lines = []
    tables = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_scalar(value)}")
    for section, body in tables:
        lines.append(f"\n[{section}]")
        subtables = []
        for key, value in body.items():
            if isinstance(value, dict):
                subtables.append((key, value))
            else:
                lines.append(f"{key} = {_scalar(value)}")
        for key, value in subtables:
            lines.append(f"\n[{section}.{key}]")
            lines.extend(f"{k} = {_scalar(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def write_variant(tmp_path, name: str = "smng-p2", edit=None, filename: str = "profile.toml") -> str:
    """Write hwprofiles/<name>.toml, after `edit(data)` changes it, to tmp_path; return the path."""
    data = copy.deepcopy(load_raw(name))
    if edit is not None:
        edit(data)
    path = tmp_path / filename
    path.write_text(dumps(data))
    return str(path)
