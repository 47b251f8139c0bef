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
    """TOML text of `data`: plain keys first, then each table under its dotted name, to any depth
    (a number's `causes` sit three tables down)."""
    lines = [f"{key} = {_scalar(value)}" for key, value in data.items() if not isinstance(value, dict)]

    def table(name: str, body: dict) -> None:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {_scalar(v)}" for k, v in body.items() if not isinstance(v, dict))
        for key, value in body.items():
            if isinstance(value, dict):
                table(f"{name}.{key}", value)

    for key, value in data.items():
        if isinstance(value, dict):
            table(key, value)
    return "\n".join(lines) + "\n"


def write_variant(tmp_path, name: str = "smng-p2", edit=None, filename: str = "profile.toml") -> str:
    """Write hwprofiles/<name>.toml, after `edit(data)` changes it, to tmp_path; return the path."""
    data = copy.deepcopy(load_raw(name))
    if edit is not None:
        edit(data)
    path = tmp_path / filename
    path.write_text(dumps(data))
    return str(path)


def profile_with(tmp_path, extra: str, name: str = "cpu-example") -> str:
    """Path of profile `name`'s TOML text with `extra` appended (optional per-operation or
    per-kind tables are sub-tables, so they may come last)."""
    with open(os.path.join(HWPROFILES, f"{name}.toml"), encoding="utf-8") as fh:
        text = fh.read()
    path = tmp_path / "with-tables.toml"
    path.write_text(text + "\n" + extra)
    return str(path)


def assert_one_line_error(capsys, path: str, words) -> None:
    """`perfsim predict --system path` fails with exit status 2 and one line naming the file and
    every one of `words`."""
    from perfsim import cli

    assert cli.main(["predict", "--system", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("perfsim: error:") and path in err
    for word in words:
        assert word in err, err


# The named at-scale terms of the GPU profiles (docs/equations.md 6.5, 8.4-8.6), by section: the SMs
# overlapped communication holds, the SM-bound kernels' rate in a multi-GPU job, dropout inside the
# fused attention kernel, Megatron-Core's gradient-buffer passes.
AT_SCALE_KEYS = {"device": ("sm_count", "sustained_clock_ratio", "unattributed_at_scale_ratio",
                            "flash_dropout_forward_ratio", "flash_dropout_backward_ratio"),
                 "framework": ("tp_comm_sms", "dp_comm_sms", "cp_comm_sms", "grad_buffer_pass_bytes_per_param")}


def without_at_scale_terms(system):
    """`system` with its named at-scale terms left out: a step priced by its kernels and
    communication alone, the frame of tests that count another mechanism by hand."""
    import dataclasses

    parts = {section: dataclasses.replace(getattr(system, section), **dict.fromkeys(keys))
             for section, keys in AT_SCALE_KEYS.items()}
    return dataclasses.replace(system, **parts)
