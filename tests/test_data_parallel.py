"""Data-parallel traffic by ZeRO stage: what the closed form exposes."""

import dataclasses

import pytest

import perfsim
from perfsim.cost.columns import columns_of
from perfsim.cost.data_parallel import microbatch_reduction_time, zero_microbatch_times
from perfsim.cost.topology import TopologyCommModel

from conftest import pieces_exposed


@pytest.fixture
def case():
    system = perfsim.load_system("smng-p2")
    c = dataclasses.replace(columns_of(perfsim.Plan(tp=4, pp=4, dp=4, zero=2, mbs=1, gbs=32)), dp_overlap=1)
    return system, TopologyCommModel(system), c


@pytest.mark.parametrize("buckets", [1, 4, 12])
def test_zero2_overlap_exposes_the_last_bucket_and_what_the_backward_cannot_hide(case, buckets):
    """n buckets, bucket j ready after j/n of the backward B, reduced one after another in S/n
    each: the last ends at B + S/n when each fits in its B/n, else at B/n + S; exposed is that
    less B (written out per bucket here, not as perfsim's closed form)."""
    system, comm, c = case
    params = 1e9
    scatter, _ = zero_microbatch_times(system, comm, c, params)
    scatter = float(scatter)
    for backward in (0.0, 0.25 * scatter, 10 * scatter):
        exposed = microbatch_reduction_time(system, comm, c, params, busy=0.0, backward=backward, buckets=buckets)
        assert float(exposed) == pytest.approx(pieces_exposed(scatter, backward, buckets))
    off = dataclasses.replace(c, dp_overlap=0)
    assert float(microbatch_reduction_time(system, comm, off, params, 0.0, 10 * scatter, buckets=buckets)) == \
        pytest.approx(scatter)


def test_zero1_exposes_nothing_per_micro_batch(case):
    system, comm, c = case
    c = columns_of(perfsim.Plan(tp=4, pp=4, dp=4, zero=1, mbs=1, gbs=32))
    assert float(microbatch_reduction_time(system, comm, c, 1e9, busy=0.0, backward=0.0)) == 0.0


def test_zero3_gathers_and_reduces_one_module_at_a_time():
    """ZeRO-3 per micro-batch: per module (every layer, the embedding, the head) one all-gather for
    forward, one for backward and one reduce-scatter, each of the module's share of the bytes: the
    bandwidth terms of one whole-stage call, the latency (and any step overhead) once per module."""
    from perfsim.cost.data_parallel import zero3_units
    from perfsim.cost.layer import BF16
    from perfsim.cost.memory import stage_params
    from perfsim.cost.topology import TopologyCommModel
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.spec.system import load_system

    model = load_model("layers=6,hidden=256,heads=4,seq=128,vocab=1024")
    base = load_system("cpu-calibrated")
    system = dataclasses.replace(base, framework=dataclasses.replace(base.framework, zero3_overlap=0.0,
                                                                      zero_implementation="deepspeed"))
    comm = TopologyCommModel(system)
    for plan, stage, units in ((Plan(dp=2, zero=3, mbs=1, gbs=2), "first", 8),
                               (Plan(dp=2, pp=2, zero=3, mbs=1, gbs=4), "middle", 3),
                               (Plan(dp=2, pp=2, zero=3, mbs=1, gbs=4), "last", 4)):
        c = columns_of(plan)
        assert float(zero3_units(model, c, stage)) == units
        n = float(stage_params(model, c, stage))
        grad = system.framework.grad_bytes_per_param
        by_hand = units * (2 * float(comm.all_gather(BF16 * n / units, 2, 1))
                           + float(comm.reduce_scatter(grad * n / units, 2, 1)))
        got = microbatch_reduction_time(system, comm, c, n, 0.0, 0.0, zero3_units(model, c, stage))
        assert float(got) == pytest.approx(by_hand, rel=1e-12)
        one_call = microbatch_reduction_time(system, comm, c, n, 0.0, 0.0)
        assert float(got) > float(one_call)  # the latency and step overhead are paid per module


def _fsdp2_case(plan, model="layers=6,hidden=256,heads=4,seq=128,vocab=1024"):
    from perfsim.cost.memory import stage_params
    from perfsim.spec.model import load_model
    from perfsim.spec.system import load_system

    model = load_model(model)
    system = load_system("cpu-calibrated")
    assert system.framework.zero_implementation == "fsdp2" and system.framework.zero3_overlap == 0.0
    c = columns_of(plan)
    return model, system, TopologyCommModel(system), c, float(stage_params(model, c, "first"))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fsdp2_zero3_micro_batch_by_hand(recompute):
    """FSDP2's ZeRO-3 micro-batch: per module two all-gathers (also under full recomputation) and a
    reduce-scatter, and on the compute stream the buffer copies, each a pass at the streaming
    bandwidth plus a kernel overhead: per gather the shard in (read + write) and the gathered
    buffer out to the parameters; the gradients into the reduce-scatter input; the output added
    to the shard of the earlier micro-batch (one of the two)."""
    from perfsim.cost.data_parallel import zero3_units
    from perfsim.cost.layer import BF16

    model, system, comm, c, n = _fsdp2_case(perfsim.Plan(dp=2, zero=3, mbs=1, gbs=4, recompute=recompute))
    units = float(zero3_units(model, c, "first"))
    grad, dev = system.framework.grad_bytes_per_param, system.device
    stream = dev.memory_bandwidth_Bps * dev.memory_efficiency
    passes = 2 * (2 * BF16 * n / 2 + 2 * BF16 * n) + 2 * grad * n + 0.5 * 3 * grad * n / 2
    copies = passes / stream + 5.5 * dev.kernel_overhead_s  # the accumulation: every other micro-batch
    collectives = units * (2 * float(comm.all_gather(BF16 * n / units, 2, 1)) + float(comm.reduce_scatter(grad * n / units, 2, 1)))
    got = microbatch_reduction_time(system, comm, c, n, 0.0, 0.0, units)
    assert float(got) == pytest.approx(collectives + copies, rel=1e-12)


def test_fsdp2_zero2_reduces_and_gathers_one_module_at_a_time():
    """FSDP2's ZeRO-2: a reduce-scatter per module per micro-batch (DeepSpeed's: one bucket), and
    once per step an all-gather per module with its copies."""
    from perfsim.cost.data_parallel import step_reduction_time, zero3_units
    from perfsim.cost.layer import BF16

    model, system, comm, c, n = _fsdp2_case(perfsim.Plan(dp=2, zero=2, mbs=1, gbs=4))
    units = float(zero3_units(model, c, "first"))
    grad, dev = system.framework.grad_bytes_per_param, system.device
    stream = dev.memory_bandwidth_Bps * dev.memory_efficiency
    scatter = units * float(comm.reduce_scatter(grad * n / units, 2, 1))
    copies = (2 * grad * n + 0.5 * 3 * grad * n / 2) / stream + 1.5 * dev.kernel_overhead_s
    assert float(microbatch_reduction_time(system, comm, c, n, 0.0, 0.0, units)) == pytest.approx(scatter + copies, rel=1e-12)
    gather = units * float(comm.all_gather(BF16 * n / units, 2, 1)) \
        + (2 * BF16 * n / 2 + 2 * BF16 * n) / stream + 2 * dev.kernel_overhead_s
    reduction, got = step_reduction_time(system, comm, c, n, units)
    assert float(reduction) == 0.0 and float(got) == pytest.approx(gather, rel=1e-12)


def test_fsdp2_memory_by_hand():
    """FSDP2's memory beside DeepSpeed's (docs/equations.md 6.2): ZeRO-2 keeps the bf16 shard as
    well as the gathered weights; the peak is the loss or a module's reduce-scatter in the last
    micro-batch's backward, whichever holds more. At the reduce-scatter its unsharded gradients,
    their flat copy, the output shard and gloo's clone of the input are alive, the module itself
    resharded (under ZeRO-3 the next module prefetched, where DeepSpeed's ZeRO-3 holds two
    layers), and what the backward freed before is gone. Here the head's call is the peak: the
    word embedding is the largest module and its backward the first."""
    from perfsim.cost import counts
    from perfsim.cost.layer import BF16, FP32
    from perfsim.cost.memory import memory_breakdown

    for zero in (2, 3):
        model, system, _, c, n = _fsdp2_case(perfsim.Plan(dp=2, zero=zero, mbs=1, gbs=4),
                                             "layers=6,hidden=256,heads=4,seq=128,vocab=8192,tied_embeddings=false,dropout=false")
        deepspeed = dataclasses.replace(system, framework=dataclasses.replace(system.framework,
                                                                              zero_implementation="deepspeed"))
        fsdp2, ds = (memory_breakdown(model, s, c, last_stage=False) for s in (system, deepspeed))
        s, h, vocab = model.seq, model.hidden, model.padded_vocab(1)
        layer = BF16 * sum(counts.layer_params(model).values())
        word = BF16 * vocab * h
        assert word > layer
        grad = system.framework.grad_bytes_per_param
        shard = BF16 * n / 2 if zero == 2 else 0.0
        assert float(fsdp2["weights"]) == pytest.approx(float(ds["weights"]) + shard, rel=1e-12)
        copies = system.framework.reduce_scatter_input_copies
        assert copies == 1  # gloo's clone
        # gone by the head's call: the logits GEMM's input, the loss's fp32 softmax, the bf16 logits
        head_gone = BF16 * s * h + FP32 * s * vocab + BF16 * s * vocab
        head_call = (2 + 1 / 2 + copies) * grad / BF16 * word + (layer if zero == 3 else -word) - head_gone
        per_layer = (float(ds["activations"]) - head_gone - BF16 * s * h) / model.layers  # less the norm input
        layer_call = (2 + 1 / 2 + copies) * grad / BF16 * layer + (layer if zero == 3 else -layer) \
            - (head_gone + BF16 * s * h) - per_layer
        assert head_call > layer_call > 0
        deepspeed_gathers = 2 * layer if zero == 3 else 0.0
        slack = 1 + system.framework.allocator_overhead_fraction
        assert float(fsdp2["total"] - ds["total"]) == pytest.approx((shard + head_call - deepspeed_gathers) * slack,
                                                                    rel=1e-9)


def test_fsdp2_peak_is_the_loss_when_the_logits_outweigh_the_reduce_scatter():
    """Long sequences, a large vocabulary and a backend that reduces in place: the logits and the
    loss's softmax, gone by any reduce-scatter, hold more than the reduce-scatter's buffers, so
    FSDP2's ZeRO-2 adds only its shard to DeepSpeed's total."""
    from perfsim.cost.layer import BF16
    from perfsim.cost.memory import memory_breakdown

    model, system, _, c, n = _fsdp2_case(perfsim.Plan(dp=2, zero=2, mbs=1, gbs=4),
                                         "layers=6,hidden=256,heads=4,seq=2048,vocab=32768,tied_embeddings=false,dropout=false")
    in_place = dataclasses.replace(system.framework, reduce_scatter_input_copies=0)
    fsdp2 = memory_breakdown(model, dataclasses.replace(system, framework=in_place), c, last_stage=False)
    ds = memory_breakdown(model, dataclasses.replace(system, framework=dataclasses.replace(
        in_place, zero_implementation="deepspeed")), c, last_stage=False)
    slack = 1 + system.framework.allocator_overhead_fraction
    assert float(fsdp2["total"] - ds["total"]) == pytest.approx(BF16 * n / 2 * slack, rel=1e-9)
