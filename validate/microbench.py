"""Microbenchmarks: what perfsim's cost model needs to know about a device and its links.

Four suites, each a list of `Point`s (what to measure) and a way to time one:
- gemm: the GEMMs perfsim's cost model issues for a model and plan (asked from
  perfsim.cost.tensor_parallel, never re-derived here), plus a generic (m, n, k) sweep;
- memory: memory-bound ops (copy, triad, LayerNorm, softmax, GeLU, dropout, residual add) over a
  size sweep and at the sizes the plan's layer uses (perfsim.cost.layer.layer_memory_ops); the
  backward kernels of LayerNorm, softmax and GeLU over a smaller sweep and at the plan's sizes; the
  fp32 cross-entropy of bf16 logits and its backward at vocabulary-like widths. Backward kernels
  and the cross-entropy run in the dtype a training step runs them in (bf16, when measured);
- attention: the attention core, fused (scaled_dot_product_attention) and unfused (two batched
  GEMMs around a softmax), at the plan's shape and a small sweep; and the causal fused kernel a
  step with flash attention runs (validate.gpt), forward and backward, whose times become the
  profile's flash efficiencies and measured tables;
- collective: all-reduce, all-gather, reduce-scatter, broadcast, reduce and send/recv over message
  sizes from 1 KiB up to a cap (256 MiB by default) and over every group shape the plan uses; and
  a few "concurrent" points, each call timed beside a compute burst on the same rank
  (Communicator.time_concurrent: collectives.overlap_efficiency);
- tp_overhead: with 1d tensor parallelism in the plan, the host time DTensor's tensor-parallel
  layer takes beyond Megatron's, without and with SP (validate/tp_overhead.py), at the model's
  hidden size and heads.

Bytes follow perfsim's conventions: an element-wise kind moves perfsim.cost.layer.KIND_TRAFFIC
bytes per element forward (reads + writes; the very table perfsim's cost model counts with) and
a backward kernel MEMORY_BACKWARD x its forward's, so that the fit goes through perfsim's own
cost functions; a collective's `nbytes` is the full tensor (the gathered one for all-gather and
reduce-scatter) as in perfsim.cost.collectives.

Timing: warm-up calls, then `repeats` timed repetitions of `number` back-to-back calls each,
`number` chosen so that one repetition lasts at least `min_time_s` (timer resolution and launch
jitter); statistics over the repetitions. Collectives time the slowest rank of each repetition.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from perfsim.calibrate import SUITES
from perfsim.calibrate.overlap import CONCURRENT_TIMING  # noqa: F401 (campaign.measure reads it here)
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.layer import KIND_TRAFFIC, MEMORY_BACKWARD, OP_KINDS, Gemm, backward_gemms, layer_memory_ops
from perfsim.cost.measured import FLASH_KERNELS
from perfsim.spec.model import ModelSpec
from perfsim.spec.plan import Plan
from perfsim.spec.system import BACKWARD

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MEMORY_OPS = ("copy", "triad", "layernorm", "softmax", "gelu", "dropout", "add")  # forward, full sweep
ATTENTION_OPS = ("sdpa", "unfused") + FLASH_KERNELS  # the fused kernel (non-causal), perfsim's unfused core, causal flash
BACKWARD_OPS = ("layernorm_backward", "softmax_backward", "gelu_backward")  # the smaller kernel sweep
CROSS_ENTROPY_OPS = ("cross_entropy", "cross_entropy_backward")  # at Sweep.cross_entropy_shapes
AUTOCAST_FP32_OPS = ("layernorm", "softmax")  # what torch.autocast runs in fp32 in a GPU's bf16 step
KERNEL_DTYPE = "bf16"  # what a training step runs backward kernels and the loss's input in
# Forward bytes moved per element, (passes, extra): passes x the element size + extra bytes.
# Streaming ops here; the element-wise kinds as perfsim's cost model counts them.
TRAFFIC = {"copy": (2, 0), "triad": (3, 0), **KIND_TRAFFIC}
# perfsim's memory ops and the benchmark op (the kind) that stands for each.
PERFSIM_MEMORY_OPS = dict(OP_KINDS)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send")
# Expert parallelism's dispatch and combine (validate.moe): measured for plans with ep > 1, over
# their EP groups (plan_expert_groups), nbytes the buffer each rank sends in all (its own share
# included, equal splits), perfsim.cost.experts.all_to_all_time's convention
EXPERT_COLLECTIVES = ("all_to_all",)
KIB, MIB = 1024, 1024 * 1024
DEFAULT_MAX_BYTES = 256 * MIB


def traffic_bytes(op: str, elements, dtype: str):
    """Bytes perfsim counts for `elements` elements of op ("<kind>_backward": MEMORY_BACKWARD x the
    kind's forward bytes)."""
    backward = op.endswith(BACKWARD)
    per_element, extra = TRAFFIC[op[:-len(BACKWARD)] if backward else op]
    nbytes = elements * (per_element * DTYPE_BYTES[dtype] + extra)
    return MEMORY_BACKWARD * nbytes if backward else nbytes


@dataclass(frozen=True)
class Point:
    """One measurement. `shape` holds the op's sizes (see the suite's docstring); `group` the
    (size, stride) of a collective's groups in rank space; `origin` "plan" or "sweep"."""

    suite: str
    op: str
    dtype: str
    shape: tuple  # sorted (name, value) pairs, so that points hash and compare
    group: tuple | None = None
    origin: str = field(default="sweep", compare=False)
    # Collectives: how a call is timed. "interleaved": each call alone, right after a burst of
    # compute on every rank and no barrier, as a training step issues it between its GEMMs;
    # "stream": calls back to back with no barrier between repetitions (as nccl-tests times them);
    # "" (the first ledgers): a barrier before every few back-to-back calls. On gloo the barrier
    # catches a fast path that steps rarely see (docs/calibration.md, section 4). "concurrent": the
    # call started asynchronously while a compute burst as long as the call runs on the same rank,
    # timed together with the burst and the call alone in alternation (Communicator.time_concurrent).
    # GEMMs: "rotate": successive calls cycle through copies of the operands that together exceed
    # the last-level cache, so every call finds its operands in memory, as a step's weights (last
    # touched a layer ago) are; "" (the first ledgers): the same operands every call, in cache.
    # (Ledgers may also hold "cold" GEMMs: each call after a cache flush, measured once on the
    # project VM; a flush also evicts code and TLB entries, which costs small GEMMs 0.1 ms a
    # step never pays, so the fit prefers "rotate", docs/calibration.md.)
    timing: str = ""

    @property
    def dims(self) -> dict:
        return dict(self.shape)

    def key(self, device_kind: str, world: int) -> str:
        """What identifies a measurement in a ledger (resume skips points whose key is there)."""
        ident = {"device": device_kind, "world": world, "suite": self.suite, "op": self.op, "dtype": self.dtype,
                 "shape": self.dims, "group": list(self.group) if self.group else None}
        if self.timing:
            ident["timing"] = self.timing
        text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
        return f"{self.suite}:{self.op}:{self.dtype}:" + hashlib.sha1(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        d = self.dims
        if self.suite == "gemm":
            what = f"{d['m']}x{d['n']}x{d['k']}" + (f" x{d['count']}" if d["count"] != 1 else "")
        elif self.suite == "memory":
            what = f"{d['rows']}x{d['cols']}"
        elif self.suite == "attention":
            what = f"b{d['batch']} h{d['heads']} s{d['seq']} d{d['head_dim']}"
        elif self.suite == "tp_overhead":
            what = f"layer of hidden {d['hidden']}, {d['mbs']} x {d['seq']} tokens, tp {self.group[0]}"
        else:
            what = f"{_human_bytes(d['nbytes'])} group {self.group[0]}/stride {self.group[1]}"
        return f"{self.suite} {self.op} {self.dtype} {what}"


COLLECTIVE_TIMING = "interleaved"
GEMM_TIMING = "rotate"
# Bytes of rotated GEMM operands: at least twice the last-level cache (CPU: the project VM's 32 MiB
# L3; H100: 50 MB L2; Max 1550: 408 MB L2 per GPU, 204 MB per tile, shared/reference/hardware.md).
ROTATING_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20, "xpu": 512 << 20}
MAX_COPIES = 4096  # of the tiniest GEMMs' operands (64 MiB of 64x64x64 would be 2700 copies)
STREAM_MIN_CALLS = 8  # calls per repetition at least, so the stream's steady state dominates
# The compute burst before an interleaved call: a GEMM in the device's native dtype (fp32 on a CPU,
# whose bf16 GEMMs may run 40x slower without AVX512-BF16 or AMX; bf16 on a GPU), its rows sized
# on first use so that it lasts BURST_SECONDS on the slowest rank: a layer's GEMM in the validation
# runs, whatever the machine. BURST_GEMM is the shape it is sized from.
BURST_GEMM = {"cpu": (512, 768, 512), "gpu": (8192, 8192, 4096)}
BURST_SECONDS = {"cpu": 3e-3, "gpu": 3e-4}
BURST_DTYPE = {"cpu": "fp32", "gpu": "bf16"}
# Collectives beside compute ("concurrent" points, the data of collectives.overlap_efficiency): the
# operations a step overlaps with compute (gradient buckets, ZeRO gathers, tp chunks, the cp ring's
# sends), in the dtype steps send, at a few sizes up to the sweep's largest; few, as calibration
# time matters.
CONCURRENT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
CONCURRENT_BYTES = (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
# Reference kernels timed right before every compute point, whose times perfsim.calibrate.drift
# uses to take the machine's drift out of the points: BURST_GEMM and a LayerNorm of fixed shapes,
# in BURST_DTYPE, each the median of REFERENCE_CALLS calls (the LayerNorm looped
# REFERENCE_NORM_LOOPS times a call: one takes a fraction of a millisecond). About 17 ms a point
# on the project's CPU.
REFERENCE_SUITES = ("gemm", "memory", "attention")  # the suites perfsim.calibrate.drift.REFERENCE_OF rescales
REFERENCE_NORM = {"cpu": (512, 1024), "gpu": (8192, 8192)}
REFERENCE_CALLS = 3
REFERENCE_NORM_LOOPS = 5


def burst_rows(rows: int, seconds: float, target: float) -> int:
    """Rows of a burst GEMM that ran `seconds` with `rows` rows, scaled to last `target` (within
    16 rows and 64 x the starting rows: a timer's zero or a stalled call cannot size it absurdly)."""
    if not seconds > 0:
        return rows
    return int(min(64 * rows, max(16, round(rows * target / seconds))))


# tp_overhead points (validate/tp_overhead.py measures them)
TP_OVERHEAD_LAYOUTS = ("1d", "1d_sp")  # the microbenchmark's ops: without and with sequence parallelism
TP_OVERHEAD_CPU_SEQS = (64, 128, 256)  # tokens of the CPU measurements (below)


def tp_overhead_seqs(device_kind: str, seq: int, tp: int) -> tuple:
    """The sequence lengths the overhead is measured at. On a GPU the model's own: whether host
    time shows depends on how long the kernels run. On a CPU core, where host time always adds,
    short ones: layers of tens of ms, where a difference of a few ms stands out of the machine's
    noise (at the whole sequence, seconds a layer, it would not); DTensor's work is per op, not per
    element, and three lengths show whether that holds. Each divisible by `tp` (SP splits the
    sequence)."""
    if device_kind != "cpu":
        return (seq,)
    return tuple(sorted({max(tp, min(seq, s) // tp * tp) for s in TP_OVERHEAD_CPU_SEQS}))


def point_shape(**dims) -> tuple:
    """A Point's shape from its sizes: sorted (name, value) pairs, hashable."""
    return tuple(sorted((k, int(v)) for k, v in dims.items()))


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# --- what the plan issues (asked from perfsim) ---

def plan_gemms(model: ModelSpec, plan: Plan) -> list:
    """The distinct GEMMs of one layer and of the logits head on one device, as perfsim's cost
    model issues them, and a MoE layer's (_moe_gemms): (name, count, m, n, k) with whole numbers."""
    c = columns_of(plan)
    layout = tpc.layout_of(model, c)
    b = plan.mbs / plan.cp  # a context-parallel rank works on mbs/cp sequences' worth (perfsim.cost.stage)
    gemms = tpc.layer_gemms(layout, model, b, plan.cp)
    gemms.append(tpc.head_gemm(layout, model, b, model.padded_vocab(plan.tp)))
    gemms += _moe_gemms(model, c)
    out = []
    for g in gemms:
        dims = [float(g.count), float(g.m), float(g.n), float(g.k)]
        if all(d >= 1 and d == int(d) for d in dims):
            out.append((g.name, *(int(d) for d in dims)))
    return out


def _moe_gemms(model: ModelSpec, c) -> list:
    """A model with experts: its router's and shared experts' GEMMs and one member of each grouped
    GEMM of the routed experts (count 1: a grouped GEMM runs one GEMM per local expert), as
    perfsim.cost.experts prices them; none for a dense model or a perfsim without experts."""
    if not getattr(model, "moe", False):
        return []
    try:
        from perfsim.cost import experts
    except ImportError:
        return []
    grouped = [Gemm(g.name, 1, g.m, g.n, g.k) for g in experts.expert_gemms(model, c)]
    return [experts.router_gemm(model, c), *experts.shared_expert_gemms(model, c), *grouped]


def plan_memory_ops(model: ModelSpec, plan: Plan) -> list:
    """(perfsim name, benchmark op, elements, columns) for the element-wise ops of one layer;
    elements from perfsim's byte counts (bf16) and the op's traffic per element; the benchmark op
    is the op's kind."""
    c = columns_of(plan)
    layout = tpc.layout_of(model, c)
    out = []
    for op in layer_memory_ops(model, plan.mbs / plan.cp, layout.split, layout.region_split):
        bench = op.kind
        if not bench:  # generic (rotary): no kernel of its own to measure
            continue
        elements = float(op.nbytes) / traffic_bytes(bench, 1, "bf16")
        if elements < 1 or elements != int(elements):
            continue
        elements = int(elements)
        cols = model.seq if op.name in ("softmax", "attn_dropout") else model.hidden
        if elements % cols:
            cols = math.gcd(elements, 1024)
        out.append((op.name, bench, elements, cols))
    return out


def plan_attention(model: ModelSpec, plan: Plan):
    """(batch x heads, seq, head_dim) of the attention core on one device, from perfsim's
    "scores" GEMM (count, s, s, head_dim)."""
    for name, count, m, _, k in plan_gemms(model, plan):
        if name == "scores":
            return count, m, k
    return None


def plan_group_shapes(model: ModelSpec, plan: Plan) -> list:
    """(size, stride) in rank space of every communicating group shape of the plan: each axis of
    the tensor-parallel grid (its stride inside the TP group times the TP stride), then context, data
    and pipeline parallelism, and data x context (the gradients' group); strides from perfsim
    (plan.order, layout axes)."""
    c = columns_of(plan)
    strides = c.strides
    layout = tpc.layout_of(model, c)
    shapes = []
    for size, stride in layout.axes.values():
        size, stride = int(size), int(np.asarray(stride).item())
        if size > 1:
            shapes.append((size, stride * int(strides["tp"])))
    for dim, size in (("cp", plan.cp), ("dp", plan.dp), ("pp", plan.pp)):
        if size > 1:
            shapes.append((int(size), int(strides[dim])))
    if plan.cp > 1 and plan.dp > 1:  # gradients are reduced over data- and context-parallel ranks together
        shapes.append((int(plan.dp * plan.cp), int(np.asarray(strides["dp_cp"]).item())))
    return shapes


def plan_expert_groups(model: ModelSpec, plan: Plan) -> list:
    """(size, stride) of the plan's expert-parallel groups, where perfsim prices them
    (perfsim.cost.experts.group_strides: Megatron-Core's expert order tp-ep-dp over a stage's
    ranks, in the plan's rank order); none without experts or with ep 1."""
    ep = getattr(plan, "ep", 1)
    if ep <= 1 or not getattr(model, "moe", False):
        return []
    from perfsim.cost.experts import group_strides

    return [(int(ep), int(round(float(np.asarray(group_strides(columns_of(plan))["ep"]).item()))))]


def plan_all_to_all_bytes(model: ModelSpec, plan: Plan) -> int | None:
    """Bytes one rank's dispatch all-to-all holds in all (bf16 tokens, its own share included) for
    the plan, from perfsim (None where perfsim does not price experts)."""
    try:
        from perfsim.cost.experts import dispatched_tokens
    except ImportError:
        return None
    copies = float(dispatched_tokens(model, columns_of(plan)))
    return int(round(copies)) * model.hidden * DTYPE_BYTES["bf16"] if copies >= 1 else None


def group_shapes(model: ModelSpec, plan: Plan, world: int, ranks_per_node: int) -> list:
    """Group shapes to measure: the plan's, the whole world, pairs, one node, and one rank per
    node across nodes; each (size, stride) with size > 1 that tiles the world."""
    shapes = plan_group_shapes(model, plan) + [(world, 1), (2, 1)]
    if 1 < ranks_per_node < world:
        shapes += [(ranks_per_node, 1), (world // ranks_per_node, ranks_per_node)]
    out = []
    for size, stride in shapes:
        if 1 < size <= world and world % (size * stride) == 0 and (size, stride) not in out:
            out.append((size, stride))
    return out


def groups_of(size: int, stride: int, world: int) -> list:
    """Every group of the dimension (size, stride): ranks r0, r0 + stride, ... (r0 in each block)."""
    block = size * stride
    return [[start + offset + j * stride for j in range(size)]
            for start in range(0, world, block) for offset in range(stride)]


# --- the campaign's points ---

@dataclass(frozen=True)
class Sweep:
    """Sizes of the generic sweeps (defaults per device kind; `quick` for smoke tests)."""

    gemm_dims: tuple
    memory_elements: tuple
    attention_shapes: tuple  # (batch x heads, sequence) of the attention sweep, head dim 64
    collective_bytes: tuple
    max_gemm_flops: float
    backward_elements: tuple = ()  # sizes of the backward kernels (BACKWARD_OPS)
    cross_entropy_shapes: tuple = ()  # (rows, vocabulary columns) of the cross-entropy's logits


def default_sweep(kind: str, quick: bool = False, max_bytes: int | None = None) -> Sweep:
    cap = max_bytes or (1 * MIB if quick else DEFAULT_MAX_BYTES)
    sizes = []
    n = KIB
    while n <= cap:
        sizes.append(n)
        n *= 2
    if sizes and sizes[-1] != cap and cap > KIB:
        sizes.append(int(cap))
    if quick:
        return Sweep((64, 256), (1 << 12, 1 << 16), ((8, 128),), tuple(sizes), 1e9, (1 << 12,), ((16, 512),))
    # Backward kernels and the cross-entropy: fewer sizes than the forward sweep (the backward
    # kernels are costlier), some of them 3 x 2^k so that calibrate's held-out hash holds a few out.
    # Attention: sequences and head counts around the plans' whose shapes include two or three that
    # the held-out hash holds out (16 x 768 and 32 x 384 on a CPU), so that the flash kernels'
    # tables get a held-out figure like every other kernel's.
    if kind == "cpu":
        return Sweep((64, 128, 256, 512, 1024, 2048), tuple(1 << e for e in range(12, 26)),
                     ((8, 256), (8, 512), (8, 768), (8, 1024), (16, 384), (16, 768), (32, 384)),
                     tuple(sizes), 2 * 2048**3,
                     (1 << 12, 1 << 14, 3 << 13, 1 << 16, 1 << 18, 3 << 18, 1 << 20, 1 << 22, 3 << 22, 1 << 24),
                     tuple(itertools.product((64, 128, 512, 2048), (4096, 6144, 8192))))
    return Sweep((128, 256, 512, 1024, 2048, 4096, 8192), tuple(1 << e for e in range(14, 29)),
                 ((8, 512), (8, 1024), (8, 2048), (8, 4096), (16, 768), (16, 1536), (16, 3072), (32, 1024)),
                 tuple(sizes), 2 * 8192**3,
                 (1 << 14, 1 << 16, 1 << 18, 3 << 18, 1 << 20, 1 << 22, 3 << 22, 1 << 24, 3 << 24, 1 << 26, 1 << 28),
                 tuple(itertools.product((512, 2048, 8192), (6144, 8192, 16384, 32768))))


def build_points(kind: str, dtypes: tuple, model: ModelSpec, plan: Plan, world: int, ranks_per_node: int,
                 sweep: Sweep, suites=SUITES) -> list:
    """Every point of a campaign, plan points first; the same list on every rank."""
    points: list = []

    def add(p: Point):
        if p not in points:
            points.append(p)

    if "gemm" in suites:
        for dtype in dtypes:
            for name, count, m, n, k in plan_gemms(model, plan):
                if 2.0 * count * m * n * k > 4 * sweep.max_gemm_flops:
                    continue
                forward = Gemm(name, count, m, n, k)
                for g in (forward, *backward_gemms(forward)):  # the shapes perfsim prices backward at
                    add(Point("gemm", "matmul" if count == 1 else "bmm", dtype,
                              point_shape(count=count, m=g.m, n=g.n, k=g.k), origin="plan", timing=GEMM_TIMING))
            for m, n, k in itertools.product(sweep.gemm_dims, repeat=3):
                if 2.0 * m * n * k <= sweep.max_gemm_flops:
                    add(Point("gemm", "matmul", dtype, point_shape(count=1, m=m, n=n, k=k), timing=GEMM_TIMING))
    if "memory" in suites:
        kernel_dtype = KERNEL_DTYPE if KERNEL_DTYPE in dtypes else dtypes[0]
        for dtype in dtypes:
            for _, op, elements, cols in plan_memory_ops(model, plan):
                if elements <= 4 * sweep.memory_elements[-1]:
                    shape = point_shape(rows=elements // cols, cols=cols)
                    add(Point("memory", op, dtype, shape, origin="plan"))
                    if dtype == kernel_dtype and op + BACKWARD in BACKWARD_OPS:
                        add(Point("memory", op + BACKWARD, dtype, shape, origin="plan"))
            for op in MEMORY_OPS:
                for elements in sweep.memory_elements:
                    cols = min(1024, elements)
                    add(Point("memory", op, dtype, point_shape(rows=elements // cols, cols=cols)))
            if dtype == kernel_dtype:
                for op in BACKWARD_OPS:
                    for elements in sweep.backward_elements:
                        cols = min(1024, elements)
                        add(Point("memory", op, dtype, point_shape(rows=elements // cols, cols=cols)))
                for op in CROSS_ENTROPY_OPS:
                    for rows, cols in sweep.cross_entropy_shapes:
                        add(Point("memory", op, dtype, point_shape(rows=rows, cols=cols)))
        if kind != "cpu" and "bf16" in dtypes and "fp32" not in dtypes:
            # a GPU's bf16 step runs its norms and softmax under torch.autocast, in fp32
            # (validate.gpt.autocast_for, docs/equations.md 3.5): those kernels, forward and
            # backward, at the plan's sizes and the backward sweep, for the fp32 tables perfsim
            # prices them by
            for name, op, elements, cols in plan_memory_ops(model, plan):
                if op in AUTOCAST_FP32_OPS and elements <= 4 * sweep.memory_elements[-1]:
                    for kernel in (op, op + BACKWARD):
                        add(Point("memory", kernel, "fp32", point_shape(rows=elements // cols, cols=cols), origin="plan"))
            for op in AUTOCAST_FP32_OPS:
                for elements in sweep.backward_elements:
                    cols = min(1024, elements)
                    for kernel in (op, op + BACKWARD):
                        add(Point("memory", kernel, "fp32", point_shape(rows=elements // cols, cols=cols)))
    if "attention" in suites:
        for dtype in dtypes:
            shapes = []
            core = plan_attention(model, plan)
            if core is not None:
                shapes.append((core, "plan"))
            shapes += [((bh, s, 64), "sweep") for bh, s in sweep.attention_shapes]
            for (bh, s, d), origin in shapes:
                for op in ATTENTION_OPS:
                    add(Point("attention", op, dtype, point_shape(batch=1, heads=bh, seq=s, head_dim=d), origin=origin))
    if "collective" in suites and world > 1:
        # A training step sends bf16 (the dtype perfsim prices traffic in); gloo reduces bf16 in
        # scalar code, ~2x slower per byte than fp32, so the CPU measures both and the fit uses bf16.
        for dtype in (dtypes if kind == "cpu" else dtypes[:1]):
            for size, stride in group_shapes(model, plan, world, ranks_per_node):
                for op in COLLECTIVES:
                    for nbytes in sweep.collective_bytes:
                        add(Point("collective", op, dtype, point_shape(nbytes=nbytes), group=(size, stride),
                                  timing=COLLECTIVE_TIMING))
        for size, stride in plan_expert_groups(model, plan):
            if size > world or world % (size * stride):
                continue
            dtype = KERNEL_DTYPE if KERNEL_DTYPE in dtypes else dtypes[0]  # the tokens a step sends
            own = plan_all_to_all_bytes(model, plan)
            for op in EXPERT_COLLECTIVES:
                if own is not None and own <= 4 * max(sweep.collective_bytes):
                    add(Point("collective", op, dtype, point_shape(nbytes=own), group=(size, stride), origin="plan",
                              timing=COLLECTIVE_TIMING))
                for nbytes in sweep.collective_bytes:
                    add(Point("collective", op, dtype, point_shape(nbytes=nbytes), group=(size, stride),
                              timing=COLLECTIVE_TIMING))
        dtype = KERNEL_DTYPE if KERNEL_DTYPE in dtypes else dtypes[0]
        for size, stride in group_shapes(model, plan, world, ranks_per_node):
            for op in CONCURRENT_OPS:
                for nbytes in (n for n in CONCURRENT_BYTES if n <= max(sweep.collective_bytes)):
                    add(Point("collective", op, dtype, point_shape(nbytes=nbytes), group=(size, stride),
                              timing=CONCURRENT_TIMING))
    if "tp_overhead" in suites and plan.tp > 1 and plan.tp_mode == "1d":
        dtype = KERNEL_DTYPE if KERNEL_DTYPE in dtypes else dtypes[0]
        for layout in TP_OVERHEAD_LAYOUTS:
            for seq in tp_overhead_seqs(kind, model.seq, plan.tp):
                add(Point("tp_overhead", layout, dtype, point_shape(mbs=plan.mbs, seq=seq, hidden=model.hidden,
                                                               heads=model.heads),
                          group=(plan.tp, int(columns_of(plan).strides["tp"])), origin="plan"))
    return points


# --- timing ---

@dataclass
class Stats:
    times_s: list

    def as_dict(self, number: int) -> dict:
        t = sorted(self.times_s)
        q = np.quantile(t, [0.25, 0.75]) if len(t) > 1 else (t[0], t[0])
        return {"median_s": statistics.median(t), "min_s": t[0], "max_s": t[-1], "mean_s": statistics.fmean(t),
                "std_s": statistics.pstdev(t) if len(t) > 1 else 0.0, "p25_s": float(q[0]), "p75_s": float(q[1]),
                "repeats": len(t), "number": number}


# A call slower than LONG_CALL_S is its own warm-up (its first call pays the one-off costs, which a
# call this long dwarfs anyway) and is repeated only while its point stays within LONG_POINT_S, at
# least LONG_REPEATS times. On a machine far slower than the sweep was sized for (bf16 GEMMs on a
# CPU without bf16 instructions run 60-90x slower than fp32: 2.35 s for one 1024^3 product on
# this project's AVX2 VM) a campaign then takes minutes per sweep instead of hours.
LONG_CALL_S = 0.5
LONG_POINT_S = 4.0
LONG_REPEATS = 2


# Collectives are repeated until the mean of their repetitions (what a step pays per call) is known
# to COLLECTIVE_PRECISION, relative standard error, or the point has been timed for
# COLLECTIVE_POINT_BUDGET_S. Calls that barely scatter (a GPU's, a large message's) stop at the
# planned repetitions; gloo's small calls on a shared CPU are bimodal (a fast mode and one a
# scheduler tick later, 0.3 vs 4 ms on the project VM), and at the planned 5-20 repetitions their
# means carried a 15% standard error (median over points), more than the held-out target allows.
# The two modes come in runs, tens of calls each (400 sends of 128 KiB after GEMM bursts: runs of
# 10-60 in one mode, docs/calibration.md 4.2), so neighbouring repetitions are not independent and
# a batch that fell in one run looks precise: mkl-compat r7's 128 KiB send stopped after 20
# repetitions at 0.21 ms, its neighbours' means 2.1-2.3 ms. The error is therefore estimated from
# the means of the batches (the batch-means method), over COLLECTIVE_MIN_BATCHES batches at least.
COLLECTIVE_PRECISION = 0.05
COLLECTIVE_POINT_BUDGET_S = 1.0
COLLECTIVE_MIN_BATCHES = 3


def relative_standard_error(times: list, batch: int = 1) -> float:
    """Standard error of the mean of `times` over the mean, estimated from the means of consecutive
    batches of `batch` repetitions (single repetitions by default; a trailing partial batch is
    left out); inf for fewer than two batches."""
    means = [statistics.fmean(times[i:i + batch]) for i in range(0, len(times) - batch + 1, batch)]
    if len(means) < 2:
        return math.inf
    mean = statistics.fmean(means)
    return statistics.stdev(means) / math.sqrt(len(means)) / mean if mean > 0 else math.inf


def mean_known(times: list, batch: int) -> bool:
    """Is the mean of these (slowest-rank) times known well enough to stop: at least
    COLLECTIVE_MIN_BATCHES batches of `batch`, and a relative standard error over the batches'
    means within COLLECTIVE_PRECISION?"""
    return len(times) >= COLLECTIVE_MIN_BATCHES * batch and relative_standard_error(times, batch) <= COLLECTIVE_PRECISION


def call_seconds(timer, fn) -> float:
    """Seconds of one call of `fn` on `timer` (device.timer()), floored at 1e-9: a coarse clock
    may read 0."""
    timer.start()
    fn()
    return max(timer.stop(), 1e-9)


def repetitions(device, fn, warmup: int, repeats: int, min_time_s: float, agree=None, before=None,
                max_number: int = 1000, budget_s: float = 0.05, max_repeats_factor: int = 4, cpu_clock=None,
                min_number: int = 1, more=None):
    """(per-call seconds of each repetition, calls per repetition, per-call CPU seconds of each
    repetition or None). `cpu_clock` (time.thread_time on a one-thread CPU rank) also times the
    CPU the rank actually got, which leaves out time other processes took the core. One untimed estimate sets
    `number` (calls per repetition, so that one lasts `min_time_s`) and, for cheap ops, more
    repetitions (up to `max_repeats_factor` x `repeats` while they fit in `budget_s`): noise hits
    short ops hardest; `min_number` is the fewest calls a repetition makes. `agree(seconds)` makes every rank use the slowest rank's estimate
    (collectives must make the same calls everywhere); `before()` runs untimed before each
    repetition; `more(times)`, asked after the planned repetitions and after each further batch of
    as many, says whether to time another batch (it must answer alike on every rank). A call longer than LONG_CALL_S: one call per repetition, few repetitions."""
    timer = device.timer()

    def timed_call() -> float:
        device.sync()
        if before:
            before()
        seconds = call_seconds(timer, fn)
        return max(agree(seconds), 1e-9) if agree else seconds

    first = timed_call()  # the first warm-up call, timed: a long call needs no other
    if first > LONG_CALL_S and getattr(device, "kind", "cpu") != "cpu":
        # on a GPU a long first call is mostly one-off setup (lazy module loading, an attention
        # backend's plan): timing single calls then measured a 70 us flash kernel as a "long"
        # one, host dispatch and warm-up included (perfsim.calibrate.host_bound); a second call says
        first = timed_call()
    if first > LONG_CALL_S:
        number, repeats = 1, max(LONG_REPEATS, min(repeats, int(LONG_POINT_S / first)))
    else:
        for _ in range(warmup - 1):
            fn()
        estimate = timed_call()
        number = int(min(max_number, max(min_number, math.ceil(min_time_s / estimate))))
        extra = int(budget_s / (number * estimate))
        repeats = int(min(max_repeats_factor * repeats, max(repeats, extra)))
    times, cpu_times = [], [] if cpu_clock else None
    batches = 0
    while batches == 0 or (more is not None and more(times)):
        batches += 1
        for _ in range(repeats):
            if before:
                before()
            c0 = cpu_clock() if cpu_clock else 0.0
            timer.start()
            for _ in range(number):
                fn()
            times.append(timer.stop() / number)
            if cpu_clock:
                cpu_times.append(max(cpu_clock() - c0, 1e-9) / number)
    return times, number, cpu_times


def torch_dtype(torch, name: str):
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def make_compute(torch, device, point: Point):
    """A no-argument function running the point's op once (tensors allocated here, once)."""
    dt, dev, d = torch_dtype(torch, point.dtype), device.torch_device, point.dims
    F = torch.nn.functional
    if point.suite == "gemm":
        batch = () if d["count"] == 1 else (d["count"],)
        a = torch.randn(*batch, d["m"], d["k"], dtype=dt, device=dev)
        b = torch.randn(*batch, d["k"], d["n"], dtype=dt, device=dev)
        out = torch.empty(*batch, d["m"], d["n"], dtype=dt, device=dev)
        product = torch.matmul if d["count"] == 1 else torch.bmm
        if point.timing != GEMM_TIMING:
            return lambda: product(a, b, out=out)
        one = (a.numel() + b.numel() + out.numel()) * a.element_size()
        copies = [(a, b, out)] + [(a.clone(), b.clone(), out.clone())
                                  for _ in range(min(MAX_COPIES, math.ceil(ROTATING_BYTES[device.kind] / one)) - 1)]
        turn = itertools.cycle(copies)

        def rotating():
            x, y, z = next(turn)
            return product(x, y, out=z)
        return rotating
    if point.suite == "memory":
        shape = (d["rows"], d["cols"])
        x = torch.randn(shape, dtype=dt, device=dev)
        op = point.op
        if op == "copy":
            y = torch.empty_like(x)
            return lambda: y.copy_(x)
        if op == "triad":
            y, z = torch.randn_like(x), torch.empty_like(x)
            return lambda: torch.add(x, y, alpha=3.0, out=z)
        if op == "add":
            y = torch.randn_like(x)
            return lambda: x + y
        if op == "layernorm":
            w, b = torch.ones(d["cols"], dtype=dt, device=dev), torch.zeros(d["cols"], dtype=dt, device=dev)
            return lambda: F.layer_norm(x, (d["cols"],), w, b)
        if op == "softmax":
            return lambda: torch.softmax(x, dim=-1)
        if op == "gelu":
            return lambda: F.gelu(x)
        if op == "dropout":
            return lambda: F.dropout(x, p=0.1, training=True)
        # Backward kernels alone: what autograd saved (statistics, outputs) is made once, untimed.
        g = torch.randn_like(x) if op in BACKWARD_OPS else None
        if op == "layernorm_backward":  # input, weight and bias gradients, as a training step asks
            w, b = torch.ones(d["cols"], dtype=dt, device=dev), torch.zeros(d["cols"], dtype=dt, device=dev)
            _, mean, rstd = torch.native_layer_norm(x, (d["cols"],), w, b, 1e-5)
            return lambda: torch.ops.aten.native_layer_norm_backward(g, x, (d["cols"],), mean, rstd, w, b,
                                                                      [True, True, True])
        if op == "softmax_backward":
            y = torch.softmax(x, dim=-1)
            return lambda: torch._softmax_backward_data(g, y, -1, dt)
        if op == "gelu_backward":
            return lambda: torch.ops.aten.gelu_backward(g, x)
        # The loss as the training step takes it (validate.loss: the logits [rows, vocabulary] cast
        # to fp32, the softmax in that copy, mean cross-entropy over integer targets), and its
        # backward's kernels down to the logits' gradient in their own dtype (validate.loss's own
        # function, on a softmax made once: it rewrites that buffer in place, which changes its
        # values from call to call but not the kernels' work).
        from validate.loss import cross_entropy, logits_gradient

        targets = torch.randint(0, d["cols"], (d["rows"],), device=dev)
        if op == "cross_entropy":
            return lambda: cross_entropy(x, targets)
        if op == "cross_entropy_backward":
            softmax = torch.softmax(x.float(), dim=-1)
            mine = torch.ones_like(targets, dtype=torch.bool)
            return lambda: logits_gradient(softmax, targets, mine, 1.0 / d["rows"], dt)
        raise ValueError(f"unknown memory op {op}")
    if point.suite == "attention":
        shape = (d["batch"], d["heads"], d["seq"], d["head_dim"])
        q, k, v = (torch.randn(shape, dtype=dt, device=dev) for _ in range(3))
        if point.op == "sdpa":
            return lambda: F.scaled_dot_product_attention(q, k, v)
        if point.op == "flash":  # the kernel a flash-attention step runs (validate.gpt)
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if point.op == "flash_backward":  # its backward alone: the graph is kept, each call reruns the backward kernel
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        q = q * (1.0 / math.sqrt(d["head_dim"]))  # scale folded into Q, as fused kernels do

        def unfused():  # perfsim's attention core: scores GEMM, softmax, context GEMM (no mask: full s x s)
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1), v)
        return unfused
    raise ValueError(f"not a compute point: {point.suite}")


class References:
    """The reference kernels of a campaign's rank (REFERENCE_SUITES), built once."""

    def __init__(self, torch, device):
        kind = "cpu" if device.kind == "cpu" else "gpu"
        dtype = BURST_DTYPE[kind]
        m, n, k = BURST_GEMM[kind]
        rows, cols = REFERENCE_NORM[kind]
        gemm = Point("gemm", "matmul", dtype, point_shape(count=1, m=m, n=n, k=k), timing=GEMM_TIMING)
        norm = Point("memory", "layernorm", dtype, point_shape(rows=rows, cols=cols))
        self.device, self.timer = device, device.timer()
        self.calls = {"gemm": (make_compute(torch, device, gemm), 1),
                      "memory": (make_compute(torch, device, norm), REFERENCE_NORM_LOOPS)}
        for fn, _ in self.calls.values():
            fn()  # first touch outside the timing

    def time(self) -> dict:
        """{reference: seconds of one call}, each the median of REFERENCE_CALLS calls."""
        return {name: self.time_one(name) for name in self.calls}

    def time_one(self, name: str) -> float:
        """Seconds of one call of reference `name` ("gemm" or "memory"), the median of REFERENCE_CALLS."""
        fn, loops = self.calls[name]
        times = []
        for _ in range(REFERENCE_CALLS):
            self.device.sync()
            self.timer.start()
            for _ in range(loops):
                fn()
            times.append(self.timer.stop() / loops)
        return statistics.median(times)


def compute_counts(point: Point) -> dict:
    """FLOPs and bytes recorded with a compute point (perfsim's conventions)."""
    d = point.dims
    if point.suite == "gemm":
        flops = 2.0 * d["count"] * d["m"] * d["n"] * d["k"]
        e = DTYPE_BYTES[point.dtype]
        return {"flops": flops, "nbytes": e * d["count"] * (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"])}
    if point.suite == "memory":
        nbytes = traffic_bytes(point.op, d["rows"] * d["cols"], point.dtype)
        return {"nbytes": int(nbytes) if float(nbytes).is_integer() else nbytes}
    if point.suite == "attention":
        flops = 2 * 2.0 * d["batch"] * d["heads"] * d["seq"] * d["seq"] * d["head_dim"]
        return {"flops": flops}
    return {}


def _works(result) -> list:
    """The works an asynchronous collective returned, as a list (none for a synchronous call)."""
    return [] if result is None else [result]


class Communicator:
    """Collectives over the groups of one (size, stride) dimension; every rank calls every method
    (new_group is collective over the whole world)."""

    def __init__(self, torch, device, rank: int, world: int, shapes: list):
        self.torch, self.dist, self.device = torch, torch.distributed, device
        self.rank, self.world = rank, world
        self.groups = {}
        for size, stride in shapes:
            for members in groups_of(size, stride, world):
                handle = self.dist.new_group(members) if size < world else None
                if rank in members:
                    self.groups[(size, stride)] = (handle, members)

    def barrier(self):
        self.dist.barrier()

    def agree_max(self, value: float) -> float:
        t = self.torch.tensor([float(value)], dtype=self.torch.float64 if self.device.kind == "cpu"
                              else self.torch.float32, device=self.device.torch_device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def max_each(self, values: list) -> list:
        t = self.torch.tensor(values, dtype=self.torch.float32 if self.device.kind != "cpu" else self.torch.float64,
                              device=self.device.torch_device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return [float(x) for x in t.tolist()]

    def gather_values(self, value: float) -> list:
        t = self.torch.zeros(self.world, dtype=self.torch.float64 if self.device.kind == "cpu" else self.torch.float32,
                             device=self.device.torch_device)
        t[self.rank] = value
        self.dist.all_reduce(t)
        return [float(x) for x in t.tolist()]

    def compute_burst(self):
        """Run one GEMM on this rank, the compute a step does between collectives: BURST_SECONDS
        long (BURST_GEMM's rows scaled to it on the first call, the slowest rank's timing agreed by
        every rank so that all run the same burst), in BURST_DTYPE."""
        if not hasattr(self, "_burst"):
            self._burst = self._sized_burst()
        a, b = self._burst
        self.torch.matmul(a, b)
        self.device.sync()

    def burst_of(self, seconds: float):
        """A no-argument function running the burst GEMM sized to last `seconds` on the slowest rank
        (without waiting for the device: a concurrent point waits once for both)."""
        a, b = self._sized_burst(seconds)
        return lambda: self.torch.matmul(a, b)

    def time_concurrent(self, point: Point, rounds: int, warmup: int, more=None) -> dict:
        """Seconds of the point's collective beside compute, lists over `rounds` rounds: "both" (the
        call started asynchronously, a burst as long as the call alone run meanwhile on this rank,
        then waited for), "burst" (that burst alone) and "alone" (the call alone), each after the
        standard burst as an interleaved call is, the three in alternation so that each round's
        ratio is taken within a few milliseconds on a drifting machine; the slowest rank's time.
        `more(both)`, asked after the rounds and after each further batch of as many: whether to
        time another batch (repetitions' `more`: the mean of "both" precise enough, or out of time)."""
        start = self.make(point, async_op=True)
        timer = self.device.timer()

        def alone():
            for work in start():
                work.wait()

        def timed(fn) -> float:
            self.compute_burst()
            return max(self.agree_max(call_seconds(timer, fn)), 1e-9)

        for _ in range(warmup):
            alone()
        burst = self.burst_of(statistics.median(timed(alone) for _ in range(3)))

        def both():
            works = start()
            burst()
            for work in works:
                work.wait()

        times = {"burst": [], "alone": [], "both": []}
        while not times["both"] or (more is not None and more(times["both"])):
            for _ in range(rounds):
                for name, fn in (("burst", burst), ("alone", alone), ("both", both)):
                    times[name].append(timed(fn))
        return times

    def time_in_turn(self, points: list, rounds: int, warmup: int, more) -> list:
        """Seconds of each point's collective on this rank, every call timed as an interleaved call
        is (alone, right after the standard burst), but the points visited in turn, one call each
        per visit: `rounds` visits, then as many again for the points `more(times)` returns (their
        indices; the same on every rank) until it returns none. gloo's fast and slow modes last
        longer than a point's second of calls (section 4.2 of docs/calibration.md), so points
        timed one after the other each caught their own mix of them and the sizes of one operation
        came out jagged; in turn, every point samples the same stretch of the machine's time."""
        fns = [self.make(point) for point in points]
        for fn in fns:
            for _ in range(warmup):
                fn()
        timer = self.device.timer()
        times = [[] for _ in points]
        visiting = list(range(len(points)))
        while visiting:
            for _ in range(rounds):
                for i in visiting:
                    self.compute_burst()
                    times[i].append(call_seconds(timer, fns[i]))
            visiting = more(times)
        return times

    def _sized_burst(self, target: float | None = None) -> tuple:
        torch, dev = self.torch, self.device.torch_device
        kind = "cpu" if self.device.kind == "cpu" else "gpu"
        m, n, k = BURST_GEMM[kind]
        dt = torch_dtype(torch, BURST_DTYPE[kind])
        a, b = torch.ones(m, k, dtype=dt, device=dev), torch.ones(k, n, dtype=dt, device=dev)
        torch.matmul(a, b)  # warm-up
        self.device.sync()
        start = time.perf_counter()
        torch.matmul(a, b)
        self.device.sync()
        slowest = max(self.gather_values(time.perf_counter() - start))
        rows = burst_rows(m, slowest, BURST_SECONDS[kind] if target is None else target)
        return torch.ones(rows, k, dtype=dt, device=dev), b

    def make(self, point: Point, async_op: bool = False):
        """A no-argument function running the point's collective once on this rank's group; with
        `async_op`, one that starts it and returns the works to wait for (a list)."""
        torch, dist = self.torch, self.dist
        group, members = self.groups[point.group]
        g, me = len(members), members.index(self.rank)
        dt = torch_dtype(torch, point.dtype)
        e = DTYPE_BYTES[point.dtype]
        elements = max(g, (point.dims["nbytes"] // e) // g * g)  # divisible by the group size
        dev = self.device.torch_device
        op = point.op
        if op == "all_reduce":
            x = torch.ones(elements, dtype=dt, device=dev)
            return lambda: _works(dist.all_reduce(x, group=group, async_op=async_op))
        if op == "all_gather":
            x = torch.ones(elements // g, dtype=dt, device=dev)
            out = torch.empty(elements, dtype=dt, device=dev)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: _works(gather(out, x, group=group, async_op=async_op))
        if op == "reduce_scatter":
            x = torch.ones(elements, dtype=dt, device=dev)
            out = torch.empty(elements // g, dtype=dt, device=dev)
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return lambda: _works(scatter(out, x, group=group, async_op=async_op))
        if op == "broadcast":
            x = torch.ones(elements, dtype=dt, device=dev)
            return lambda: dist.broadcast(x, src=members[0], group=group)
        if op == "reduce":
            x = torch.ones(elements, dtype=dt, device=dev)
            return lambda: dist.reduce(x, dst=members[0], group=group)
        if op == "all_to_all":  # every member sends elements / g to each member (itself included)
            x = torch.ones(elements, dtype=dt, device=dev)
            out = torch.empty(elements, dtype=dt, device=dev)
            return lambda: _works(dist.all_to_all_single(out, x, group=group, async_op=async_op))
        if op == "send":  # a chain: member j sends to j + 1 while receiving from j - 1, all at once
            x = torch.ones(elements, dtype=dt, device=dev)
            y = torch.empty(elements, dtype=dt, device=dev)

            def exchange():
                ops = []
                if me + 1 < g:
                    ops.append(dist.P2POp(dist.isend, x, members[me + 1], group=group))
                if me > 0:
                    ops.append(dist.P2POp(dist.irecv, y, members[me - 1], group=group))
                works = dist.batch_isend_irecv(ops)
                if async_op:
                    return works
                for work in works:
                    work.wait()
            return exchange
        raise ValueError(f"unknown collective {op}")

    def nbytes(self, point: Point) -> int:
        """The bytes actually moved per call, perfsim's convention (full tensor)."""
        g = point.group[0]
        e = DTYPE_BYTES[point.dtype]
        return max(g, (point.dims["nbytes"] // e) // g * g) * e
