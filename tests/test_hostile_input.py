"""Hostile input: every way input enters perfsim, tried with what a careless or hostile user gives it.

Every case runs `perfsim.cli.main(argv)` in this process under a 10 s alarm and must end with exit
status 2 and exactly one line `perfsim: error: ...` on stderr (or `perfsim <command>: error: ...`),
or with status 0 where the input is fine; warnings `perfsim: warning: ...` may come first only
where a ledger's lines are skipped. Never a traceback, never a hang. The property tests at the end
feed generated input to the readers themselves.

The classes: files perfsim reads (kind, size, encoding, path), profile and model TOML content,
ledger lines, Megatron-DeepSpeed logs, numbers on the command line, files perfsim writes.
No case needs torch or launches ranks: a --device run is only ever given flags its parser refuses.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from perfsim import cli
from perfsim.errors import PerfsimError

HWPROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hwprofiles")
CASE_SECONDS = 10
ERROR = re.compile(r"perfsim( [a-z]+)?: error: \S")
WARNING = "perfsim: warning: "
BIG = str(10**30)
HUGE_DIGITS = "1" * 5000  # beyond int's string-conversion limit


class Hang(Exception):
    """A case ran past CASE_SECONDS."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def fire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def perfsim(capsys):
    """Run the command line in-process: (exit status, stdout, stderr); a traceback fails the case."""

    def run(*argv):
        capsys.readouterr()
        start = time.perf_counter()
        with time_limit(CASE_SECONDS):
            try:
                code = cli.main(list(argv))
            except SystemExit as exc:  # --help and the like
                code = exc.code
        assert time.perf_counter() - start < CASE_SECONDS
        out, err = capsys.readouterr()
        return code, out, err

    return run


def check(result, expect: str = "error", needle: str | None = None, warnings: bool = False):
    """`expect` "error": status 2 and one error line; "ok": status 0 and no error; "either"."""
    code, out, err = result
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    if warnings:
        lines = [line for line in lines if not line.startswith(WARNING)]
    if code == 0 and expect in ("ok", "either"):
        assert lines == [], err
        return
    assert expect in ("error", "either"), (code, err)
    assert code == 2, (code, err)
    assert len(lines) == 1 and ERROR.match(lines[0]), err
    if needle is not None:
        assert needle.lower() in lines[0].lower(), lines[0]


# --- files perfsim reads: their kind, size, encoding and path --------------------------------

def _short_dir() -> str:
    return tempfile.mkdtemp(prefix="ph-", dir="/tmp")  # a socket's path must be short


@pytest.fixture(scope="module")
def bad_files():
    """name -> path of each kind of file a reader must refuse (made once)."""
    d = _short_dir()
    paths = {}

    def write(name, data: bytes):
        path = os.path.join(d, name)
        with open(path, "wb") as fh:
            fh.write(data)
        return path

    paths["missing"] = os.path.join(d, "missing.toml")
    os.mkdir(os.path.join(d, "adir.toml"))
    paths["directory"] = os.path.join(d, "adir.toml")
    os.mkfifo(os.path.join(d, "fifo.toml"))
    paths["fifo"] = os.path.join(d, "fifo.toml")
    paths["dev-null"] = "/dev/null"
    paths["dev-zero"] = "/dev/zero"
    paths["dev-urandom"] = "/dev/urandom"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(d, "s.toml"))
    paths["socket"] = os.path.join(d, "s.toml")
    os.symlink(os.path.join(d, "nowhere"), os.path.join(d, "dangling.toml"))
    paths["dangling-link"] = os.path.join(d, "dangling.toml")
    os.symlink(os.path.join(d, "loop.toml"), os.path.join(d, "loop.toml"))
    paths["link-loop"] = os.path.join(d, "loop.toml")
    write("plain.txt", b"x")
    paths["through-a-file"] = os.path.join(d, "plain.txt", "x.toml")
    paths["empty-path"] = ""
    paths["nul-in-path"] = os.path.join(d, "a\0b.toml")
    paths["newline-in-name"] = write("new\nline.toml", b"caf\xe9 = 1\n")
    huge = os.path.join(d, "huge.toml")
    with open(huge, "wb") as fh:
        fh.truncate(2**31)  # sparse: above every reader's limit, nothing written
    paths["huge"] = huge
    paths["binary"] = write("binary.toml", bytes(range(256)) * 4)
    paths["latin-1"] = write("latin1.toml", "name = \"caf\u00e9\"\nlayers = 2\n".encode("latin-1"))
    paths["utf-16"] = write("utf16.toml", "layers = 2\n".encode("utf-16"))
    paths["empty-file"] = write("empty.toml", b"")
    paths["name-too-long"] = os.path.join(d, "x" * 300 + ".toml")
    yield paths
    sock.close()
    shutil.rmtree(d)


def _readers(tmp):
    """How each reader is given a file: argv for a path."""
    return {
        "model": lambda p: ["predict", "--model", p, "--system", "cpu-example", "--devices", "1"],
        "system": lambda p: ["predict", "--model", "gpt3-125m", "--system", p, "--devices", "1"],
        "fit-ledger": lambda p: ["calibrate", "--fit", p, "--system", "cpu-example", "--out", f"{tmp}/fit.toml"],
        "chart-ledger": lambda p: ["chart", "validation", "--ledger", p, "--out", f"{tmp}/v.html"],
        "megatron-log": lambda p: ["validate", "--megatron-log", p, "--model", "gpt3-125m", "--system", "dgx-a100",
                                   "--devices", "1"],
        "pp-layout": lambda p: ["predict", "--model", "gpt3-125m", "--system", "cpu-example", "--devices", "2",
                                "--pp", "2", "--pp-layout", p],
    }


BAD_FILES = ["missing", "directory", "fifo", "dev-null", "dev-zero", "dev-urandom", "socket", "dangling-link",
             "link-loop", "through-a-file", "empty-path", "nul-in-path", "newline-in-name", "huge", "binary",
             "latin-1", "utf-16", "empty-file", "name-too-long"]
READERS = ["model", "system", "fit-ledger", "chart-ledger", "megatron-log", "pp-layout"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_bad_file_is_one_line(perfsim, bad_files, tmp_path, reader, kind):
    check(perfsim(*_readers(tmp_path)[reader](bad_files[kind])), warnings=reader.endswith("ledger"))


def test_a_newline_in_a_path_stays_on_one_line(perfsim, bad_files):
    code, _, err = perfsim("predict", "--model", bad_files["newline-in-name"])
    check((code, "", err), needle="new\\nline.toml")


def test_a_byte_order_mark_and_crlf_are_fine(perfsim, tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[model]\r\nlayers = 2\r\nhidden = 64\r\nheads = 4\r\nseq = 8\r\nvocab = 10\r\n")
    check(perfsim("predict", "--model", str(path), "--system", "cpu-example", "--devices", "1"), "ok")


# --- system profiles: TOML content ----------------------------------------------------------

def _profile_text() -> str:
    with open(os.path.join(HWPROFILES, "smng-p2.toml"), encoding="utf-8") as fh:
        return fh.read()


GEMM_EFF = "[device.gemm_efficiency]\nvalue = 0.651"
GEMM_RANGE = "range = [0.61, 0.835]"
OVERHEAD_RANGE = "per-call oneCCL overhead with CCL_OP_SYNC=1, 0-1 ms\"\nrange = [0.0, 1e-3]\n\n[collectives.operation_step_overhead_s.all_gather]"
NUMBER = "\nvalue = 1.0\nprovenance = \"spec\"\nsource = \"x\"\n"

# (id, (old, new) replacement in smng-p2.toml or text appended, expected outcome, word of the message)
PROFILE_CASES = [
    ("unknown-top-level-key", ("schema = 1", "schema = 1\nshema = 1"), "error", "did you mean schema"),
    ("misspelt-section", ("", "\n[devcie.peak_flops_bf16]" + NUMBER), "error", "did you mean device"),
    ("unknown-section", ("", "\n[extras.x]" + NUMBER), "error", "unknown key extras"),
    ("misspelt-key", ("[device.gemm_efficiency]", "[device.gemm_efficency]"), "error", "did you mean gemm_efficiency"),
    ("unknown-key-in-section", ("", "\n[device.turbo_boost]" + NUMBER), "error", "device.turbo_boost"),
    ("misspelt-optional-key", ("[framework.zero3_overlap]", "[framework.zero3_overlapp]"), "error", "zero3_overlap"),
    ("unknown-number-part", (GEMM_EFF, GEMM_EFF + "\nvaule = 3"), "error", "did you mean value"),
    ("unknown-operation", ("", "\n[collectives.operation_efficiency.allreduce]" + NUMBER), "error",
     "did you mean all_reduce"),
    ("unknown-kind", ("", "\n[device.operation_memory_efficiency.layernom]" + NUMBER), "error", "layernorm"),
    ("misspelt-plain-section", ("[network]\n", "[network_]\n"), "error", "network_"),
    ("value-nan", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = nan"), "error", "gemm_efficiency"),
    ("value-inf", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = inf"), "error", "gemm_efficiency"),
    ("value-minus-inf", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = -inf"), "error", "gemm_efficiency"),
    ("value-overflows-float", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = 1e999"), "error", "gemm_efficiency"),
    ("value-5000-digits", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = " + HUGE_DIGITS), "error", "digits"),
    ("value-string", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = \"0.651\""), "error", "number"),
    ("value-array", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = [0.651]"), "error", "number"),
    ("value-date", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = 1979-05-27"), "error", "number"),
    ("value-table", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = {a = 1}"), "error", "number"),
    ("deeply-nested-array", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = " + "[" * 50000 + "]" * 50000),
     "error", "nested"),
    ("deeply-nested-table", (GEMM_EFF, "[device.gemm_efficiency]\nvalue = " + "{a=" * 3000 + "1" + "}" * 3000),
     "error", "nested"),
    ("provenance-list", (GEMM_EFF + "\nprovenance = \"measured\"", GEMM_EFF + "\nprovenance = [\"measured\"]"),
     "error", "provenance"),
    ("schema-string", ("schema = 1", "schema = \"1\""), "error", "schema"),
    ("schema-bool", ("schema = 1", "schema = true"), "error", "schema"),
    ("name-table", ('name = "smng-p2"', "name = {a = 1}"), "error", "name"),
    ("duplicate-key", ("schema = 1", "schema = 1\nschema = 1"), "error", "not valid TOML"),
    ("syntax-error", ("schema = 1", "schema = = 1"), "error", "not valid TOML"),
    ("devices-per-node-zero", ("[node.devices_per_node]\nvalue = 8", "[node.devices_per_node]\nvalue = 0"), "error",
     "devices_per_node"),
    ("devices-per-node-2-to-62", ("[node.devices_per_node]\nvalue = 8", "[node.devices_per_node]\nvalue = 4611686018427387904"),
     "error", None),
    ("long-description", ('description = "', 'description = "' + "x" * 1_000_000), "ok", None),
    # ranges (issue 16): lo above hi, value outside, NaN, wrong shape, outside the key's allowed values
    ("range-lo-above-hi", (GEMM_RANGE, "range = [0.835, 0.61]"), "error", "device.gemm_efficiency.range has lo"),
    ("range-value-outside", (GEMM_RANGE, "range = [0.7, 0.835]"), "error", "gemm_efficiency.value 0.651 lies outside"),
    ("range-nan", (GEMM_RANGE, "range = [nan, 0.835]"), "error", "device.gemm_efficiency.range must hold finite"),
    ("range-inf", (GEMM_RANGE, "range = [0.61, inf]"), "error", "device.gemm_efficiency.range must hold finite"),
    ("range-one-number", (GEMM_RANGE, "range = 0.7"), "error", "device.gemm_efficiency.range must be two numbers"),
    ("range-three-numbers", (GEMM_RANGE, "range = [0.6, 0.7, 0.8]"), "error", "gemm_efficiency.range must be two"),
    ("range-strings", (GEMM_RANGE, 'range = ["0.6", "0.8"]'), "error", "gemm_efficiency.range must be two"),
    ("range-above-a-fraction", (GEMM_RANGE, "range = [0.61, 1.5]"), "error", "allowed values"),
    ("range-unknown-distribution", (GEMM_RANGE, GEMM_RANGE + '\ndistribution = "normal"'), "error",
     "gemm_efficiency.distribution must be one of"),
    ("range-loguniform-from-zero", (OVERHEAD_RANGE, OVERHEAD_RANGE + '\ndistribution = "loguniform"'), "error",
     "operation_step_overhead_s.all_gather.range must be above 0"),
    ("distribution-without-range", ("[device.memory_efficiency]\nvalue = 0.61",
                                    '[device.memory_efficiency]\ndistribution = "uniform"\nvalue = 0.61'),
     "error", "memory_efficiency.distribution needs a range"),
    ("range-beside-causes", ("[collectives.network_efficiency]\nvalue = 0.371",
                             "[collectives.network_efficiency]\nrange = [0.3, 0.4]\nvalue = 0.371"),
     "error", "network_efficiency has both causes and a range"),
    ("cause-without-source", ("[collectives.network_efficiency.causes.hdr_transfer]\nrange = [0.80, 0.96]\nsource",
                              "[collectives.network_efficiency.causes.hdr_transfer]\nrange = [0.80, 0.96]\nsourc"),
     "error", "unknown key collectives.network_efficiency.causes.hdr_transfer.sourc"),
    ("cause-zero", ("[collectives.network_efficiency.causes.hdr_transfer]\nrange = [0.80, 0.96]",
                    "[collectives.network_efficiency.causes.hdr_transfer]\nrange = [0.0, 0.96]"), "error",
     "causes.hdr_transfer.range must be above 0"),
    ("observations-not-a-path", ('observations = "observations/smng-p2.toml"', "observations = 3"), "error",
     "observations must be the path"),
    ("unicode-name", ('name = "smng-p2"', 'name = "超级计算机 ☃"'), "ok", None),
]


def _profile(tmp_path, change) -> str:
    old, new = change
    text = _profile_text()
    if old:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    else:
        text += new
    path = tmp_path / "profile.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("change,expect,needle", [c[1:] for c in PROFILE_CASES], ids=[c[0] for c in PROFILE_CASES])
def test_profile_content(perfsim, tmp_path, change, expect, needle):
    check(perfsim("predict", "--model", "gpt3-125m", "--system", _profile(tmp_path, change), "--nodes", "1"),
          expect, needle)


def test_every_committed_profile_is_still_accepted(perfsim):
    for name in sorted(f[:-5] for f in os.listdir(HWPROFILES) if f.endswith(".toml")):
        check(perfsim("predict", "--model", "gpt3-125m", "--system", name, "--devices", "1"), "ok")


# --- model files and inline specs --------------------------------------------------------------

MODEL = "layers = 2\nhidden = 64\nheads = 4\nseq = 8\nvocab = 10\n"
SMALL = "layers=2,hidden=64,heads=4,seq=8,vocab=10"

MODEL_FILE_CASES = [
    ("fine", MODEL, "ok", None),
    ("fine-under-model", "[model]\n" + MODEL, "ok", None),
    ("misspelt-field", MODEL.replace("layers", "layres"), "error", "did you mean layers"),
    ("unknown-field", MODEL + "experts = 8\n", "error", "experts"),
    ("key-beside-model", "note = 1\n[model]\n" + MODEL, "error", "beside [model]"),
    ("model-not-a-table", 'model = "gpt3"\n', "error", "table"),
    ("other-table", MODEL + "[other]\nx = 1\n", "error", "other"),
    ("float-layers", MODEL.replace("layers = 2", "layers = 2.0"), "error", "layers"),
    ("string-layers", MODEL.replace("layers = 2", 'layers = "2"'), "error", "layers"),
    ("bool-layers", MODEL.replace("layers = 2", "layers = true"), "error", "layers"),
    ("array-layers", MODEL.replace("layers = 2", "layers = [2]"), "error", "layers"),
    ("huge-layers", MODEL.replace("layers = 2", f"layers = {BIG}"), "error", None),
    ("5000-digit-layers", MODEL.replace("layers = 2", f"layers = {HUGE_DIGITS}"), "error", "digits"),
    ("negative-hidden", MODEL.replace("hidden = 64", "hidden = -64"), "error", "hidden"),
    ("zero-heads", MODEL.replace("heads = 4", "heads = 0"), "error", "heads"),
    ("name-table", MODEL + "name = {a = 1}\n", "error", "name"),
    ("name-empty", MODEL + 'name = ""\n', "error", "name"),
    ("norm-list", MODEL + 'norm = ["rmsnorm"]\n', "error", "norm"),
    ("bool-as-string", MODEL + 'gated_mlp = "yes"\n', "error", "gated_mlp"),
    ("deeply-nested", "layers = " + "[" * 50000 + "]" * 50000 + "\n", "error", "nested"),
    ("nan-seq", MODEL.replace("seq = 8", "seq = nan"), "error", "seq"),
]


@pytest.mark.parametrize("text,expect,needle", [c[1:] for c in MODEL_FILE_CASES], ids=[c[0] for c in MODEL_FILE_CASES])
def test_model_file(perfsim, tmp_path, text, expect, needle):
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    check(perfsim("predict", "--model", str(path), "--system", "cpu-example", "--devices", "1"), expect, needle)


INLINE_CASES = [
    ("key-twice", SMALL + ",layers=3", "given twice"),
    ("misspelt-key", SMALL + ",kv_haeds=2", "did you mean kv_heads"),
    ("5000-digits", SMALL.replace("layers=2", "layers=" + HUGE_DIGITS), "layers"),
    ("huge", SMALL.replace("hidden=64", "hidden=" + BIG), "hidden"),
    ("exponent", SMALL.replace("seq=8", "seq=1e3"), "seq"),
    ("empty-pairs", SMALL + ",,", "key=value"),
    ("unicode-key", SMALL + ",schichten=2", "schichten"),
    ("megabyte-spec", SMALL + ",name=" + "x" * 1_000_000 + ",bad", "key=value"),
    ("nul-in-spec", SMALL + ",name=a\0b,bad", "key=value"),
]


@pytest.mark.parametrize("spec,needle", [c[1:] for c in INLINE_CASES], ids=[c[0] for c in INLINE_CASES])
def test_inline_model_spec(perfsim, spec, needle):
    check(perfsim("predict", "--model", spec, "--system", "cpu-example", "--devices", "1"), needle=needle)


# --- ledgers: any line, any depth, any field missing or mistyped ----------------------------

@pytest.fixture(scope="module")
def base_records():
    """A few records of every suite from the committed calibration ledger: enough for every part
    of the fit to run, small enough to fit in a fraction of a second."""
    wanted = {("gemm", "matmul"): 12, ("memory", "add"): 4, ("memory", "layernorm"): 4, ("memory", "copy"): 3,
              ("memory", "triad"): 3, ("memory", "softmax_backward"): 3, ("collective", "all_reduce"): 6,
              ("collective", "send"): 6, ("attention", "sdpa"): 1, ("tp_overhead", "1d"): 1}
    out = []
    with open(os.path.join(HWPROFILES, "ledgers", "calibration-cpu.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            key = (r["suite"], r["op"])
            if wanted.get(key, 0) and (r["suite"] != "collective" or r["dtype"] == "bf16"):
                wanted[key] -= 1
                out.append(r)
    return out


def _a(suite: str, base: list) -> dict:
    return json.loads(json.dumps(next(r for r in base if r["suite"] == suite)))


def _with(suite, change):
    """A line: the first `suite` record of the base ledger, changed, under a new key."""
    def make(base):
        r = _a(suite, base)
        r["key"] = "hostile"
        change(r)
        return json.dumps(r)
    return make


def _set(path, value):
    def change(r):
        *parents, last = path.split(".")
        for p in parents:
            r = r[p]
        r[last] = value
    return change


def _drop(path):
    def change(r):
        *parents, last = path.split(".")
        for p in parents:
            r = r[p]
        del r[last]
    return change


def _raw(text):
    return lambda base: text


DEEP = "[" * 100000 + "]" * 100000
# (id, the hostile line, whether the base records still fit: then status 0 and a warning naming the line)
LEDGER_LINES = [
    ("deep-array", _raw(DEEP)),
    ("deep-object", _raw('{"a":' * 100000 + "1" + "}" * 100000)),
    ("deep-inside-a-record", lambda base: json.dumps(_a("gemm", base))[:-1] + ',"x":' + DEEP + "}"),
    ("nan", _raw('{"schema": 1, "key": "k", "suite": "gemm", "op": "matmul", "dtype": "fp32", "stats": {"median_s": NaN}}')),
    ("infinity", lambda base: json.dumps(_a("gemm", base)).replace('"median_s": ', '"median_s": Infinity, "x": ', 1)),
    ("float-overflow", lambda base: json.dumps(_a("memory", base)).replace('"median_s": ', '"median_s": 1e999, "x": ', 1)),
    ("int-beyond-64-bits", _with("gemm", _set("shape.m", 10**30))),
    ("int-5000-digits", lambda base: json.dumps(_a("gemm", base)).replace('"m": ', '"m": ' + HUGE_DIGITS + ', "y": ', 1)),
    ("not-utf-8", _raw('{"schema": 1, "key": "caf\udce9"}')),  # byte 0xe9 alone (written with surrogateescape)
    ("nul-byte", _raw('{"schema": 1,\0 "key": "k"}')),
    ("two-mebibyte-line", _raw('{"schema": 1, "pad": "' + "x" * (2 << 20) + '"}')),
    ("array", _raw("[1, 2, 3]")),
    ("string", _raw('"a string"')),
    ("null", _raw("null")),
    ("number", _raw("42")),
    ("cut-short", lambda base: json.dumps(_a("gemm", base))[:40]),
    ("no-key", _with("gemm", _drop("key"))),
    ("key-is-a-number", _with("gemm", _set("key", 7))),
    ("key-is-a-list", _with("gemm", _set("key", ["k"]))),
    ("schema-2", _with("gemm", _set("schema", 2))),
    ("schema-true", _with("gemm", _set("schema", True))),
    ("unknown-suite", _with("gemm", _set("suite", "gemv"))),
    ("suite-is-a-table", _with("gemm", _set("suite", {"a": 1}))),
    ("training-step-in-calibration-ledger", _with("gemm", _set("suite", "step"))),
    ("no-stats", _with("gemm", _drop("stats"))),
    ("stats-a-list", _with("gemm", _set("stats", [1, 2]))),
    ("median-a-string", _with("gemm", _set("stats.median_s", "0.1"))),
    ("median-negative", _with("gemm", _set("stats.median_s", -0.1))),
    ("median-bool", _with("gemm", _set("stats.median_s", True))),
    ("mean-a-string", _with("collective", _set("stats.mean_s", "slow"))),
    ("cpu-stats-a-list", _with("gemm", _set("cpu_stats", [0.1]))),
    ("shape-without-m", _with("gemm", _drop("shape.m"))),
    ("shape-float", _with("gemm", _set("shape.k", 64.5))),
    ("shape-2-to-50", _with("gemm", _set("shape.n", 2**50))),
    ("collective-op-dunder", _with("collective", _set("op", "__init__"))),
    ("collective-op-unknown", _with("collective", _set("op", "all_to_some"))),
    ("group-of-one", _with("collective", _set("group", [1, 1]))),
    ("group-2-to-40", _with("collective", _set("group", [2**40, 1]))),
    ("group-three-numbers", _with("collective", _set("group", [2, 1, 1]))),
    ("nbytes-a-string", _with("collective", _set("nbytes", "1024"))),
    ("memory-nbytes-negative", _with("memory", _set("nbytes", -5))),
    ("attention-fp8", _with("attention", _set("dtype", "fp8"))),
    ("attention-without-heads", _with("attention", _drop("shape.heads"))),
    ("overhead-strings", _with("tp_overhead", _set("overhead_s", ["a", "b"]))),
    ("reference-stats-a-number", _with("tp_overhead", _set("reference_stats", 3))),
    ("device-a-list", _with("gemm", _set("device", ["cpu"]))),
    ("device-kind-a-number", _with("gemm", _set("device.kind", 3))),
    ("host-a-number", _with("gemm", _set("host", 5))),
    ("timing-a-list", _with("collective", _set("timing", ["interleaved"]))),
    ("ranks-per-node-a-string", _with("collective", _set("ranks_per_node", "2"))),
]


def _ledger(tmp_path, base, extra: list) -> str:
    path = tmp_path / "ledger.jsonl"
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as fh:
        for r in base:
            fh.write(json.dumps(r) + "\n")
        for line in extra:
            fh.write(line + "\n")
    return str(path)


@pytest.mark.parametrize("make", [c[1] for c in LEDGER_LINES], ids=[c[0] for c in LEDGER_LINES])
def test_a_hostile_ledger_line_is_a_warning(perfsim, tmp_path, base_records, make):
    """The fit goes on without the line and names it (line 44: after the 43 base records)."""
    path = _ledger(tmp_path, base_records, [make(base_records)])
    code, out, err = perfsim("calibrate", "--fit", path, "--system", "cpu-example", "--out", str(tmp_path / "f.toml"))
    check((code, out, err), "ok", warnings=True)
    assert f"line {len(base_records) + 1} " in err and err.startswith(WARNING), err


@pytest.mark.parametrize("make", [c[1] for c in LEDGER_LINES[:12]], ids=[c[0] for c in LEDGER_LINES[:12]])
def test_a_hostile_ledger_line_in_the_validation_chart(perfsim, tmp_path, base_records, make):
    path = _ledger(tmp_path, base_records, [make(base_records)])
    code, out, err = perfsim("chart", "validation", "--ledger", path, "--system", "cpu-calibrated",
                             "--out", str(tmp_path / "v.html"))
    check((code, out, err), "ok", warnings=True)
    assert f"line {len(base_records) + 1} " in err


def test_a_failed_point_is_counted_not_warned(perfsim, tmp_path, base_records):
    failed = dict(_a("gemm", base_records), key="failed", error="out of memory")
    del failed["stats"]
    path = _ledger(tmp_path, base_records, [json.dumps(failed)])
    code, out, err = perfsim("calibrate", "--fit", path, "--system", "cpu-example", "--out", str(tmp_path / "f.toml"))
    check((code, out, err), "ok")


def test_a_repeated_key_says_which_copy_is_used(perfsim, tmp_path, base_records):
    again = json.dumps(base_records[0])
    path = _ledger(tmp_path, base_records, [again])
    code, out, err = perfsim("calibrate", "--fit", path, "--system", "cpu-example", "--out", str(tmp_path / "f.toml"))
    check((code, out, err), "ok", warnings=True)
    assert f"is on lines 1, {len(base_records) + 1}" in err and f"(line {len(base_records) + 1}) is used" in err


def test_many_damaged_lines_are_counted_after_ten_warnings(perfsim, tmp_path, base_records):
    path = _ledger(tmp_path, base_records, ["{broken"] * 500)
    code, out, err = perfsim("calibrate", "--fit", path, "--system", "cpu-example", "--out", str(tmp_path / "f.toml"))
    check((code, out, err), "ok", warnings=True)
    assert err.count("\n") == 11 and "490 more lines skipped" in err


@pytest.mark.parametrize("lines,needle", [
    (["{broken", "[]", "null"], "holds no measurements"),
    ([DEEP] * 3, "holds no measurements"),
], ids=["all-damaged", "all-deep"])
def test_a_ledger_with_nothing_usable_is_an_error(perfsim, tmp_path, lines, needle):
    path = _ledger(tmp_path, [], lines)
    check(perfsim("calibrate", "--fit", path, "--system", "cpu-example", "--out", str(tmp_path / "f.toml")),
          needle=needle)


def test_a_validation_ledger_is_drawn_and_not_fitted(perfsim, tmp_path):
    ledger = os.path.join(HWPROFILES, "ledgers", "validation-cpu.jsonl")
    check(perfsim("chart", "validation", "--ledger", ledger, "--out", str(tmp_path / "v.html")), "ok")
    check(perfsim("calibrate", "--fit", ledger, "--system", "cpu-example", "--out", str(tmp_path / "f.toml")),
          needle="holds training steps")


STEP_CHANGES = [
    ("no-measured", _drop("measured")),
    ("step-time-string", _set("measured.step_time_s", "fast")),
    ("step-times-empty", _set("measured.step_times_s", [])),
    ("probes-wrong-length", _set("measured.probe_s", [0.1])),
    ("plan-a-list", _set("plan", [1])),
    ("predicted-a-number", _set("predicted", 3)),
]


@pytest.mark.parametrize("change", [c[1] for c in STEP_CHANGES], ids=[c[0] for c in STEP_CHANGES])
def test_a_hostile_training_step_is_a_warning(perfsim, tmp_path, change):
    with open(os.path.join(HWPROFILES, "ledgers", "validation-cpu.jsonl"), encoding="utf-8") as fh:
        steps = [json.loads(next(fh)) for _ in range(3)]
    bad = json.loads(json.dumps(steps[0]))
    bad["key"] = "hostile"
    change(bad)
    path = _ledger(tmp_path, steps, [json.dumps(bad)])
    code, out, err = perfsim("chart", "validation", "--ledger", path, "--out", str(tmp_path / "v.html"))
    check((code, out, err), "ok", warnings=True)
    assert "line 4 " in err


# --- Megatron-DeepSpeed logs -------------------------------------------------------------------

CASE = ["--model", "sc21-1.7b", "--system", "dgx-a100", "--devices", "8", "--tp", "2", "--mbs", "4", "--gbs", "64"]


def _log_line(i, ms="2000.0", tflops="100.0", batch="64"):
    return (f" iteration {i:>8d}/     100 | consumed samples: {i * 64:>12d} | elapsed time per iteration (ms): {ms} | "
            f"learning rate: 1.5E-04 | global batch size: {batch:>5} | lm loss: 7.1E+00 | TFLOPs: {tflops} |")


LOG_CASES = [
    ("fine", [_log_line(i) for i in (10, 20, 30)], "ok", None),
    ("elapsed-nan", [_log_line(10), _log_line(20, ms="nan")], "error", "line 2"),
    ("elapsed-inf", [_log_line(10), _log_line(20, ms="inf")], "error", "line 2"),
    ("elapsed-1e999", [_log_line(10), _log_line(20, ms="1e999")], "error", "line 2"),
    ("elapsed-negative", [_log_line(10), _log_line(20, ms="-5")], "error", "line 2"),
    ("elapsed-zero", [_log_line(10), _log_line(20, ms="0.0")], "error", "line 2"),
    ("elapsed-a-year", [_log_line(10), _log_line(20, ms="3.2e10")], "error", "line 2"),
    ("elapsed-word", [_log_line(10), _log_line(20, ms="fast")], "error", "line 2"),
    ("tflops-nan", [_log_line(10), _log_line(20, tflops="nan")], "error", "TFLOPs"),
    ("tflops-inf", [_log_line(10), _log_line(20, tflops="inf")], "error", "TFLOPs"),
    ("batch-mismatch", [_log_line(i, batch="192") for i in (10, 20, 30)], "error", "192"),
    ("batch-not-a-number", [_log_line(10), _log_line(20, batch="many")], "error", "global batch size"),
    ("batch-ramp-up", [_log_line(10, batch="16"), _log_line(20, batch="32"), _log_line(30), _log_line(40)], "ok", None),
    ("no-step-lines", ["[INFO] building GPT model", "nothing else"], "error", "elapsed time"),
    ("megabyte-line", [_log_line(10), "x" * 1_000_000, _log_line(20)], "ok", None),
]


@pytest.mark.parametrize("lines,expect,needle", [c[1:] for c in LOG_CASES], ids=[c[0] for c in LOG_CASES])
def test_megatron_log(perfsim, tmp_path, lines, expect, needle):
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    check(perfsim("validate", "--megatron-log", str(path), *CASE), expect, needle)


def test_megatron_log_batch_mismatch_names_both_values(perfsim, tmp_path):
    path = tmp_path / "train.log"
    path.write_text("\n".join(_log_line(i, batch="192") for i in (10, 20, 30)) + "\n")
    code, out, err = perfsim("validate", "--megatron-log", str(path), *CASE)
    check((code, out, err), needle="global batch size is 192 but the plan's is --gbs 64")


# --- numbers on the command line -----------------------------------------------------------------

PREDICT = ["--model", "gpt3-125m", "--system", "dgx-a100"]
PRIME_BELOW_2_40 = "1099511627689"

NUMBER_CASES = [
    ("predict-gbs-2-to-40", ["predict", *PREDICT, "--devices", "1", "--gbs", str(2**40)], "ok", None),
    ("predict-gbs-2-to-41", ["predict", *PREDICT, "--devices", "1", "--gbs", str(2**41)], "error", "--gbs"),
    ("predict-devices-prime", ["predict", *PREDICT, "--devices", PRIME_BELOW_2_40], "error", "devices"),
    ("predict-devices-million", ["predict", *PREDICT, "--devices", str(2**20 + 1)], "error", "devices"),
    ("predict-nodes-huge", ["predict", *PREDICT, "--nodes", str(2**37)], "error", "devices"),
    ("predict-tp-huge", ["predict", *PREDICT, "--devices", "8", "--tp", BIG], "error", "--tp"),
    ("predict-cp-huge", ["predict", *PREDICT, "--devices", "8", "--cp", BIG], "error", "--cp"),
    ("predict-cp-not-dividing-the-sequence", ["predict", *PREDICT, "--devices", "6", "--cp", "3"], "error", "2 x cp"),
    ("predict-cp-beside-2d", ["predict", *PREDICT, "--devices", "8", "--tp", "4", "--tp-mode", "2d", "--mbs", "2",
                              "--cp", "2"], "error", "1d tensor parallelism only"),
    ("search-fix-cp-word", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--fix", "cp=ring"], "error", "cp"),
    ("predict-mbs-float", ["predict", *PREDICT, "--mbs", "1.5"], "error", "--mbs"),
    ("predict-mbs-5000-digits", ["predict", *PREDICT, "--mbs", HUGE_DIGITS], "error", "--mbs"),
    ("predict-zero-word", ["predict", *PREDICT, "--zero", "one"], "error", "--zero"),
    ("simulate-gbs-2-to-40", ["simulate", *PREDICT, "--devices", "1", "--gbs", str(2**40)], "error", "closed form"),
    ("simulate-many-stages", ["simulate", "--model", "gpt3-175b", "--system", "dgx-a100", "--devices", "96",
                              "--pp", "96", "--gbs", str(2**12)], "error", "closed form"),
    ("predict-sim-gbs-2-to-40", ["predict", *PREDICT, "--devices", "1", "--gbs", str(2**40), "--engine", "sim"],
     "error", "closed form"),
    ("search-tokens-nan", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "nan"], "error", "--tokens"),
    ("search-tokens-inf", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "inf"], "error", "--tokens"),
    ("search-tokens-minus-inf", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "-inf"], "error",
     "--tokens"),
    ("search-tokens-negative", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "-1"], "error", "--tokens"),
    ("search-tokens-1e400", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "1e400"], "error",
     "--tokens"),
    ("search-tokens-word", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--tokens", "many"], "error",
     "--tokens"),
    ("search-devices-two-million", ["search", *PREDICT, "--devices", "2000000", "--gbs", "8", "--quiet"], "error",
     "devices"),
    ("search-devices-prime", ["search", *PREDICT, "--devices", "10007", "--gbs", "10007", "--quiet"], "either", None),
    ("search-devices-prime-near-2-to-40", ["search", *PREDICT, "--devices", PRIME_BELOW_2_40, "--gbs", "8", "--quiet"],
     "error", "devices"),
    ("search-fix-range-10-to-30", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--fix", f"pp=1..{BIG}",
                                   "--quiet"], "error", "pp"),
    ("search-fix-zero-7", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--fix", "zero=7", "--quiet"], "error",
     "zero"),
    ("search-fix-word", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--fix", "pp=many"], "error", "pp"),
    ("search-fix-unknown-knob", ["search", *PREDICT, "--devices", "8", "--gbs", "8", "--fix", "ppp=2"], "error", "ppp"),
    ("scale-nodes-10-to-30", ["scale", *PREDICT, "--nodes", f"1,{BIG}", "--weak"], "error", None),
    ("scale-3000-node-counts", ["scale", *PREDICT, "--nodes", ",".join(map(str, range(1, 3001))), "--weak"], "error",
     "at most 64"),
    ("chart-3000-node-counts", ["chart", "scaling", *PREDICT, "--devices", "8", "--tp", "1", "--pp", "1",
                                "--node-counts", ",".join(map(str, range(1, 3001))), "--out", "x.html"], "error",
     "at most 64"),
    ("scale-nodes-zero", ["scale", *PREDICT, "--nodes", "0", "--weak"], "error", "--nodes"),
    ("scale-nodes-empty", ["scale", *PREDICT, "--nodes", ",", "--weak"], "error", "--nodes"),
    ("chart-top-negative", ["chart", "memory", *PREDICT, "--devices", "8", "--top", "-1", "--out", "x.html"], "error",
     "--top"),
    ("chart-keep-zero", ["chart", "whatif", *PREDICT, "--devices", "8", "--keep", "0", "--out", "x.html"], "error",
     "--keep"),
    ("chart-heatmap-two-million-devices", ["chart", "heatmap", *PREDICT, "--devices", "2000000", "--out", "x.html"],
     "error", "devices"),
    ("chart-whatif-nodes-huge", ["chart", "whatif", *PREDICT, "--nodes", str(2**30), "--out", "x.html"], "error",
     "devices"),
    ("chart-node-counts-huge", ["chart", "scaling", *PREDICT, "--devices", "8", "--tp", "1", "--pp", "1",
                                "--node-counts", f"1,{BIG}", "--out", "x.html"], "error", None),
    ("validate-warmup-10-to-30", ["validate", "--device", "cpu", "--warmup", BIG], "error", "--warmup"),
    ("validate-warmup-zero", ["validate", "--device", "cpu", "--warmup", "0"], "error", "--warmup"),
    ("validate-threads-2-to-40", ["validate", "--device", "cpu", "--threads", str(2**40)], "error", "--threads"),
    ("validate-nproc-2-to-40", ["validate", "--device", "cpu", "--nproc", str(2**40)], "error", "--nproc"),
    ("validate-steps-billion", ["validate", "--device", "cpu", "--steps", "1000000000"], "error", "--steps"),
    ("validate-rounds-million", ["validate", "--device", "cpu", "--rounds", "1000000"], "error", "--rounds"),
    ("validate-timeout-10-to-30", ["validate", "--device", "cpu", "--timeout", BIG], "error", "--timeout"),
    ("validate-speed-tolerance-nan", ["validate", "--device", "cpu", "--speed-tolerance", "nan"], "error",
     "--speed-tolerance"),
    ("validate-speed-tolerance-negative", ["validate", "--device", "cpu", "--speed-tolerance", "-1"], "error",
     "--speed-tolerance"),
    ("calibrate-threads-2-to-40", ["calibrate", "--device", "cpu", "--threads", str(2**40)], "error", "--threads"),
    ("calibrate-repeats-10-to-30", ["calibrate", "--device", "cpu", "--repeats", BIG], "error", "--repeats"),
    ("calibrate-warmup-10-to-30", ["calibrate", "--device", "cpu", "--warmup", BIG], "error", "--warmup"),
    ("calibrate-nproc-2-to-40", ["calibrate", "--device", "cpu", "--nproc", str(2**40)], "error", "--nproc"),
    ("calibrate-min-time-nan", ["calibrate", "--device", "cpu", "--min-time", "nan"], "error", "--min-time"),
    ("calibrate-min-time-inf", ["calibrate", "--device", "cpu", "--min-time", "inf"], "error", "--min-time"),
    ("calibrate-max-bytes-huge", ["calibrate", "--device", "cpu", "--max-bytes", "1e30GiB"], "error", "--max-bytes"),
    ("calibrate-max-bytes-word", ["calibrate", "--device", "cpu", "--max-bytes", "lots"], "error", "--max-bytes"),
]


@pytest.mark.parametrize("argv,expect,needle", [c[1:] for c in NUMBER_CASES], ids=[c[0] for c in NUMBER_CASES])
def test_numbers(perfsim, tmp_path, monkeypatch, argv, expect, needle):
    monkeypatch.chdir(tmp_path)  # the charts' --out x.html
    check(perfsim(*argv), expect, needle)


# --- files perfsim writes ------------------------------------------------------------------------

@pytest.fixture
def places(tmp_path):
    """name -> a path that is not a regular file perfsim may write (named .html for the charts)."""
    d = str(tmp_path)
    os.mkfifo(os.path.join(d, "fifo.html"))
    os.mkdir(os.path.join(d, "dir.html"))
    return {"fifo": os.path.join(d, "fifo.html"), "directory": os.path.join(d, "dir.html"), "dev-null": "/dev/null",
            "no-folder": os.path.join(d, "missing", "x.html"), "empty": ""}


def _writers():
    """flag -> argv that writes `path`."""
    chart = ["chart", "breakdown", *PREDICT, "--devices", "8", "--tp", "8", "--pp", "1", "--top", "0"]
    return {
        "chart-out": lambda p: [*chart, "--out", p],
        "report-out": lambda p: ["report", *PREDICT, "--devices", "8", "--out", p],
        "simulate-html": lambda p: ["simulate", *PREDICT, "--devices", "1", "--html", p],
        "simulate-trace": lambda p: ["simulate", *PREDICT, "--devices", "1", "--trace", p],
        "calibrate-fit-out": lambda p: ["calibrate", "--fit", os.path.join(HWPROFILES, "ledgers", "calibration-cpu.jsonl"),
                                        "--system", "cpu-example", "--out", p],
        "validate-emit-slurm": lambda p: ["validate", "--emit-slurm", p, "--nodes", "1"],
        "calibrate-emit-slurm": lambda p: ["calibrate", "--emit-slurm", p, "--nodes", "1"],
    }


@pytest.mark.parametrize("place", ["fifo", "directory", "dev-null", "no-folder", "empty"])
@pytest.mark.parametrize("writer", list(_writers()))
def test_only_regular_files_are_written(perfsim, places, tmp_path, monkeypatch, writer, place):
    monkeypatch.chdir(tmp_path)  # nothing lands in the checkout if a case wrongly succeeds
    path = places[place]
    before = os.stat(path).st_mode if os.path.exists(path) else None
    check(perfsim(*_writers()[writer](path)))
    if before is not None:
        assert os.stat(path).st_mode == before  # /dev/null keeps its permissions, a FIFO its kind


@pytest.mark.parametrize("writer", ["validate-emit-slurm", "calibrate-emit-slurm"])
def test_emit_slurm_leaves_an_existing_file_s_permissions(perfsim, tmp_path, monkeypatch, writer):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.sbatch"
    path.write_text("old\n")
    path.chmod(0o640)
    check(perfsim(*_writers()[writer](str(path))), "ok")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and path.read_text() != "old\n"
    fresh = tmp_path / "new.sbatch"
    check(perfsim(*_writers()[writer](str(fresh))), "ok")
    assert os.access(fresh, os.X_OK)  # a script perfsim created is executable


# --- the command line itself -------------------------------------------------------------------

ARGV_CASES = [
    ("no-command", []),
    ("unknown-command", ["frobnicate"]),
    ("megabyte-flag-value", ["predict", "--tp-mode", "x" * 1_000_000]),
    ("megabyte-model", ["predict", "--model", "x" * 1_000_000]),
    ("nul-in-system", ["predict", "--system", "a\0b"]),
    ("nul-in-system-path", ["predict", "--system", "/tmp/a\0b.toml"]),
    ("order-garbage", ["predict", *PREDICT, "--devices", "8", "--order", "tp-tp-tp"]),
    ("tp-axes-garbage", ["predict", *PREDICT, "--devices", "8", "--tp", "8", "--tp-axes", "x-y-z"]),
    ("unicode-preset", ["predict", "--model", "gpt3-１２５m"]),
    ("pp-layout-garbage", ["predict", *PREDICT, "--devices", "2", "--pp", "2", "--pp-layout", "E(t|)*1e9L"]),
    ("pp-layout-megabyte", ["predict", *PREDICT, "--devices", "2", "--pp", "2", "--pp-layout", "t" * 1_000_000]),
    ("pp-layout-repeats-beyond-memory", ["predict", *PREDICT, "--devices", "2", "--pp", "2", "--pp-layout",
                                         "E(t*9999999|)*9999999L"]),
    ("pp-layout-with-counts", ["predict", *PREDICT, "--devices", "2", "--pp", "2", "--pp-layout", "Et*6|t*6L",
                               "--first-stage-layers", "6"]),
    ("validate-plans-garbage", ["validate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--plans", "tp=two"]),
    ("validate-plans-empty", ["validate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--plans", ";;"]),
    ("partition-with-a-newline", ["validate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--partition",
                                  "general\nrm -rf ~"]),
    ("account-with-a-space", ["calibrate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--account", "pn12 ab"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in ARGV_CASES], ids=[c[0] for c in ARGV_CASES])
def test_argv(perfsim, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    check(perfsim(*argv))


def test_the_suite_has_150_cases():
    table = (len(BAD_FILES) * len(READERS) + len(PROFILE_CASES) + len(MODEL_FILE_CASES) + len(INLINE_CASES)
             + len(LEDGER_LINES) + 12 + len(STEP_CHANGES) + len(LOG_CASES) + len(NUMBER_CASES) + 5 * len(_writers())
             + len(ARGV_CASES))
    assert table >= 150


# --- generated input, fed to the readers themselves --------------------------------------------

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)


@FAST
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_model_file(tmp_path_factory, data):
    from perfsim.spec.model import load_model

    path = tmp_path_factory.mktemp("bytes") / "m.toml"
    path.write_bytes(data)
    with time_limit(CASE_SECONDS):
        try:
            load_model(str(path))
        except PerfsimError:
            pass  # the command line prints it as one line (perfsim.errors.one_line)


def _mutations(record: dict):
    """Every way one field of `record` may be dropped or replaced: (path, key) pairs."""
    for key, value in record.items():
        yield (record, key)
        if isinstance(value, dict):
            yield from _mutations(value)


@settings(FAST, max_examples=20)
@given(which=st.integers(min_value=0), value=JSON, drop=st.booleans(), suite=st.sampled_from(
    ["gemm", "memory", "collective", "attention", "tp_overhead"]))
def test_a_record_the_reader_accepts_never_breaks_the_fit(tmp_path_factory, base_records, which, value, drop, suite):
    """One field of a real record dropped or replaced by any JSON value: the reader either skips
    the line or hands the record on, and then the fit and the validation chart take it."""
    from perfsim import calibrate as cal
    from perfsim.charts import validation
    from perfsim.spec.system import load_system

    record = _a(suite, base_records)
    record["key"] = "generated"
    places = list(_mutations(record))
    parent, key = places[which % len(places)]
    if drop:
        del parent[key]
    else:
        parent[key] = value
    path = tmp_path_factory.mktemp("ledger") / "l.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in base_records + [record]))
    with time_limit(CASE_SECONDS):
        records, problems = cal.read_ledger(str(path))
        assert len(records) + len(problems) == len(base_records) + 1
        try:
            cal.fit(records, load_system("cpu-example"), "l.jsonl")
            validation.load(str(path), load_system("cpu-calibrated"), warn=lambda m: None)
        except PerfsimError:
            pass


@FAST
@given(line=st.text(max_size=200))
def test_any_line_of_a_ledger(tmp_path_factory, line):
    from perfsim.ledger import parse_line

    with time_limit(CASE_SECONDS):
        record, why = parse_line(line.encode("utf-8", "surrogatepass"))
    assert (record is None) != (why is None) or (record is None and why is None and line.strip() == "null")


@FAST
@given(section=st.sampled_from(["device", "node", "network", "collectives", "framework"]), key=st.text(max_size=12),
       value=JSON, part=st.sampled_from(["value", "provenance", "source", "range", "distribution", "causes", None]))
def test_any_profile_edit(section, key, value, part):
    """A real profile with one key of a section replaced or added: a System or a PerfsimError."""
    from perfsim.spec._toml import tomllib
    from perfsim.spec.system import parse_system

    with open(os.path.join(HWPROFILES, "cpu-example.toml"), "rb") as fh:
        data = tomllib.load(fh)
    keys = list(data[section])
    name = keys[len(key) % len(keys)] if part else key
    if part and isinstance(data[section][name], dict):
        data[section][name][part] = value
    else:
        data[section][name] = value
    with time_limit(CASE_SECONDS):
        try:
            parse_system(data, "generated profile")
        except PerfsimError:
            pass


@FAST
@given(ms=st.one_of(st.floats(), st.text(max_size=10)), tflops=st.one_of(st.floats(), st.text(max_size=10)),
       batch=st.one_of(st.integers(), st.text(max_size=10)))
@example(ms=5e-324, tflops=0.0, batch=1)  # positive, but 0 s once in seconds (found by hypothesis)
def test_any_numbers_in_a_megatron_log(ms, tflops, batch):
    from perfsim.megatron_log import parse_lines

    lines = [_log_line(10), _log_line(20, ms=str(ms), tflops=str(tflops), batch=str(batch))]
    with time_limit(CASE_SECONDS):
        try:
            summary = parse_lines(lines)
        except PerfsimError:
            return
    assert all(0 < t <= 86400 and math.isfinite(t) for t in summary.step_times_s)


@FAST
@given(flag=st.sampled_from(["--tp", "--cp", "--pp", "--dp", "--mbs", "--gbs", "--devices", "--nodes", "--vpp",
                             "--tp-depth"]),
       number=st.one_of(st.integers(-10, 5000), st.integers(min_value=2**20 + 1), st.text(max_size=12)))
def test_any_number_for_a_plan_flag(capsys, flag, number):
    argv = ["predict", *PREDICT, flag, str(number)]
    if flag not in ("--devices", "--nodes"):
        argv += ["--devices", "8"]
    capsys.readouterr()
    with time_limit(CASE_SECONDS):
        code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code in (0, 2) and "Traceback" not in err
    assert (code == 0 and err == "") or (len(err.splitlines()) == 1 and ERROR.match(err))
