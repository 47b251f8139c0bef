"""perfsim.spec.plan: plans are immutable values and plan_problems returns every reason, in words."""

from __future__ import annotations

import dataclasses

import pytest

from perfsim.spec.model import ModelSpec, load_model
from perfsim.spec.plan import Plan, plan_problems

GPT13 = load_model("gpt3-1.3b")  # 24 layers, 16 heads, ffn 8192, seq 2048
LLAMA70 = load_model("llama2-70b")  # 80 layers, 64 heads, 8 kv heads, ffn 28672


def problems(**fields):
    return plan_problems(Plan(**fields), GPT13)


def test_default_plan_is_valid_on_one_device():
    plan = Plan()
    assert plan.devices == 1 and plan.microbatches == 1
    assert plan_problems(plan, GPT13) == []
    assert plan_problems(plan, GPT13, devices=1) == []


def test_plan_is_immutable_and_replace_returns_new():
    plan = Plan(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tp = 4  # type: ignore[misc]
    other = plan.replace(tp=4, pp=2)
    assert (plan.tp, other.tp, other.pp) == (2, 4, 2)
    assert Plan(tp=2) == plan and hash(Plan(tp=2)) == hash(plan)


DESIGN_KNOBS = ["tp", "tp_mode", "tp_depth", "sp", "pp", "vpp", "schedule", "dp", "zero", "mbs", "gbs", "recompute", "order"]


def test_as_dict_has_the_knob_names():
    """The 13 original knobs come first, in that order (later knobs may follow)."""
    names = list(Plan().as_dict())
    assert names[:13] == DESIGN_KNOBS
    defaults = Plan().as_dict()
    assert (defaults["tp"], defaults["tp_mode"], defaults["pp"], defaults["dp"], defaults["zero"], defaults["mbs"],
            defaults["gbs"], defaults["recompute"], defaults["order"]) == (1, "1d", 1, 1, 0, 1, 1, "none", "tp-dp-pp")


def test_devices_and_microbatches():
    plan = Plan(tp=4, pp=3, dp=5, mbs=2, gbs=60)
    assert plan.devices == 60
    assert plan.microbatches == 6


@pytest.mark.parametrize("name", ["tp", "tp_depth", "pp", "vpp", "dp", "mbs", "gbs"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None])
def test_sizes_must_be_positive_whole_numbers(name, bad):
    reasons = problems(**{name: bad})
    assert len(reasons) >= 1
    assert any(name in r and "positive whole number" in r for r in reasons), reasons


def test_every_bad_size_is_reported():
    reasons = problems(tp=0, pp=-2, mbs=0)
    assert len(reasons) == 3
    assert [r.split()[0] for r in reasons] == ["tp", "pp", "mbs"]


def test_several_independent_reasons_at_once():
    """tp not dividing heads, pp not dividing layers, gbs not a multiple, device mismatch: all four."""
    reasons = plan_problems(Plan(tp=3, pp=5, dp=2, mbs=2, gbs=10), GPT13, devices=64)
    text = " | ".join(reasons)
    assert "tp 3 must divide the 16 attention heads" in text
    assert "tp 3 must divide the MLP width 8192" in text
    assert "pp 5 must divide the 24 layers" in text
    assert "global batch 10 must be a multiple of mbs x dp = 4" in text
    assert "3 x 5 x 2 = 30" in text and "64 devices" in text
    assert len(reasons) == 5


def test_tp_must_divide_kv_heads():
    reasons = plan_problems(Plan(tp=16, dp=1), LLAMA70)  # 64 heads, but only 8 kv heads
    assert reasons == ["tp 16 must divide the 8 key/value heads"]
    assert plan_problems(Plan(tp=8), LLAMA70) == []


def test_tp_must_divide_ffn():
    model = ModelSpec(name="odd", layers=2, hidden=64, heads=4, seq=8, vocab=10, ffn=66)
    assert plan_problems(Plan(tp=4), model) == ["tp 4 must divide the MLP width 66"]
    assert plan_problems(Plan(tp=2), model) == []


def test_devices_checked_only_when_given():
    plan = Plan(tp=2, pp=2, dp=2, gbs=2)
    assert plan_problems(plan, GPT13) == []
    assert plan_problems(plan, GPT13, devices=8) == []
    reasons = plan_problems(plan, GPT13, devices=16)
    assert len(reasons) == 1 and "16 devices" in reasons[0]


@pytest.mark.parametrize("field,value,needle", [
    ("tp_mode", "4d", "tp_mode must be one of"),
    ("schedule", "zero-bubble", "schedule must be one of"),
    ("recompute", "partial", "recompute must be one of"),
    ("zero", 4, "zero must be 0, 1, 2 or 3"),
    ("zero", -1, "zero must be 0, 1, 2 or 3"),
    ("zero", True, "zero must be 0, 1, 2 or 3"),
    ("sp", "yes", "sp must be true or false"),
    ("order", "tp-pp", "order must list tp, dp and pp"),
    ("order", "tp-dp-dp", "order must list tp, dp and pp"),
    ("order", "tp-dp-pp-ep", "order must list tp, dp and pp"),
    ("order", None, "order must list tp, dp and pp"),
])
def test_bad_names(field, value, needle):
    reasons = problems(**{field: value})
    assert len(reasons) == 1 and needle in reasons[0], reasons


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])
def test_every_permutation_order_is_valid(order):
    assert problems(order=order) == []


def test_2d_needs_a_square_grid_and_divisible_batch():
    """Optimus (SUMMA, P = q^2): the micro-batch, hidden and heads split q ways."""
    assert problems(tp=4, tp_mode="2d", mbs=2, gbs=2) == []
    assert problems(tp=16, tp_mode="2d", mbs=4, gbs=4) == []
    reasons = problems(tp=8, tp_mode="2d", mbs=2, gbs=2)
    assert len(reasons) == 1 and "square" in reasons[0] and "8" in reasons[0]
    reasons = problems(tp=4, tp_mode="2d", mbs=1)
    assert len(reasons) == 1 and "mbs" in reasons[0] and "2" in reasons[0]
    assert problems(tp=1, tp_mode="2d") == []  # a 1 x 1 grid: nothing to split


def test_2_5d_needs_q_q_depth():
    assert problems(tp=8, tp_mode="2.5d", tp_depth=2, mbs=4, gbs=4) == []  # q = 2, rows d q = 4
    reasons = problems(tp=8, tp_mode="2.5d", tp_depth=2, mbs=2, gbs=2)
    assert len(reasons) == 1 and "mbs" in reasons[0] and "4" in reasons[0]
    reasons = problems(tp=8, tp_mode="2.5d", tp_depth=3, mbs=6, gbs=6)
    assert len(reasons) == 1 and "2.5d" in reasons[0]


def test_3d_needs_a_cube_and_q_squared_batch():
    assert problems(tp=8, tp_mode="3d", mbs=4, gbs=4) == []  # q = 2: micro-batch split q^2 = 4 ways
    reasons = problems(tp=8, tp_mode="3d", mbs=2, gbs=2)
    assert len(reasons) == 1 and "mbs" in reasons[0] and "4" in reasons[0]
    reasons = problems(tp=4, tp_mode="3d", mbs=4, gbs=4)
    assert len(reasons) == 1 and "cube" in reasons[0]


def test_grid_divisibility_of_the_model():
    model = ModelSpec(name="g", layers=2, hidden=36, heads=6, seq=16, vocab=100, ffn=144)
    # 2d on 3 x 3: hidden 36 % 3 == 0, ffn 144 % 3 == 0, heads 6 % 3 == 0 -> fine
    assert plan_problems(Plan(tp=9, tp_mode="2d", mbs=3, gbs=3), model) == []
    # 3d on 3 x 3 x 3: weights split q^2 = 9 ways -> 36 and 144 ok; heads 6 % 3 ok
    assert plan_problems(Plan(tp=27, tp_mode="3d", mbs=9, gbs=9), model) == []
    odd = ModelSpec(name="o", layers=2, hidden=40, heads=5, seq=16, vocab=100, ffn=160)
    reasons = plan_problems(Plan(tp=4, tp_mode="2d", mbs=2, gbs=2), odd)
    assert len(reasons) == 1 and "heads" in reasons[0]  # 5 heads do not split 2 ways


def test_tp_axes_must_name_the_grid_axes():
    assert problems(tp=8, tp_mode="3d", mbs=4, gbs=4, tp_axes="output-input-weight") == []
    reasons = problems(tp=8, tp_mode="3d", mbs=4, gbs=4, tp_axes="row-col")
    assert len(reasons) == 1 and "tp_axes" in reasons[0]
    assert any("tp_axes" in r for r in problems(tp=8, tp_mode="3d", mbs=4, gbs=4, tp_axes=None))


def test_sp_only_with_1d_and_sequence_divisible():
    assert problems(tp=4, sp=True) == []
    assert problems(tp=1, tp_mode="2d", sp=True) == ["sequence parallelism (--sp) applies to 1d tensor parallelism only"]
    model = ModelSpec(name="s", layers=2, hidden=64, heads=4, seq=6, vocab=10)
    assert plan_problems(Plan(tp=4, sp=True), model) == ["with --sp, tp 4 must divide the sequence length 6"]
    assert plan_problems(Plan(tp=4), model) == []


def test_tp_depth_only_with_2_5d():
    assert problems(tp_depth=2) == ["tp_depth applies to --tp-mode 2.5d only"]


def test_pipeline_and_interleaving_rules():
    assert problems(pp=5) == ["pp 5 must divide the 24 layers, or the first and last stage need counts of their own "
                              "(--first-stage-layers, --last-stage-layers)"]
    assert problems(pp=4, vpp=2, schedule="interleaved", gbs=4) == []
    assert problems(pp=4, vpp=4, schedule="interleaved", gbs=4) == ["pp x vpp = 16 must divide the 24 layers"]
    assert problems(pp=4, vpp=2, schedule="1f1b", gbs=4) == ["--vpp 2 needs --schedule interleaved"]
    assert problems(pp=4, schedule="interleaved", gbs=4) == ["the interleaved schedule needs --vpp 2 or more"]
    assert problems(pp=1, vpp=2, schedule="interleaved", gbs=4) == ["the interleaved schedule needs pp of 2 or more"]
    reasons = problems(pp=4, vpp=2, schedule="interleaved", gbs=6)
    assert reasons == ["the interleaved schedule needs the 6 micro-batches to be a multiple of pp 4"]


def test_gbs_rule_uses_dp():
    assert problems(dp=4, mbs=2, gbs=8) == []
    assert problems(dp=4, mbs=2, gbs=16) == []
    assert problems(dp=4, mbs=2, gbs=12) == ["global batch 12 must be a multiple of mbs x dp = 8"]
    assert problems(dp=4, mbs=2, gbs=4) == ["global batch 4 must be a multiple of mbs x dp = 8"]


def test_gpipe_and_1f1b_need_no_multiple_of_pp():
    for schedule in ("gpipe", "1f1b"):
        assert problems(pp=4, schedule=schedule, gbs=3) == []


def test_predict_refuses_invalid_plans_with_all_reasons():
    import perfsim

    with pytest.raises(perfsim.PerfsimError) as info:
        perfsim.predict(GPT13, "dgx-a100", Plan(tp=3, zero=7))
    text = str(info.value)
    assert "heads" in text and "zero" in text
