"""The calibrated profile as TOML text: the base profile with every fitted number (and table) in place."""

from __future__ import annotations

import datetime as _dt
import json
import os


from perfsim.calibrate.common import Calibration
from perfsim.calibrate.report import format_quality_row
from perfsim.calibrate.tables import table_toml
from perfsim.spec.system import OPERATIONS


# --- the calibrated profile ---

def _toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _toml_float(value: float) -> str:
    """Shortest exact text of a float, in exponent form when large or small (1.184e+11)."""
    text = repr(float(value))
    if value and (abs(value) >= 1e6 or abs(value) < 1e-3) and "e" not in text:
        mantissa, exponent = f"{value:.15e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        short = f"{mantissa}e{int(exponent):+03d}"
        if float(short) == value:
            text = short
    return text


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _toml_float(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):  # a table's rows one per line
        if value and all(isinstance(v, list) for v in value):
            return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to a profile")


def profile_toml(data: dict, header: list | None = None) -> str:
    """A profile's parsed TOML (schema, name, description, sections of tables) as TOML text."""
    lines = [f"# {h}" if h else "#" for h in (header or [])]
    def table(name, entries, top=True):  # plain keys first, then each sub-table under its dotted name
        plain = [f"{k} = {_toml_value(v)}" for k, v in entries.items() if not isinstance(v, dict)]
        out = ["", f"[{name}]"] + plain if top or plain else []  # a table of tables needs no header of its own
        for key, value in entries.items():
            if isinstance(value, dict):
                out += table(f"{name}.{key}", value, top=False)
        return out

    for key, value in data.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    for section, entries in data.items():
        if isinstance(entries, dict):
            lines += table(section, entries)
    return "\n".join(lines) + "\n"


def calibrated_profile(base_path: str, calibration: Calibration, ledger: str, name: str, description: str) -> str:
    """The TOML text of the base profile with every fitted number replaced."""
    from perfsim.spec._toml import read_toml
    from perfsim.spec.system import parse_system

    data = read_toml(base_path, "base profile")
    data["name"], data["description"] = name, description
    for key, fitted in calibration.values.items():
        section, item = key.split(".", 1)
        if isinstance(fitted.value, str):  # a plain-string key (collectives.algorithm): no provenance table
            data[section][item] = fitted.value
            continue
        where = data[section]
        if "." in item:  # <table>.<name>: an entry of an optional per-operation table
            table, item = item.split(".")
            where = where.setdefault(table, {})
        where[item] = {"value": float(f"{fitted.value:.6g}"), "provenance": "calibrated", "source": fitted.source}
    for section in ("device", "collectives"):
        data[section].pop("measured", None)  # the base profile's tables measured another machine
    for table in calibration.tables:
        section = "collectives" if table.kernel in OPERATIONS else "device"
        data[section].setdefault("measured", {}).setdefault(table.kernel, {})[table.dtype] = table_toml(table, ledger)
    parse_system(data, f"calibrated profile from {ledger}")  # refuse to write a profile perfsim cannot load
    header = [f"Calibrated by `perfsim calibrate` from ledger {ledger} on "
              f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; base profile "
              f"{os.path.basename(base_path)}.", "Fit quality (MAPE on fitted / held-out points):"]
    for q in calibration.quality:
        header.append(f"  {format_quality_row(q)}")
    if calibration.notes:
        header.append("Notes:")
        header += [f"  {n}" for n in calibration.notes]
    return profile_toml(data, header)
