"""Model key `activation` (gelu, swiglu, squared-relu; docs/equations.md 3.5): SwiGLU is the old
gated_mlp = true, squared ReLU costs what GeLU costs (same FC1 width, one element-wise pass of the
same bytes, its input kept for backward)."""

from __future__ import annotations

import pytest

from perfsim.cost import counts
from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.spec.model import ModelSpec, load_model
from perfsim.spec.plan import Plan

BASE = "layers=4,hidden=1024,heads=16,seq=2048,vocab=32000"
PLAN = Plan(tp=2, pp=2, dp=2, mbs=1, gbs=8)


def test_swiglu_is_the_old_gated_mlp():
    new, old = load_model(BASE + ",activation=swiglu"), load_model(BASE + ",gated_mlp=true")
    assert new == old and new.gated_mlp and old.activation == "swiglu"
    assert predict(new, "dgx-a100", PLAN).as_json() == predict(old, "dgx-a100", PLAN).as_json()
    assert load_model("llama2-7b").activation == "swiglu"


def test_squared_relu_costs_what_gelu_costs():
    relu2, gelu = load_model(BASE + ",activation=squared-relu"), load_model(BASE)
    assert gelu.activation == "gelu" and not relu2.gated_mlp
    a, b = predict(relu2, "dgx-a100", PLAN), predict(gelu, "dgx-a100", PLAN)
    assert a.step_time_s == b.step_time_s and a.memory_bytes == b.memory_bytes
    assert counts.total_params(relu2) == counts.total_params(gelu)


def test_swiglu_doubles_fc1():
    """Per layer: FC1 h x 2f instead of h x f (the SwiGLU gate and up projections)."""
    h, f = 1024, 4096
    gelu, swiglu = load_model(BASE), load_model(BASE + ",activation=swiglu")
    assert counts.layer_params(swiglu)["fc1"] - counts.layer_params(gelu)["fc1"] == h * f + f


@pytest.mark.parametrize("spec, says", [(",activation=relu", "must be one of gelu, swiglu, squared-relu"),
                                        (",activation=gelu,gated_mlp=true", "contradicts")])
def test_bad_activations_are_one_line_errors(spec, says):
    with pytest.raises(PerfsimError, match=says):
        load_model(BASE + spec)


def test_a_spec_built_directly_keeps_the_two_keys_in_step():
    assert ModelSpec("m", 1, 8, 2, 4, 10, gated_mlp=True).activation == "swiglu"
    assert ModelSpec("m", 1, 8, 2, 4, 10, activation="swiglu").gated_mlp
