"""The charts without a browser: every figure has data, a title and axis titles; the what-if
precomputation picks the search's best plan at 1x; the heatmap's cells agree with the search; the
pages are self-contained and small; bad input is one line and exit status 2; and nothing on the
predict path imports plotly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ledger_sample import synthetic_ledger
from perfsim import cli
from perfsim.predict import predict
from perfsim.search import parse_fixes, search
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

# A small case with cells of every kind on the tp x pp heatmap (plans that fit, plans too big,
# no valid plan) that searches in a fraction of a second.
MODEL, SYSTEM, NODES, GBS = "smng-p2-20b", "smng-p2", 2, 16
FIXES = {"order": {"tp-dp-pp"}, "zero": {0}}
CASE = ["--model", MODEL, "--system", SYSTEM, "--nodes", str(NODES), "--gbs", str(GBS), "--tp", "4", "--pp", "4",
        "--fix", "order=tp-dp-pp", "--fix", "zero=0"]


@pytest.fixture(scope="module")
def case():
    model, system = load_model(MODEL), load_system(SYSTEM)
    return model, system, NODES * system.node.devices_per_node


def _titled(fig):
    text = fig.layout.title.text or ""
    assert len(text) > 20, "a figure needs a title a reader understands"
    axes = [a for name in dir(fig.layout) if name.startswith(("xaxis", "yaxis"))
            for a in [getattr(fig.layout, name)] if a is not None]
    titled = [a.title.text for a in axes if a.title is not None and a.title.text]
    assert len(titled) >= 2, f"axis titles missing: {titled}"
    return text, titled


def _has_data(fig):
    counts = []
    for trace in fig.data:
        for key in ("x", "y", "z"):
            values = getattr(trace, key, None)
            if values is not None:
                flat = np.array(values, dtype=object).ravel()
                counts.append(sum(v is not None for v in flat))
    assert fig.data and max(counts) > 0


def test_whatif_at_1x_picks_the_search_best_and_moves_sensibly(case):
    from perfsim.charts import whatif

    model, system, devices = case
    fixes = {"order": {"tp-dp-pp"}, "recompute": {"full", "none"}}
    data = whatif.precompute(model, system, devices, GBS, fixes, multipliers=(0.25, 0.5, 1.0, 2.0, 4.0))
    best = search(model, system, devices, GBS, fixes, top=3).plans[0]
    home = data.multipliers.index(1.0)
    for knob in whatif.KNOBS:
        one = data.best[knob][home]
        assert one.tokens_per_s == pytest.approx(best.tokens_per_s, rel=1e-12)
        assert one.plan == best.plan or one.tokens_per_s == best.tokens_per_s
    # the shown numbers are predict's numbers for the plan shown
    moved = data.best["flops"][data.multipliers.index(2.0)]
    direct = predict(model, whatif.scaled_system(system, flops=2.0), moved.plan)
    assert moved.tokens_per_s == pytest.approx(direct.tokens_per_s, rel=1e-9)
    assert moved.breakdown_s == pytest.approx(direct.time_breakdown_s, rel=1e-9)
    # better hardware never lowers the best throughput; more memory never either
    for knob in ("flops", "hbm", "intra", "inter", "memory"):
        speeds = [b.tokens_per_s for b in data.best[knob] if b is not None]
        assert speeds == sorted(speeds), knob
    latency = [b.tokens_per_s for b in data.best["latency"]]
    assert latency == sorted(latency, reverse=True)
    # under a smaller memory the plan shown fits in it
    for m, b in zip(data.multipliers, data.best["memory"]):
        assert b is None or b.memory_bytes <= system.device.memory_bytes * m


def test_device_knobs_in_one_call_equal_one_call_per_setting(case):
    from perfsim.charts import whatif
    from perfsim.charts.space import evaluate_pool, plan_pool

    model, system, devices = case
    groups, _ = plan_pool(model, system, devices, GBS, FIXES, keep=50)
    for knob in whatif.DEVICE_KNOBS:
        stacked = whatif.evaluate_device_knob(model, system, groups, knob, [0.5, 3.0], "bf16")
        for m, results in zip((0.5, 3.0), stacked):
            one = evaluate_pool(model, whatif.scaled_system(system, **{knob: m}), groups)
            for a, b in zip(one, results):
                assert np.array_equal(np.broadcast_to(a["tokens_per_s"], b["tokens_per_s"].shape), b["tokens_per_s"])
                for term, value in a["time_breakdown_s"].items():
                    assert np.allclose(np.broadcast_to(value, b["time_breakdown_s"][term].shape),
                                       b["time_breakdown_s"][term], rtol=0, atol=0)


@pytest.mark.parametrize("model_name, nodes, gbs", [(MODEL, NODES, GBS), ("smng-p2-3.6b", 1, 32)])
def test_whatif_skipping_groups_changes_nothing(model_name, nodes, gbs):
    from perfsim.charts import whatif

    model, system = load_model(model_name), load_system(SYSTEM)
    fixes = {"order": {"tp-dp-pp", "dp-tp-pp"}}
    args = (model, system, nodes * system.node.devices_per_node, gbs, fixes)
    mults = (0.25, 0.5, 1.0, 1.5, 4.0)
    fast = whatif.precompute(*args, multipliers=mults, prune=True)
    full = whatif.precompute(*args, multipliers=mults, prune=False)
    for table in ("best", "baseline"):
        for knob in whatif.KNOBS:
            a = [(b.plan, b.tokens_per_s, b.breakdown_s) if b else None for b in getattr(fast, table)[knob]]
            b = [(b.plan, b.tokens_per_s, b.breakdown_s) if b else None for b in getattr(full, table)[knob]]
            assert a == b, (table, knob)


def test_whatif_on_the_builtin_case_agrees_with_search():
    from perfsim.charts import whatif

    model, system = load_model("gpt3-175b"), load_system("smng-p2")
    fixes = {"order": {"tp-dp-pp"}, "tp_mode": {"1d"}}
    data = whatif.precompute(model, system, 128, 300, fixes, multipliers=(1.0, 2.0), knobs=("inter",))
    best = search(model, system, 128, 300, fixes, top=1).plans[0]
    assert data.best["inter"][0].plan == best.plan


def test_scaled_system_scales_what_each_knob_names():
    from perfsim.charts.whatif import scaled_system

    s = load_system("smng-p2")
    t = scaled_system(s, flops=2, hbm=3, intra=4, inter=5, latency=0.5, memory=1.5)
    assert t.device.peak_flops_bf16 == 2 * s.device.peak_flops_bf16 and t.device.peak_flops_fp32 == 2 * s.device.peak_flops_fp32
    assert t.device.memory_bandwidth_Bps == 3 * s.device.memory_bandwidth_Bps
    assert t.node.card_link_bandwidth_Bps == 4 * s.node.card_link_bandwidth_Bps
    assert t.node.node_link_bandwidth_Bps == 4 * s.node.node_link_bandwidth_Bps
    assert t.network.nic_bandwidth_Bps == 5 * s.network.nic_bandwidth_Bps
    assert t.network.latency_s == 0.5 * s.network.latency_s and t.node.node_link_latency_s == 0.5 * s.node.node_link_latency_s
    assert t.device.memory_bytes == 1.5 * s.device.memory_bytes
    assert t.collectives == s.collectives and t.framework == s.framework
    assert scaled_system(s) == s


def test_whatif_figure_has_sliders_data_and_titles(case):
    from perfsim.charts import whatif

    model, system, devices = case
    fig = whatif.figure(model, system, devices, GBS, FIXES, multipliers=(0.5, 1.0, 2.0))
    _has_data(fig)
    text, axes = _titled(fig)
    assert "What if" in text and "Precomputed" in text
    assert "best throughput (tokens/s)" in axes
    assert len(fig.layout.sliders) == len(whatif.KNOBS)
    for slider in fig.layout.sliders:
        assert [s.label for s in slider.steps] == ["0.5x", "1x", "2x"]
        assert slider.steps[slider.active].label == "1x"


def test_heatmap_cells_agree_with_search_and_say_why(case):
    from perfsim.charts import heatmap
    from perfsim.charts.space import sweep

    model, system, devices = case
    grid = heatmap.Grid("tp", "pp")
    # even splits only: the 44 layers on 8 or 16 stages then leave cells with no valid plan (an
    # uneven split would pipeline them, docs/equations.md 9.4)
    fixes = FIXES | parse_fixes(["first_stage_layers=0", "last_stage_layers=0"])
    sweep(model, system, devices, GBS, fixes, "bf16", [grid])
    best = search(model, system, devices, GBS, fixes, top=1).plans[0]
    top = max((c.best for c in grid.cells.values() if c.best), key=lambda b: b[0])
    assert top[0] == pytest.approx(best.tokens_per_s, rel=1e-12)
    cell = grid.cells[(best.plan.tp, best.plan.pp)]
    assert cell.best[0] == pytest.approx(best.tokens_per_s, rel=1e-12)
    fig = heatmap.figure(model, system, devices, GBS, grid=grid)
    _has_data(fig)
    _titled(fig)
    hovers = [h for trace in fig.data if trace.type == "heatmap" for row in trace.text for h in row if h]
    assert any("does not fit" in h and "GiB" in h for h in hovers)
    assert any("no valid plan" in h for h in hovers)
    assert any("does not divide the 16 devices" in h for h in hovers)
    assert any("tokens/s" in h for h in hovers)


def test_heatmap_other_knobs(case):
    from perfsim.charts import heatmap

    model, system, devices = case
    fig = heatmap.figure(model, system, devices, GBS, "recompute", "tp_mode", FIXES)
    labels = {v for trace in fig.data if trace.type == "heatmap" for v in trace.x}
    assert labels <= {"none", "selective", "full"} and labels
    with pytest.raises(Exception, match="two different knobs"):
        heatmap.Grid("tp", "tp")


def test_scaling_figure_overlays_the_published_points():
    from perfsim.charts import scaling

    fig = scaling.smng_figure()
    _has_data(fig)
    text, axes = _titled(fig)
    assert "scaling efficiency (%)" in axes and "nodes (log scale)" in axes
    published = [t for t in fig.data if "published" in (t.name or "")]
    assert {t.name.split()[0] for t in published} == {"weak", "strong"}
    weak = next(t for t in published if t.name.startswith("weak"))
    assert list(weak.x) == [16, 128] and list(weak.y) == pytest.approx([100, 93])
    predicted = next(t for t in fig.data if t.name == "weak scaling, perfsim")
    assert list(predicted.x) == [16, 32, 64, 128] and predicted.y[0] == pytest.approx(100)


def test_scaling_for_another_case_says_there_are_no_published_points(case):
    from perfsim.charts import scaling

    model, system, _ = case
    fig = scaling.figure(model, system, Plan(tp=4, pp=4, dp=1, mbs=1, gbs=16), [2, 4, 8], strong_gbs=16)
    assert "No published points" in fig.layout.title.text
    assert not [t for t in fig.data if "published" in (t.name or "")]


def test_memory_and_breakdown_figures(case):
    from perfsim.charts import breakdown, memory
    from perfsim.charts.plans import plan_set

    model, system, devices = case
    plan = Plan(tp=4, pp=4, dp=1, mbs=1, gbs=GBS)
    plans, note = plan_set(model, system, plan, devices, GBS, 3, FIXES)
    assert plans[0][0].startswith("your plan") and len(plans) >= 3
    for module in (memory, breakdown):
        fig = module.figure(model, system, plans, note)
        _has_data(fig)
        _titled(fig)
    fig = breakdown.figure(model, system, plans)
    bars = [t for t in fig.data if t.type == "bar"]
    total = sum(t.x[0] for t in bars)
    assert total == pytest.approx(plans[0][1].step_time_s, rel=1e-9)  # the segments add up to the step
    fig = memory.figure(model, system, plans)
    bars = [t for t in fig.data if t.type == "bar"]
    assert sum(t.x[0] for t in bars) * 2**30 == pytest.approx(plans[0][1].memory_bytes["total"], rel=1e-9)
    assert any("device memory" in (a.text or "") for a in fig.layout.annotations)


def test_timeline_figure_wraps_the_simulator(case):
    from perfsim.charts import timeline

    model, system, _ = case
    fig = timeline.figure(model, system, Plan(tp=4, pp=4, dp=1, mbs=1, gbs=GBS))
    _has_data(fig)
    text, axes = _titled(fig)
    assert "time in the step (s)" in axes and "Simulated step" in text
    assert any("compute" in (t.name or "") for t in fig.data)


def test_validation_figure_reads_the_ledger(tmp_path):
    from perfsim.charts import validation

    system = load_system("smng-p2")
    path = tmp_path / "ledger.jsonl"
    truth = synthetic_ledger(path, system)
    records, measured, predicted, note = validation.load(str(path), system)
    assert len(records) == len(truth) == 9
    assert list(predicted) == pytest.approx(truth, rel=1e-9)
    assert "attention" in note and "damaged" in note
    fig = validation.figure(str(path), system)
    _has_data(fig)
    text, axes = _titled(fig)
    assert "predicted time (s)" in axes and "measured time (s)" in axes
    assert "within +-10%" in text
    errors = [y for t in fig.data if t.xaxis == "x2" and t.mode == "markers" for y in t.y]
    assert len(errors) == 9 and all(4 < abs(e) < 6.5 for e in errors)  # the ledger's +-5%
    with pytest.raises(Exception, match="no record with both"):
        validation.load(str(path), None)


def test_validation_measures_as_calibrate_fits():
    from perfsim.charts.validation import measured_time

    r = {"stats": {"median_s": 2.0, "min_s": 1.0, "mean_s": 2.5}, "cpu_stats": {"median_s": 0.8, "min_s": 0.5,
                                                                                "mean_s": 0.9}}
    # calibrate's default prices every call at its mean (CPU time where recorded), collectives too
    assert measured_time(r) == 0.9 and measured_time(dict(r, suite="collective")) == 0.9
    assert measured_time(r, "min") == 0.5
    assert measured_time(r, "min", "wall") == 1.0
    assert measured_time(r, "median", "wall") == 2.0
    assert measured_time({"stats": {"median_s": 3.0}}, "p25") == 3.0  # missing statistic: the median


# --- the command line -----------------------------------------------------------------------

def _external_resources(page: str) -> list:
    """src/href attributes of the page's own tags (script contents are not parsed as tags)."""
    from html.parser import HTMLParser

    found = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(f"{tag} {k}={v}" for k, v in attrs if k in ("src", "href") and v)

    Parser().feed(page)
    return found


def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["whatif", "heatmap", "scaling", "memory", "breakdown", "timeline"])
def test_chart_command_writes_a_self_contained_page(kind, tmp_path, capsys):
    out = tmp_path / f"{kind}.html"
    code, stdout, err = _run(["chart", kind, *CASE, "--top", "2", "--node-counts", "2,4,8", "--out", str(out)], capsys)
    assert code == 0, err
    assert f"wrote the {kind} chart" in stdout
    text = out.read_text()
    assert out.stat().st_size < 10e6
    assert not _external_resources(text)  # plotly.js is inside the page: nothing to fetch
    assert "Plotly.newPlot" in text and text.count("plotly.js v") >= 1


def test_validation_command_and_report(tmp_path, capsys):
    ledger = tmp_path / "ledger.jsonl"
    synthetic_ledger(ledger, load_system("smng-p2"))
    out = tmp_path / "validation.html"
    code, stdout, err = _run(["chart", "validation", "--system", "smng-p2", "--ledger", str(ledger), "--out", str(out)],
                             capsys)
    assert code == 0, err
    report = tmp_path / "report.html"
    code, stdout, err = _run(["report", *CASE, "--top", "2", "--node-counts", "2,4", "--ledger", str(ledger),
                              "--samples", "32", "--out", str(report)], capsys)
    assert code == 0, err
    assert "8 of 8 charts drawn" in stdout  # with the uncertainty section (on by default)
    text = report.read_text()
    assert text.count("Plotly.newPlot") == 8 and report.stat().st_size < 10e6
    assert text.count("plotly.js v") == 1  # the library once, shared by every chart


@pytest.mark.parametrize("argv, message", [
    (["chart", "pie", "--out", "x.html"], "invalid choice: 'pie'"),
    (["chart", "heatmap", "--x", "colour", "--out", "x.html"], "invalid choice: 'colour'"),
    (["chart", "validation", "--out", "x.html"], "needs --ledger"),
    (["chart", "memory", "--out", "/no/such/folder/x.html"], "does not exist"),
    (["chart", "memory", "--out", "x.png"], ".html"),
    (["chart", "scaling", "--model", MODEL, "--nodes", "2", "--node-counts", "2,x", "--out", "x.html"], "comma-separated"),
    (["chart", "validation", "--ledger", "/no/such/ledger.jsonl", "--out", "x.html"], "does not exist"),
    (["chart", "whatif", "--model", "gpt3-175b", "--nodes", "1", "--gbs", "8", "--out", "x.html"], "fits"),
    (["chart", "heatmap", "--fix", "tp=banana", "--out", "x.html"], "whole numbers"),
    (["report", "--model", MODEL, "--nodes", "2", "--tp", "3", "--out", "x.html"], "not a multiple"),
    (["chart", "memory"], "required: --out"),
    (["chart", "scaling", "--samples", "64", "--out", "x.html"], "give --uncertainty too"),
    (["report", "--no-uncertainty", "--samples", "64", "--out", "x.html"], "leave out --no-uncertainty"),
    (["chart", "breakdown", "--uncertainty", "--samples", "8", "--out", "x.html"], "--samples"),
    (["scale", "--weak", "--samples", "64"], "give --uncertainty too"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert err.startswith("perfsim: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not list(tmp_path.glob("*.html"))


def test_predict_and_search_never_import_plotly():
    code = ("import sys; from perfsim import cli; cli.main(['predict', '--json']); "
            "cli.main(['search', '--model', 'smng-p2-3.6b', '--system', 'smng-p2', '--nodes', '1', '--gbs', '8', "
            "'--quiet', '--top', '1']); "
            "assert 'plotly' not in sys.modules, 'plotly imported'; print('clean')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("clean")
