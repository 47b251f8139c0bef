"""Plans as numeric columns: what every cost function reads.

One plan gives numbers; a search gives numpy arrays of the same names (one entry per plan), and
the cost functions, written with broadcasting arithmetic and np.where, evaluate all at once.
Strings that change the formulas themselves (tp_mode, order) are fixed per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np

from perfsim.cost import measured, pipeline
from perfsim.cost.collectives import group_strides
from perfsim.spec.layout import parse_layout
from perfsim.spec.plan import RECOMPUTE, SCHEDULES, Plan, ranks_order

NONE, SELECTIVE, FULL = (RECOMPUTE.index(r) for r in ("none", "selective", "full"))
GPIPE, ONE_F_ONE_B, INTERLEAVED = (SCHEDULES.index(s) for s in ("gpipe", "1f1b", "interleaved"))


@dataclass
class Columns:
    tp: object
    pp: object
    dp: object
    vpp: object
    mbs: object
    gbs: object
    sp: object  # 0 or 1
    zero: object
    recompute: object  # index into RECOMPUTE
    schedule: object  # index into SCHEDULES
    tp_depth: object = 1
    regather: object = 0  # 3d: re-gather X and W in backward (0: keep the gathered copies)
    flash: object = 0  # 1: the attention core as one fused kernel (plan.attention == "flash")
    dp_overlap: object = 0  # 1: data-parallel reductions and gathers overlap compute, bucket by bucket
    tp_overlap: object = 0  # 1: 1d + SP collectives pipelined with their GEMMs, in chunks
    fp8: int = 0  # 1: the layers' GEMMs in FP8 (--dtype fp8, a command's choice, not a plan field: at_dtype)
    first_layers: object = 0  # the first stage's own layer count (0: even split; stage_layer_count)
    last_layers: object = 0  # the last stage's own layer count (0: even split)
    cp: object = 1  # context parallelism: ranks sharing each sequence
    ep: object = 1  # expert parallelism (MoE models; cost/experts.py)
    etp: object = 0  # tensor parallelism inside the experts; 0: tp
    allgather: object = 0  # 1: the all-gather token dispatcher, 0: the all-to-all one (plan.moe_dispatcher)
    flex: object = 0  # 1: the flex dispatcher (DeepEP; allgather 0): a token's copy once a node (cost/experts.py)
    ep_overlap: object = 0  # 1: all-to-alls beside another micro-batch's compute (plan.ep_overlap)
    layout: object = None  # a PipelineLayout (spec/layout.py) placing every layer, one per batch; None: the counts above
    element: float = 2.0  # bytes of a weight and an activation element: 2 (bf16, fp16, fp8's bf16), 4 in fp32 (at_dtype)
    tp_mode: str = "1d"
    order: str = "tp-dp-pp"
    tp_axes: str = "auto"
    # Strides of tp, cp, dp and pp per row, for a batch whose rows come from several rank orders
    # (`stacked`); None: every row's from `order`.
    order_strides: dict | None = None

    @cached_property
    def microbatches(self):
        """Micro-batches each pipeline runs per step. Cached: the cost code asks for it dozens of
        times a batch, a floor division over a million plans each time."""
        return self.gbs // (self.mbs * self.dp)

    @cached_property
    def dp_cp(self):
        """The ranks holding copies of the same weights: gradients are reduced, and ZeRO shards,
        over data and context parallelism together (Megatron-Core's dp-cp group). Cached: the
        topology model remembers a batch's groups by the identity of its size arrays."""
        return self.dp * self.cp

    @property
    def expert_tp(self):
        """Tensor parallelism inside the experts: etp, or tp where etp is 0 (Megatron-Core's default)."""
        return np.where(np.asarray(self.etp) > 0, self.etp, self.tp)

    @cached_property
    def strides(self) -> dict:
        """Stride in rank space of tp, cp, dp and pp, and of the joint dp-cp group ("dp_cp")."""
        strides = dict(self.order_strides) if self.order_strides is not None else \
            group_strides(ranks_order(self.order), {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp})
        strides["dp_cp"] = joint_stride(self.cp, strides["cp"], self.dp, strides["dp"])
        return strides


def joint_stride(size_a, stride_a, size_b, stride_b):
    """Stride of the group joining two dimensions, as one (size_a x size_b, stride) group: exact
    where they are neighbours in the rank order (the outer one's stride is the inner one's times
    its size) or one of them has size 1; otherwise the outer stride, a group as wide as its widest
    step (an approximation: the real members are not evenly spaced; docs/equations.md 11.1)."""
    inner, outer = np.minimum(stride_a, stride_b), np.maximum(stride_a, stride_b)
    inner_size = np.where(stride_a <= stride_b, size_a, size_b)
    joint = np.where(outer == inner * inner_size, inner, outer)
    return np.where(size_a == 1, stride_b, np.where(size_b == 1, stride_a, joint))


# bytes of a weight and an activation element by training dtype: fp8 keeps bf16 activations and
# weights beside its FP8 copies (docs/equations.md 3.11)
ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 2.0}


def at_dtype(c: Columns, dtype: str) -> Columns:
    """`c` trained in `dtype`: fp8 GEMMs (docs/equations.md 3.11), and tensors of its element size
    (fp32: 4 bytes where bf16 has 2, in memory, element-wise traffic and communication)."""
    return replace(c, fp8=int(dtype == "fp8"), element=ELEMENT_BYTES.get(dtype, 2.0))


def columns_of(plan: Plan) -> Columns:
    """Sizes as floats: products of several large sizes stay finite instead of overflowing int64."""
    return Columns(tp=float(plan.tp), pp=float(plan.pp), dp=float(plan.dp), vpp=float(plan.vpp), mbs=float(plan.mbs),
                   gbs=float(plan.gbs),
                   sp=int(plan.sp), zero=plan.zero, recompute=RECOMPUTE.index(plan.recompute),
                   schedule=SCHEDULES.index(plan.schedule), tp_depth=plan.tp_depth, regather=int(plan.tp_regather),
                   flash=int(plan.attention == "flash"), dp_overlap=int(plan.dp_overlap), tp_overlap=int(plan.tp_overlap),
                   cp=float(plan.cp), tp_mode=plan.tp_mode, ep=float(plan.ep), etp=float(plan.etp),
                   allgather=int(plan.moe_dispatcher == "allgather"), flex=int(plan.moe_dispatcher == "flex"),
                   ep_overlap=int(plan.ep_overlap),
                   first_layers=float(plan.first_stage_layers), last_layers=float(plan.last_stage_layers),
                   order=plan.order, tp_axes=plan.tp_axes,
                   layout=parse_layout(plan.pp_layout, plan.pp) if plan.pp_layout else None)


def columns_of_many(plans: list[Plan]) -> Columns:
    """Plans sharing tp_mode, order and tp_axes (and a pipeline layout, if any), as arrays."""
    first = plans[0]
    one = [columns_of(p) for p in plans]
    arrays = {name: np.array([getattr(c, name) for c in one], dtype=float)
              for name in ("tp", "pp", "dp", "vpp", "mbs", "gbs", "sp", "zero", "recompute", "schedule",
                                "tp_depth", "regather", "flash", "dp_overlap", "tp_overlap", "cp",
                                "first_layers", "last_layers", "ep", "etp", "allgather",
                                "flex", "ep_overlap")}
    return Columns(**arrays, tp_mode=first.tp_mode, order=first.order, tp_axes=first.tp_axes, layout=one[0].layout)


def stage_layer_count(model, c: Columns, stage: str):
    """Decoder layers on a device of the "first", a "middle" or the "last" pipeline stage (or a
    layout's "stage i"): model.layers / pp, the plan's uneven split (spec.plan.stage_layers; with
    pp = 1 the one stage holds them all) or its layout (cost/pipeline.py)."""
    return pipeline.layer_count(model, c, stage)


def _array_fields(c: Columns) -> list[str]:
    return [f.name for f in fields(Columns) if isinstance(getattr(c, f.name), np.ndarray)]


def stacked(parts: list[Columns]) -> Columns:
    """Batches of one tensor-parallel mode and grid axes but any rank orders, as one batch whose
    rows keep their own order's strides (the order reaches the cost code only through them): the
    robust search prices every order of a mode in one call. Every field that varies must be an array."""
    names = _array_fields(parts[0])
    return replace(parts[0], **{name: np.concatenate([getattr(p, name) for p in parts]) for name in names},
                   order_strides={dim: np.concatenate([np.broadcast_to(p.strides[dim], np.shape(p.tp)) for p in parts])
                                  for dim in ("tp", "cp", "dp", "pp")})


def rows_of(c: Columns, index) -> Columns:
    """The rows `index` of a batch (repeated rows allowed), their strides with them."""
    return replace(c, **{name: getattr(c, name)[index] for name in _array_fields(c)},
                   order_strides={dim: np.broadcast_to(c.strides[dim], np.shape(c.tp))[index]
                                  for dim in ("tp", "cp", "dp", "pp")})


def distinct_rows_of(c: Columns, unread: tuple, extra: list = (), system=None) -> tuple | None:
    """(the distinct rows of a batch `c` as Columns, a row of `c` of each, each row's index among
    them): rows alike in every array field but `unread` and in the `extra` arrays (one value a
    row) are one. A search's batch repeats, say, each layer over the pipeline knobs, so what
    reads none of them is priced once a distinct row and spread back (x[index]), the same numbers
    element by element. The `unread` fields are None in the distinct rows: code that comes to
    read one fails loudly. None where `c` is not a batch of equal 1-d rows, or where `system`'s
    numbers are arrays (draws of its ranges, perfsim.uncertainty: one a row, so alike rows differ)."""
    rows = np.shape(c.tp)
    names = [n for n in _array_fields(c) if n not in unread]
    if len(rows) != 1 or c.layout is not None or any(np.shape(getattr(c, n)) != rows for n in names) \
            or (system is not None and _drawn(system)):
        return None
    keys = [np.asarray(getattr(c, n), float) for n in names] + [np.asarray(x, float) for x in extra]
    first, inverse = measured.distinct_rows(keys, rows[0])
    return replace(rows_of(c, first), **{n: None for n in unread}), first, inverse


def _drawn(system) -> bool:
    """Whether any of the system's numbers is an array."""
    def arrays(value):
        return isinstance(value, np.ndarray) or (isinstance(value, tuple) and any(arrays(v) for v in value))

    return any(arrays(getattr(section, f.name))
               for section in (system.device, system.node, system.network, system.collectives, system.framework,
                               system.moe)
               for f in fields(section))
