"""System profiles in hwprofiles/: all load, every number has a provenance, SMNG-P2's facts hold."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from perfsim.spec.system import System, load_system
from perfsim.spec._toml import tomllib

from profile_toml import HWPROFILES

ALLOWED_PROVENANCE = {"spec", "measured", "derived", "assumed", "calibrated"}  # docs/profile-format.md
FILES = sorted(glob.glob(os.path.join(HWPROFILES, "*.toml")))
NAMES = [os.path.splitext(os.path.basename(f))[0] for f in FILES]
SECTIONS = ("device", "node", "network", "collectives", "framework", "moe")  # moe: optional (docs/profile-format.md)


def _raw(path):
    with open(path, "rb") as fh:
        return tomllib.load(fh)


# optional per-operation tables: (section, table)
OPERATION_TABLES = (("collectives", "operation_efficiency"), ("collectives", "operation_latency_factor"),
                    ("collectives", "operation_step_overhead_s"), ("device", "operation_memory_efficiency"))


def _numbers(raw):
    """(section, key, table) for every number-with-provenance table in a raw profile; an entry of a
    per-operation table comes as ("collectives", "operation_efficiency.all_reduce", table)."""
    for section in SECTIONS:
        for key, entry in raw.get(section, {}).items():  # an optional section may be absent
            if key == "measured":  # tables of measured points (docs/profile-format.md), not numbers
                continue
            if (section, key) in OPERATION_TABLES:
                for op, item in entry.items():
                    yield section, f"{key}.{op}", item
            elif isinstance(entry, dict):
                yield section, key, entry


def _loaded(system, section, key):
    if "." in key:
        table, op = key.split(".")
        return dict(getattr(getattr(system, section), table))[op]
    return getattr(getattr(system, section), key)


def test_the_expected_profiles_exist():
    assert {"smng-p2", "dgx-a100", "dgx-h100", "v100-tacc"} <= set(NAMES)


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_loads_by_name_and_by_path(path):
    name = os.path.splitext(os.path.basename(path))[0]
    by_name = load_system(name)
    by_path = load_system(path)
    assert isinstance(by_name, System)
    assert by_name.name == name  # the file name is the name users type
    assert dataclasses.replace(by_path, path="") == dataclasses.replace(by_name, path="")
    assert by_name.description.strip()


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_every_number_has_allowed_provenance_and_a_source(path):
    raw = _raw(path)
    assert raw["schema"] == 1
    entries = list(_numbers(raw))
    assert len(entries) >= 25
    for section, key, entry in entries:
        # value, provenance and source; optionally a range (or the causes a number is the product of)
        assert {"value", "provenance", "source"} <= set(entry) <= {"value", "provenance", "source", "range",
                                                                   "distribution", "causes"}, (section, key)
        assert entry["provenance"] in ALLOWED_PROVENANCE, (section, key, entry["provenance"])
        assert isinstance(entry["source"], str) and len(entry["source"].strip()) >= 10, (section, key)
        value = entry["value"]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (section, key)


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_loaded_values_and_provenance_match_the_file(path):
    raw = _raw(path)
    system = load_system(path)
    numeric_fields = set()
    for section in SECTIONS:
        obj = getattr(system, section)
        for f in dataclasses.fields(obj):
            if f.type in ("float", "int", float, int) or (f.type in ("float | None", "int | None")
                                                           and getattr(obj, f.name) is not None):
                numeric_fields.add(f"{section}.{f.name}")  # optional numbers without a default count where given
    for section, table in OPERATION_TABLES:  # the operations a profile names, each with its provenance
        numeric_fields |= {f"{section}.{table}.{op}" for op, _ in getattr(getattr(system, section), table)}
    assert set(system.provenance) == numeric_fields  # every numeric field, nothing else
    for section, key, entry in _numbers(raw):
        assert _loaded(system, section, key) == entry["value"]
        assert system.provenance[f"{section}.{key}"] == (entry["provenance"], entry["source"])


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_values_are_physically_sane(path):
    s = load_system(path)
    d = s.device
    assert 0 < d.gemm_efficiency <= 1 and 0 < d.memory_efficiency <= 1
    assert d.peak_flops_bf16 >= d.peak_flops_fp32 > 0
    assert s.node.devices_per_node % s.node.devices_per_card == 0
    c = s.collectives
    for eff in (c.card_efficiency, c.node_efficiency, c.network_efficiency):
        assert 0 < eff <= 1
    assert c.algorithm in ("auto", "ring", "tree", "hierarchical")
    for op, value in c.operation_efficiency:
        assert op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send") and 0 < value <= 1
    for op, value in c.operation_latency_factor:
        assert 0 < value < 100, (op, value)
    for op, value in c.operation_step_overhead_s:  # a wait per call, not seconds of transfer
        assert 0 <= value < 0.1, (op, value)
    for kind, value in d.operation_memory_efficiency:  # may exceed 1 (in cache), not by orders of magnitude
        assert 0 < value < 10, (kind, value)
    assert s.network.oversubscription >= 1


def test_smng_p2_facts():
    s = load_system("smng-p2")
    assert s.node.devices_per_node == 8  # 4 x Max 1550, 2 tiles each, FLAT mode
    assert s.node.devices_per_card == 2
    assert s.device.peak_flops_bf16 == pytest.approx(419.4e12, rel=1e-12)
    assert s.network.nics_per_node == 2
    assert s.network.nic_bandwidth_Bps == pytest.approx(25e9, rel=1e-12)  # HDR 200 Gb/s
    assert s.device.memory_bytes == pytest.approx(64e9, rel=1e-12)  # 128 GB per GPU, 2 tiles
    assert s.provenance["device.peak_flops_bf16"][0] == "derived"
    # 128 Xe-cores x 4096 FLOP/clock x 1.6 GHz / 2 tiles
    assert 128 * 4096 * 1.6e9 / 2 == pytest.approx(s.device.peak_flops_bf16, rel=1e-3)


def test_dgx_a100_facts():
    s = load_system("dgx-a100")
    assert s.node.devices_per_node == 8
    assert s.device.peak_flops_bf16 == pytest.approx(312e12, rel=1e-12)
    assert s.device.memory_bytes == 85_056_798_720  # what torch reports of the "80 GB" (80 GiB) of HBM2e
    assert s.network.nics_per_node == 8


def test_profiles_listing(run_cli):
    result = run_cli("profiles", "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert sorted(s["name"] for s in data["systems"]) == sorted(NAMES)
    models = {m["name"]: m for m in data["models"]}
    assert {"gpt3-175b", "smng-p2-3.6b", "smng-p2-20b", "smng-p2-175b", "sc21-1.7b", "sc21-1t"} <= set(models)
    # GPT-3 175B: 12 l h^2 + 13 l h + (V + s) h + 2h with V = 50257 padded to 50304
    l, h = 96, 12288
    assert models["gpt3-175b"]["params"] == 12 * l * h * h + 13 * l * h + (50304 + 2048) * h + 2 * h
    text = run_cli("profiles")
    assert text.code == 0 and "smng-p2" in text.out and "gpt3-175b" in text.out
