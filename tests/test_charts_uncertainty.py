"""Uncertainty in the charts and the report (issue 16 item 6): the scaling chart's P10-P90 bands
are those of whole curves (each draw's efficiency against its own first point) and hold the point
curve on a profile without observations; the breakdown's error bars are predict --uncertainty's
percentiles placed on their segments; the what-if page shows its 1x best plan's spread and
P(best); the report's section prints the numbers predict --uncertainty --json and
perfsim.uncertainty.robust.robust_ranking give. Wrong uncertainty flags are among
tests/test_charts.py's one-line errors."""

from __future__ import annotations

import html
import json
import re

import numpy as np
import pytest

from perfsim import cli
from perfsim.charts._common import TERM_LABELS
from perfsim.cost.columns import columns_of
from perfsim.predict import predict
from perfsim.search import search
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system
from perfsim.uncertainty.posterior import profile_draws
from perfsim.uncertainty.predict import predict_uncertainty
from perfsim.uncertainty.robust import CANDIDATES, robust_ranking
from perfsim.uncertainty.sampling import evaluate_draws

SAMPLES = 32  # few draws: these tests check where the numbers go, not how many draws they need
# The small smng-p2 case of tests/test_charts.py (smng-p2 names observations: the draws are a posterior).
MODEL, SYSTEM, NODES, GBS = "smng-p2-20b", "smng-p2", 2, 16
CASE = ["--model", MODEL, "--system", SYSTEM, "--nodes", str(NODES), "--gbs", str(GBS), "--tp", "4", "--pp", "4",
        "--fix", "order=tp-dp-pp", "--fix", "zero=0"]


def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _band(fig, mode: str) -> tuple:
    """(P10 edge, P90 edge, point curve) of one mode on the scaling chart, in percent."""
    names = [t.name for t in fig.data]
    upper = names.index(f"{mode} scaling, P10-P90 over the draws")
    return (np.array(fig.data[upper - 1].y), np.array(fig.data[upper].y),
            np.array(next(t.y for t in fig.data if t.name == f"{mode} scaling, perfsim")))


def test_scaling_bands_are_whole_curves_and_hold_the_point_curve():
    from perfsim.charts import scaling
    from perfsim.scaling import scale

    model, system = load_model("sc21-7.5b"), load_system("dgx-a100")  # no observations: the prior
    base, nodes = Plan(tp=4, pp=1, dp=2, mbs=1, gbs=64), [1, 2, 4, 8]
    fig = scaling.figure(model, system, base, nodes, strong_gbs=64, samples=SAMPLES)
    draws, _ = profile_draws(system, SAMPLES)
    for mode in ("weak", "strong"):
        low, high, point = _band(fig, mode)
        assert low[0] == high[0] == pytest.approx(100)  # every draw is 100% at its own first point
        assert np.all(low[1:] < high[1:])
        # The point prediction takes each number's value, inside every range: its curve lies in the band.
        assert np.all(low <= point + 1e-9) and np.all(point <= high + 1e-9), (low, point, high)
        # Recomputed draw by draw, one plan at a time: each draw's efficiency against its own first point.
        points = scale(model, system, base, nodes, weak=(mode == "weak"))
        steps = np.array([evaluate_draws(model, draws, columns_of(p.prediction.plan))["step_time_s"] for p in points])
        ratio = np.ones(len(nodes)) if mode == "weak" else nodes[0] / np.array(nodes, float)
        efficiency = 100 * steps[0] * ratio[:, None] / steps
        assert low == pytest.approx(np.percentile(efficiency, 10, axis=1), rel=1e-6)
        assert high == pytest.approx(np.percentile(efficiency, 90, axis=1), rel=1e-6)


def test_scale_uncertainty_json_orders_its_percentiles(run_cli):
    argv = ["scale", "--model", "sc21-7.5b", "--system", "dgx-a100", "--tp", "4", "--mbs", "1", "--gbs", "64",
            "--nodes", "1,2,4", "--strong", "--uncertainty", "--samples", str(SAMPLES), "--json"]
    r = run_cli(*argv)
    assert r.code == 0, r.err
    points = r.json()["points"]
    assert points[0]["uncertainty"]["efficiency"] == {"p10": 1.0, "p50": 1.0, "p90": 1.0}
    for p in points:
        u = p["uncertainty"]
        assert u["samples"] == SAMPLES
        for q in (u["step_time_s"], u["efficiency"]):
            assert q["p10"] <= q["p50"] <= q["p90"]
    assert points[-1]["uncertainty"]["efficiency"]["p10"] < 1  # strong scaling loses efficiency in every draw
    assert "uncertainty" not in run_cli(*argv[:-4], "--json").json()["points"][0]


def test_breakdown_error_bars_are_predict_uncertainty_percentiles_on_their_segments():
    from perfsim.charts import breakdown
    from perfsim.charts.plans import plan_set

    model, system = load_model(MODEL), load_system(SYSTEM)
    plans, _ = plan_set(model, system, Plan(tp=4, pp=4, dp=1, mbs=1, gbs=GBS), top=0)
    fig = breakdown.figure(model, system, plans, samples=SAMPLES)
    summary, _ = predict_uncertainty(model, system, plans[0][1].plan, SAMPLES)
    point = plans[0][1].time_breakdown_s
    bars = [t for t in fig.data if t.type == "scatter" and t.error_x is not None and t.error_x.array is not None]
    assert bars and bars[0].showlegend and not any(t.showlegend for t in bars[1:])
    starts = dict(zip(point, np.cumsum([0.0] + list(point.values()))[:-1]))
    shown = set()
    for t in bars:
        term = next(k for k in point if t.hovertext[0].startswith(breakdown.TERM_LABELS[k] + ":"))
        q = summary["time_breakdown_s"][term]
        assert q["p10"] <= q["p50"] <= q["p90"]
        assert t.x[0] - t.error_x.arrayminus[0] == pytest.approx(starts[term] + q["p10"], rel=1e-9)
        assert t.x[0] == pytest.approx(starts[term] + q["p50"], rel=1e-9)
        assert t.x[0] + t.error_x.array[0] == pytest.approx(starts[term] + q["p90"], rel=1e-9)
        shown.add(term)
    assert "compute" in shown
    label = next(t for t in fig.data if t.type == "scatter" and t.mode == "text").text[0]
    s = summary["step_time_s"]
    assert f"P10-P90 {s['p10']:.2f}-{s['p90']:.2f} s" in label
    assert f"{SAMPLES} draws of the posterior" in fig.layout.title.text


def test_whatif_shows_the_1x_best_plans_spread_and_p_best():
    from perfsim.charts import robustness, whatif

    model, system = load_model(MODEL), load_system(SYSTEM)
    devices = NODES * system.node.devices_per_node
    data = whatif.precompute(model, system, devices, GBS, {"order": {"tp-dp-pp"}, "zero": {0}}, keep=50)
    one = data.best["flops"][data.multipliers.index(1.0)]
    assert data.leaders[0] == one.plan  # the 1x best is the fastest of the candidates
    fig = whatif.figure(model, system, devices, GBS, data=data, samples=SAMPLES, robust_samples=SAMPLES)
    summary, _ = predict_uncertainty(model, system, one.plan, SAMPLES)
    q = summary["tokens_per_s"]
    spread = next(t for t in fig.data if (t.name or "").startswith("1x best plan: P10-P90"))
    assert spread.y[0] == pytest.approx(q["p50"]) and spread.y[0] + spread.error_y.array[0] == pytest.approx(q["p90"])
    assert spread.y[0] - spread.error_y.arrayminus[0] == pytest.approx(q["p10"])
    ranked, _ = robust_ranking(model, system, [predict(model, system, p) for p in data.leaders], SAMPLES)
    mine = robustness.find(ranked, one.plan)
    box = fig.layout.annotations[-1].text
    assert f"fastest in {mine.p_best:.0%} of the draws and within 5% of the fastest in {mine.p_within_5pct:.0%}" in box
    moved = fig.layout.sliders[0].steps[-1].args[1]
    assert not any("fastest in" in v for v in moved.values() if isinstance(v, str))  # away from 1x: no 1x odds
    plain = whatif.figure(model, system, devices, GBS, data=data)
    assert len(plain.data) == len(fig.data) - 1 and "fastest in" not in plain.layout.annotations[-1].text


def _notes(page: str, heading: str) -> str:
    start = page.index(f"<h2>{heading}</h2>")
    section = page[start:page.index("</section>", start)]
    return " ".join(html.unescape(p) for p in re.findall(r'<p class="note">(.*?)</p>', section, re.S))


def _flags(plan: dict) -> list:
    """perfsim predict's flags for a plan object of --json."""
    out = []
    for key, value in plan.items():
        name = key.replace("_", "-")
        if value is True:
            out.append(f"--{name}")
        elif value is False:
            out += [f"--no-{name}"] if key in ("dp_overlap", "tp_overlap") else []
        elif not (key.endswith("stage_layers") and value == 0) and not (key == "pp_layout" and value == ""):
            out.append(f"--{name}={value}")
    return out


def test_report_section_prints_what_predict_and_robust_ranking_give(tmp_path, capsys):
    from perfsim.uncertainty.robust import verdict

    out = tmp_path / "report.html"
    # No plan flags beyond the case: the report's plan is the search's best, and the plans it ranks
    # over the draws are the search's best CANDIDATES (yours among them).
    case = ["--model", MODEL, "--system", SYSTEM, "--nodes", str(NODES), "--gbs", str(GBS), "--fix", "order=tp-dp-pp",
            "--fix", "zero=0"]
    code, stdout, err = _run(["report", *case, "--samples", str(SAMPLES), "--node-counts", "2,4", "--out", str(out)],
                             capsys)
    assert code == 0, err
    assert "7 of 8 charts drawn" in stdout  # all but predictions against measurements (no ledger)
    notes = _notes(out.read_text(), "How sure is this prediction")
    model, system = load_model(MODEL), load_system(SYSTEM)
    found = search(model, system, NODES * system.node.devices_per_node, GBS, {"order": {"tp-dp-pp"}, "zero": {0}},
                   top=CANDIDATES)
    plan = found.plans[0].plan.as_dict()  # the report's plan
    code, stdout, err = _run(["predict", "--model", MODEL, "--system", SYSTEM, "--nodes", str(NODES), *_flags(plan),
                              "--uncertainty", "--samples", str(SAMPLES), "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["plan"] == plan
    u = json.loads(stdout)["uncertainty"]
    q = u["step_time_s"]
    assert q["p10"] <= q["p50"] <= q["p90"]
    assert f"step time P10 {q['p10']:.4g} s .. P50 {q['p50']:.4g} s .. P90 {q['p90']:.4g} s" in notes, notes
    t = u["tokens_per_s"]
    assert f"throughput P10 {t['p10']:,.0f} .. P50 {t['p50']:,.0f} .. P90 {t['p90']:,.0f} tokens/s" in notes
    m = {k: v / 2**30 for k, v in u["memory_total_bytes"].items()}
    assert f"peak memory P10 {m['p10']:.1f} GiB .. P50 {m['p50']:.1f} GiB .. P90 {m['p90']:.1f} GiB" in notes
    for part, q in u["time_breakdown_s"].items():
        if q["p90"] > 0:
            assert f"{TERM_LABELS[part]} P10 {q['p10']:.4g} s .. P50 {q['p50']:.4g} s .. P90 {q['p90']:.4g} s" in notes
    ranked, _ = robust_ranking(model, system, found.plans, SAMPLES)
    mine = next(rp for rp in ranked if rp.prediction.plan == found.plans[0].plan)
    assert (f"your plan is fastest in {mine.p_best:.0%} of the draws and within 5% of the fastest in "
            f"{mine.p_within_5pct:.0%}, among the search's best {len(found.plans)} plans. {verdict(ranked)}") in notes
    for name in ("175B at 10% of peak", "93% weak scaling", "82% strong scaling"):  # smng-p2's observations
        assert f"Observation '{name}" in notes


def test_report_without_uncertainty_says_how_to_get_it(tmp_path, capsys):
    out = tmp_path / "report.html"
    code, stdout, err = _run(["report", *CASE, "--top", "1", "--node-counts", "2,4", "--no-uncertainty",
                              "--out", str(out)], capsys)
    assert code == 0, err
    assert "6 of 8 charts drawn" in stdout
    page = out.read_text()
    assert "Left out (--no-uncertainty)" in _notes(page, "How sure is this prediction")
    assert "P10-P90" not in page.split("</script>", 1)[1]  # no bands, error bars or spreads anywhere
