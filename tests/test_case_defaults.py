"""The plan a command uses when plan flags are left out: `report` and `chart` search for the best
plan once a model, system or device count is given (the flags given are kept as fixes); `predict`
never searches, and its error for a derived dp says how dp came about and what to add."""

import json

import pytest

import perfsim
from perfsim.cli import main
from perfsim.spec.case import BUILTIN_CASE
from perfsim.search import parse_fixes, search

MODEL, SYSTEM, NODES, GBS = "smng-p2-20b", "smng-p2", 2, 16
CASE = ["--model", MODEL, "--system", SYSTEM, "--nodes", str(NODES), "--gbs", str(GBS)]


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _best(fixes=()):
    model, system = perfsim.load_model(MODEL), perfsim.load_system(SYSTEM)
    return search(model, system, NODES * system.node.devices_per_node, GBS, parse_fixes(list(fixes)), top=1).plans[0]


@pytest.mark.parametrize("kind", ["memory", "breakdown", "timeline", "scaling"])
def test_charts_use_the_searched_plan_and_say_so(kind, tmp_path, capsys):
    from perfsim.spec.plan import plan_summary

    code, out, err = _run(["chart", kind, *CASE, "--top", "1", "--node-counts", "2,4", "--out",
                           str(tmp_path / "c.html")], capsys)
    assert code == 0, err
    best = _best().plan
    assert f"no plan flags given: using the best plan perfsim search finds: {plan_summary(best)}" in err
    assert (tmp_path / "c.html").exists()


def test_plan_flags_given_are_fixes(tmp_path, capsys):
    from perfsim.commands.chart import Case

    args = perfsim.cli.make_parser().parse_args(["chart", "memory", *CASE, "--tp", "2", "--mbs", "2",
                                                 "--out", str(tmp_path / "m.html")])
    heard = []
    case = Case(args, announce=heard.append)
    assert heard == []  # nothing searched until the plan is asked for
    plan = case.plan
    assert plan.tp == 2 and plan.mbs == 2 and plan.gbs == GBS
    assert plan == _best(["tp=2", "mbs=2"]).plan
    assert heard and "plan flags left out: using the best plan perfsim search finds with --tp 2, --mbs 2" in heard[0]
    assert case.found is None  # that search is not the page's comparison search (which takes --fix only)


def test_report_lead_names_the_chosen_plan(tmp_path, capsys):
    out = tmp_path / "report.html"
    code, stdout, err = _run(["report", *CASE, "--top", "1", "--keep", "20", "--node-counts", "2,4", "--out",
                              str(out)], capsys)
    assert code == 0, err
    assert "no plan flags given: using the best plan perfsim search finds" in out.read_text()
    assert "wrote the report" in stdout


def test_tp_and_pp_given_take_the_plan_flags(tmp_path, capsys):
    from perfsim.commands.chart import Case

    args = perfsim.cli.make_parser().parse_args(["chart", "timeline", *CASE, "--tp", "4", "--pp", "4",
                                                 "--out", str(tmp_path / "t.html")])
    case = Case(args)
    assert not case.searched and case.plan == perfsim.Plan(tp=4, pp=4, dp=1, gbs=GBS)


def test_builtin_chart_case_is_the_builtin_plan(tmp_path):
    from perfsim.commands.chart import Case

    case = Case(perfsim.cli.make_parser().parse_args(["chart", "memory", "--out", str(tmp_path / "m.html")]))
    assert not case.searched and case.plan == perfsim.Plan(**BUILTIN_CASE["plan"], dp=1)


def test_a_search_that_finds_nothing_is_one_line(tmp_path, capsys):
    code, out, err = _run(["chart", "memory", "--model", "gpt3-175b", "--system", "dgx-a100", "--devices", "8",
                           "--gbs", "8", "--out", str(tmp_path / "m.html")], capsys)
    assert code == 2 and err.count("\n") == 1 and "fits in device memory" in err


def test_predict_without_flags_is_the_builtin_case(capsys):
    code, out, err = _run(["predict", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert {k: plan[k] for k in BUILTIN_CASE["plan"]} == BUILTIN_CASE["plan"] and plan["dp"] == 1
    assert json.loads(out)["devices"] == 128


def test_predict_error_says_how_dp_was_derived(capsys):
    code, out, err = _run(["predict", "--model", "gpt3-175b", "--system", "smng-p2", "--nodes", "16", "--gbs", "300"],
                          capsys)
    assert code == 2 and err.count("\n") == 1
    assert "global batch 300 must be a multiple of mbs x dp = 128" in err
    assert "dp = 128 devices / (tp 1 x pp 1) = 128" in err and "--dp was left out" in err
    assert "--tp/--pp" in err and "--gbs that is a multiple of mbs x dp = 128" in err
    assert "`perfsim search --model gpt3-175b --system smng-p2 --nodes 16 --gbs 300`" in err


def test_predict_error_without_a_dp_problem_only_adds_the_search(capsys):
    code, out, err = _run(["predict", "--model", "gpt3-175b", "--system", "smng-p2", "--nodes", "16", "--tp", "8",
                           "--tp-mode", "2d", "--gbs", "320"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "2d tensor parallelism needs a square" in err and "dp =" not in err and "perfsim search" in err


def test_the_message_writes_flags_as_typed(tmp_path, capsys):
    code, out, err = _run(["chart", "memory", *CASE, "--tp", "1", "--zero", "1", "--no-dp-overlap", "--top", "0",
                           "--out", str(tmp_path / "m.html")], capsys)
    assert code == 0, err
    assert "with --tp 1, --zero 1, --no-dp-overlap:" in err


def test_flags_that_leave_no_candidate_say_so(tmp_path, capsys):
    code, out, err = _run(["chart", "memory", *CASE, "--tp", "1", "--sp", "--out", str(tmp_path / "m.html")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "no valid plan" in err and "leave no candidate" in err and "()" not in err
