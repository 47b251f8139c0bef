"""Per-layer activation memory against Korthikanti et al. 2022 (arXiv 2205.05198), table 2 and section 5.

For a GPT layer (ffn = 4h, kv_heads = heads, dropout) with 16-bit activations the paper gives, in bytes:
    no parallelism            sbh (34 + 5as/h)
    tensor parallel           sbh (10 + 24/t + 5as/(ht))
    TP + sequence parallel    (sbh/t) (34 + 5as/h)
    TP + selective recompute  sbh (10 + 24/t)
    TP + SP + selective       34 sbh/t
    full recompute            2 sbh      (2 sbh/t with SP: the layer input is sharded)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from perfsim.cost.memory import activation_bytes, layer_activation_bytes
from perfsim.spec.model import ModelSpec, load_model

NONE, SELECTIVE, FULL = 0, 1, 2  # perfsim.cost.columns: index into ("none", "selective", "full")

# (s, b, h, a, t): GPT-3 175B as in the paper, SC21 and SMNG-P2 shapes, and odd small ones.
SHAPES = [
    (2048, 1, 12288, 96, 8),
    (2048, 3, 12288, 96, 8),
    (2048, 1, 12288, 96, 1),
    (2048, 4, 2304, 24, 2),
    (2048, 1, 25600, 160, 8),
    (1024, 2, 4096, 32, 4),
    (4096, 8, 3072, 32, 16),
    (512, 5, 768, 12, 3),
    (128, 7, 96, 6, 6),
]


def gpt(s: int, h: int, a: int) -> ModelSpec:
    return ModelSpec(name="gpt", layers=4, hidden=h, heads=a, seq=s, vocab=50257)


def korthikanti(s, b, h, a, t, sp: bool, recompute: str) -> float:
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def _ids(shape):
    return "s{}-b{}-h{}-a{}-t{}".format(*shape)


@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(x) for x in SHAPES])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("recompute", [("none", NONE), ("selective", SELECTIVE), ("full", FULL)], ids=lambda r: r[0])
def test_layer_activation_bytes_match_korthikanti(shape, sp, recompute):
    s, b, h, a, t = shape
    name, index = recompute
    got = float(layer_activation_bytes(gpt(s, h, a), b, t, sp, index))
    assert got == pytest.approx(korthikanti(s, b, h, a, t, sp, name), rel=1e-9)


@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(x) for x in SHAPES])
def test_no_parallelism_is_34_plus_5as_over_h(shape):
    s, b, h, a, _ = shape
    got = float(layer_activation_bytes(gpt(s, h, a), b, 1, False, NONE))
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-9)


def test_paper_175b_numbers():
    """GPT-3 175B, s=2048, b=1, t=8: the paper's per-layer figures, computed by hand in MiB."""
    m = gpt(2048, 12288, 96)
    sbh = 2048 * 12288
    # sbh(10 + 24/8 + 5*96*2048/(12288*8)) = sbh * 23 ; (sbh/8)(34 + 80) = sbh * 14.25 ; 34sbh/8 = 4.25 sbh
    assert float(layer_activation_bytes(m, 1, 8, False, NONE)) == pytest.approx(23 * sbh, rel=1e-12)
    assert float(layer_activation_bytes(m, 1, 8, True, NONE)) == pytest.approx(14.25 * sbh, rel=1e-12)
    assert float(layer_activation_bytes(m, 1, 8, True, SELECTIVE)) == pytest.approx(4.25 * sbh, rel=1e-12)
    assert float(layer_activation_bytes(m, 1, 8, False, FULL)) == pytest.approx(2 * sbh, rel=1e-12)


def test_works_on_numpy_columns():
    """Cost functions take arrays of plans: one call evaluates many (b, t, sp, recompute)."""
    s, h, a = 2048, 4096, 32
    m = gpt(s, h, a)
    b = np.array([1, 2, 4, 1, 2, 8])
    t = np.array([1, 2, 4, 8, 8, 2])
    sp = np.array([0, 1, 0, 1, 0, 1])
    rc = np.array([NONE, NONE, SELECTIVE, SELECTIVE, FULL, FULL])
    got = layer_activation_bytes(m, b, t, sp, rc)
    names = {NONE: "none", SELECTIVE: "selective", FULL: "full"}
    expected = [korthikanti(s, int(b[i]), h, a, int(t[i]), bool(sp[i]), names[int(rc[i])]) for i in range(len(b))]
    np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_preset_175b_is_a_korthikanti_gpt():
    m = load_model("gpt3-175b")
    got = float(layer_activation_bytes(m, 1, 8, True, NONE))
    assert got == pytest.approx(korthikanti(2048, 1, 12288, 96, 8, True, "none"), rel=1e-9)


def test_without_dropout_is_smaller():
    """No dropout: no attention-dropout mask and output (3 as^2 b/t) and no two 1-byte masks (2 sbh)."""
    s, b, h, a, t = 2048, 2, 4096, 32, 4
    m = dataclasses.replace(gpt(s, h, a), dropout=False)
    got = float(layer_activation_bytes(m, b, t, False, NONE))
    expected = korthikanti(s, b, h, a, t, False, "none") - 3 * a * s * s * b / t - 2 * s * b * h
    assert got == pytest.approx(expected, rel=1e-9)


def test_allocated_bytes_inverts_the_reserved_runtime_and_the_allocator_slack():
    """memory_breakdown's total = tensors x (1 + allocator_overhead_fraction) + reserved; the
    harness compares an allocator's allocated bytes with the tensors alone."""
    from perfsim.cost.columns import columns_of
    from perfsim.cost.memory import allocated_bytes, memory_breakdown
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.spec.system import load_system

    import dataclasses

    base, model = load_system("dgx-a100"), load_model("gpt3-1.3b")
    slack = dataclasses.replace(base, framework=dataclasses.replace(base.framework, allocator_overhead_fraction=0.2))
    none = dataclasses.replace(base, framework=dataclasses.replace(base.framework, allocator_overhead_fraction=0.0))
    for plan in (Plan(tp=2, pp=2, mbs=1, gbs=8), Plan(dp=4, zero=3, mbs=2, gbs=8)):
        c = columns_of(plan)
        tensors = memory_breakdown(model, none, c, True)["total"] - base.framework.reserved_memory_bytes
        total = memory_breakdown(model, slack, c, True)["total"]
        assert float(allocated_bytes(total, slack.framework)) == pytest.approx(float(tensors), rel=1e-12)
        assert float(total - base.framework.reserved_memory_bytes) > float(tensors)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_unfused_grouped_query_attention_keeps_keys_and_values_expanded(t):
    """Megatron's unfused core repeats each key/value head for its query heads (repeat_interleave)
    before the score and context GEMMs, which keep the expanded K and V: without recomputation a
    GQA layer keeps as much as the multi-head one. The fused kernel reads K and V unexpanded, and
    selective recomputation keeps only the core's inputs: 2 x 2 s b (h - h_kv) / t bytes less."""
    s, b, h, a = 1024, 2, 2048, 16
    mha = dataclasses.replace(gpt(s, h, a), dropout=False)
    gqa = dataclasses.replace(mha, kv_heads=4)
    fewer = 2 * 2 * s * b * (h - gqa.kv_hidden) / t
    for sp in (False, True):
        assert float(layer_activation_bytes(gqa, b, t, sp, NONE)) == float(layer_activation_bytes(mha, b, t, sp, NONE))
        assert float(layer_activation_bytes(gqa, b, t, sp, SELECTIVE)) == \
            pytest.approx(float(layer_activation_bytes(mha, b, t, sp, SELECTIVE)) - fewer, rel=1e-12)
        for rc in (NONE, SELECTIVE):
            flash = [float(activation_bytes(m, b, t, np.where(sp, t, 1), rc, flash=1)) for m in (mha, gqa)]
            assert flash[1] == pytest.approx(flash[0] - fewer, rel=1e-12)
