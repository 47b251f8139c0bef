"""Parallel plans: immutable values, and every reason a plan cannot run a model."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from perfsim.spec.model import ModelSpec

TP_MODES = ("1d", "2d", "2.5d", "3d")
TP_AXES = {"1d": ("tp",), "2d": ("row", "col"), "2.5d": ("row", "col", "depth"), "3d": ("input", "weight", "output")}
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("unfused", "flash")  # the attention core as two GEMMs and a softmax, or one fused kernel
# Megatron-Core's --moe-token-dispatcher-type; flex as with its DeepEP backend (one copy a node, forwarded over NVLink)
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
DIMENSIONS = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"  # Megatron: tensor innermost, then data, then pipeline outermost
ORDERS = tuple("-".join(p) for p in itertools.permutations(DIMENSIONS))  # every rank order, DEFAULT_ORDER first
LARGEST_SIZE = 2**40  # sizes above this are typos, and would overflow the cost layer's integers
# Devices one plan may span: the topology model lays out every collective group rank by rank (a
# million-device data-parallel group takes it ~5 s and ~0.5 GB; the largest machines have ~10^5).
LARGEST_DEVICE_COUNT = 2**20


@dataclass(frozen=True)
class Plan:
    """One way to lay a training step over devices. Field names are the knob names everywhere."""

    tp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    dp: int = 1
    zero: int = 0
    mbs: int = 1
    gbs: int = 1
    recompute: str = "none"
    order: str = DEFAULT_ORDER
    tp_axes: str = "auto"  # tensor-parallel grid axes innermost first, or heaviest traffic innermost
    tp_regather: bool = False  # 3d: re-gather X and W for backward instead of keeping the gathered copies
    attention: str = "unfused"  # the command line's default is the profile's framework.attention
    dp_overlap: bool = False  # data-parallel reductions and gathers overlap compute, bucket by bucket
    tp_overlap: bool = False  # 1d + SP: all-gathers and reduce-scatters pipelined with their GEMMs in chunks
    # Uneven pipeline splits: the layers of the first and of the last stage (0: as the others), the
    # rest spread evenly over the other stages (stage_layers; Megatron-Core's
    # --decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers)
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    cp: int = 1  # context parallelism: ranks splitting each sequence (ring attention, causal load balancing)
    # A pipeline layout in Megatron-Core's string form (--pipeline-model-parallel-layout, spec/layout.py):
    # every virtual stage's layers, embedding, loss and MTP layers; "" for a split by the counts above
    pp_layout: str = ""
    # Mixture of experts (Megatron-Core's "parallel folding", docs/equations.md 12.1): the experts
    # run on etp x ep x expert-dp x pp over the ranks attention runs on as tp x cp x dp x pp
    ep: int = 1  # expert parallelism: ranks sharing a layer's routed experts (each holds experts / ep)
    etp: int = 0  # tensor parallelism inside each expert; 0: the attention's tp (Megatron-Core's default)
    moe_dispatcher: str = "alltoall"  # how tokens reach their experts: "alltoall", "allgather" or "flex"
    # Megatron-Core's --overlap-moe-expert-parallel-comm (Megatron-Bridge's moe_a2a_overlap): one
    # micro-batch's all-to-alls beside another's compute, forward and backward merged
    ep_overlap: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches each pipeline runs per step (the gradient-accumulation count)."""
        return self.gbs // (self.mbs * self.dp)

    @property
    def expert_tp(self) -> int:
        """Tensor parallelism inside the experts: etp, or the attention's tp where etp is 0."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert (expert-data parallelism): tp x cp x dp / (etp x ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def ranks_order(order: str) -> str:
    """`order` with context parallelism in its place: right after tp, as in Megatron-Core's
    tp-cp-ep-dp-pp. An order names three dimensions; cp takes no place of its own in it, so that
    "tp-dp-pp" means "tp-cp-dp-pp" (docs/equations.md 11.1)."""
    return order.replace("tp", "tp-cp", 1)


def stack_words(plan: Plan) -> str:
    """The plan's choices of today's stacks in words, "" for none (no context parallelism, unfused
    attention, nothing overlapped): "CP 4, flash attention, TP overlap, DP overlap"."""
    words = [f"CP {plan.cp}"] if plan.cp > 1 else []
    words += ["flash attention"] if plan.attention == "flash" else []
    words += [f"{name} overlap" for name, on in (("TP", plan.tp_overlap), ("DP", plan.dp_overlap)) if on]
    if plan.ep > 1 or plan.etp not in (0, plan.tp):
        words.append(f"EP {plan.ep}" + (f", ETP {plan.expert_tp}" if plan.expert_tp != plan.tp else ""))
    if plan.moe_dispatcher != "alltoall":
        words.append(f"{plan.moe_dispatcher} dispatcher")
    if plan.ep_overlap:
        words.append("EP overlap")
    return ", ".join(words)


def canonical_order(order: str, tp: int, dp: int, pp: int, orders=ORDERS) -> str:
    """The first of `orders` that numbers the ranks as `order` does. A dimension of size 1 takes
    no place in the numbering, so orders that differ only in where it sits are one layout. With
    context parallelism pass tp x cp as `tp`: cp sits right after tp, the two one block."""
    sizes = {"tp": tp, "dp": dp, "pp": pp}

    def placed(o: str) -> list:
        return [d for d in o.split("-") if sizes[d] > 1]

    return next((o for o in orders if placed(o) == placed(order)), order)


def canonical(plan: Plan) -> Plan:
    """`plan` with the choices that change nothing written one way, so that equal plans compare
    equal: the place of size-1 dimensions in the rank order, and the ZeRO stage and the overlap of
    data-parallel communication without data or context parallelism (one replica has nothing to
    shard or send), and an expert tensor parallelism equal to tp (0, its default)."""
    replicas = plan.dp * plan.cp  # the group gradients are reduced over (and ZeRO shards over)
    return plan.replace(order=canonical_order(plan.order, plan.tp * plan.cp, plan.dp, plan.pp),
                        zero=plan.zero if replicas > 1 else 0, dp_overlap=plan.dp_overlap and replicas > 1,
                        etp=0 if plan.etp == plan.tp else plan.etp, ep_overlap=plan.ep_overlap and plan.ep > 1)


def device_count_problem(devices: int) -> str | None:
    """Why perfsim cannot model `devices` devices (None if it can)."""
    if devices <= LARGEST_DEVICE_COUNT:
        return None
    return (f"{devices:,} devices is more than perfsim models (at most {LARGEST_DEVICE_COUNT:,}: its topology "
            f"model lays out every collective group rank by rank)")


def plan_problems(plan: Plan, model: ModelSpec, devices: int | None = None) -> list[str]:
    """Every reason `plan` cannot train `model` (on `devices` devices, when given); empty if none."""
    reasons = []
    for name in ("tp", "tp_depth", "cp", "pp", "vpp", "dp", "mbs", "gbs"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            reasons.append(f"{name} must be a positive whole number, got {value!r}")
        elif value > LARGEST_SIZE:
            reasons.append(f"{name} {value} is implausibly large (at most {LARGEST_SIZE})")
    if reasons:
        return reasons
    if plan.devices > LARGEST_DEVICE_COUNT:
        return [f"{device_product(plan, values=False)} = {device_count_problem(plan.devices)}"]
    if plan.tp_mode not in TP_MODES:
        reasons.append(f"tp_mode must be one of {', '.join(TP_MODES)}, got {plan.tp_mode!r}")
    else:
        reasons += _grid_problems(plan, model)
        if model.mla and plan.tp_mode != "1d":
            reasons.append(f"latent attention (attention_type = mla) runs beside 1d tensor parallelism only "
                           f"(Megatron-Core's MLASelfAttention); got --tp-mode {plan.tp_mode}")
    if plan.schedule not in SCHEDULES:
        reasons.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {plan.schedule!r}")
    if plan.recompute not in RECOMPUTE:
        reasons.append(f"recompute must be one of {', '.join(RECOMPUTE)}, got {plan.recompute!r}")
    if plan.attention not in ATTENTION:
        reasons.append(f"attention must be one of {', '.join(ATTENTION)}, got {plan.attention!r}")
    if isinstance(plan.zero, bool) or plan.zero not in (0, 1, 2, 3):
        reasons.append(f"zero must be 0, 1, 2 or 3, got {plan.zero!r}")
    for name in ("sp", "dp_overlap", "tp_overlap"):
        if not isinstance(getattr(plan, name), (bool, np.bool_)):
            reasons.append(f"{name} must be true or false, got {getattr(plan, name)!r}")
    if not isinstance(plan.order, str) or sorted(plan.order.split("-")) != sorted(DIMENSIONS):
        reasons.append(f"order must list tp, dp and pp innermost first, like {DEFAULT_ORDER}; got {plan.order!r}")
    if plan.sp and plan.tp_mode != "1d":
        reasons.append("sequence parallelism (--sp) applies to 1d tensor parallelism only")
    if isinstance(plan.tp_overlap, (bool, np.bool_)) and plan.tp_overlap and not (plan.sp and plan.tp_mode == "1d"):
        reasons.append("tp_overlap (--tp-overlap) pipelines the all-gathers and reduce-scatters of 1d tensor "
                       "parallelism with sequence parallelism: add --sp")
    if plan.tp_depth != 1 and plan.tp_mode != "2.5d":
        reasons.append("tp_depth applies to --tp-mode 2.5d only")
    if plan.tp_regather and plan.tp_mode != "3d":
        reasons.append("tp_regather applies to --tp-mode 3d only")

    if plan.tp_mode == "1d":
        if model.heads % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the {model.heads} attention heads")
        elif model.kv_head_count % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the {model.kv_head_count} key/value heads")
        if model.ffn_size % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the MLP width {model.ffn_size}")
        if plan.sp and model.seq % (plan.tp * plan.cp):
            tokens = f"the {model.seq} / cp {plan.cp} tokens of a context-parallel rank" if plan.cp > 1 \
                else f"the sequence length {model.seq}"
            reasons.append(f"with --sp, tp {plan.tp} must divide {tokens}")
    reasons += context_parallel_problems(plan, model)
    reasons += expert_parallel_problems(plan, model)
    split = pipeline_split_problems(plan, model) + layout_plan_problems(plan, model)
    reasons += split
    if model.layers % (plan.pp * plan.vpp) and not split and not uneven(plan):
        what = f"pp x vpp = {plan.pp * plan.vpp}" if plan.vpp > 1 else f"pp {plan.pp}"
        reasons.append(f"{what} must divide the {model.layers} layers" + ("" if plan.vpp > 1 else
                       ", or the first and last stage need counts of their own (--first-stage-layers, --last-stage-layers)"))
    if plan.schedule == "interleaved" and plan.vpp < 2:
        reasons.append("the interleaved schedule needs --vpp 2 or more")
    if plan.vpp > 1 and plan.schedule != "interleaved":
        reasons.append(f"--vpp {plan.vpp} needs --schedule interleaved")
    if plan.schedule == "interleaved" and plan.pp < 2:
        reasons.append("the interleaved schedule needs pp of 2 or more")
    if plan.gbs % (plan.mbs * plan.dp):
        reasons.append(f"global batch {plan.gbs} must be a multiple of mbs x dp = {plan.mbs * plan.dp}")
    elif plan.schedule == "interleaved" and plan.microbatches % plan.pp:
        reasons.append(f"the interleaved schedule needs the {plan.microbatches} micro-batches to be a multiple of pp {plan.pp}")
    if devices is not None and devices != plan.devices:
        reasons.append(f"{device_product(plan)} = {plan.devices} does not match the {devices} devices")
    return reasons


def device_product(plan: Plan, values: bool = True) -> str:
    """"tp x pp x dp = 8 x 4 x 2" (cp named only where the plan has it)."""
    names = ("tp", "cp", "pp", "dp") if plan.cp != 1 else ("tp", "pp", "dp")
    text = " x ".join(names)
    return f"{text} = {' x '.join(str(getattr(plan, n)) for n in names)}" if values else text


def context_parallel_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Why `plan`'s context parallelism cannot split `model`'s sequences (docs/equations.md 11.1)."""
    if plan.cp == 1:
        return []
    reasons = []
    if plan.tp_mode != "1d":
        reasons.append(f"context parallelism (--cp) runs beside 1d tensor parallelism only, as in Megatron-Core; "
                       f"got --tp-mode {plan.tp_mode}")
    if model.seq % (2 * plan.cp):
        reasons.append(f"cp {plan.cp} needs the sequence length {model.seq} to be a multiple of 2 x cp = "
                       f"{2 * plan.cp} (causal load balancing cuts each sequence into 2 x cp chunks)")
    return reasons


def expert_parallel_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Why `plan`'s expert layout cannot run `model`'s experts (Megatron-Core's parallel folding:
    etp x ep x expert-dp = tp x cp x dp inside each pipeline stage; docs/equations.md 12.1)."""
    reasons = []
    for name in ("ep", "etp"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "ep" else 0):
            return [f"{name} must be a {'positive ' if name == 'ep' else ''}whole number"
                    f"{' (0: the attention tp)' if name == 'etp' else ''}, got {value!r}"]
        if value > LARGEST_SIZE:
            return [f"{name} {value} is implausibly large (at most {LARGEST_SIZE})"]
    if not isinstance(plan.ep_overlap, (bool, np.bool_)):
        return [f"ep_overlap must be true or false, got {plan.ep_overlap!r}"]
    if plan.ep_overlap and (plan.ep < 2 or plan.moe_dispatcher == "allgather"):
        reasons.append("ep_overlap (--ep-overlap) overlaps the dispatch's all-to-alls: it needs --ep 2 "
                       "or more and --moe-dispatcher alltoall or flex")
    if plan.moe_dispatcher not in MOE_DISPATCHERS:
        reasons.append(f"moe_dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {plan.moe_dispatcher!r}")
    if not model.moe:
        if plan.ep > 1 or plan.etp not in (0, plan.tp) or plan.ep_overlap:
            reasons.append(f"--ep, --etp and --ep-overlap split a mixture of experts; {model.name} is dense (no experts): "
                           f"leave them out")
        return reasons
    etp, ep = plan.expert_tp, plan.ep
    if plan.tp_mode != "1d":
        reasons.append(f"a mixture of experts runs beside 1d tensor parallelism only (Megatron-Core); got --tp-mode {plan.tp_mode}")
    if plan.tp > 1 and not plan.sp:
        reasons.append("a mixture of experts with tp > 1 needs sequence parallelism (--sp), as Megatron-Core requires")
    if plan.zero not in (0, 1):
        reasons.append(f"perfsim prices a mixture of experts with ZeRO 0 or 1 (Megatron-Core's DDP and distributed "
                       f"optimizer), not ZeRO {plan.zero}")
    if model.experts % ep:
        reasons.append(f"ep {ep} must divide the {model.experts} experts")
    if model.expert_ffn % etp:
        reasons.append(f"etp {etp} must divide the expert FFN width {model.expert_ffn}")
    if plan.moe_dispatcher == "flex" and etp * ep < 2:
        reasons.append("--moe-dispatcher flex (DeepEP) needs etp x ep of 2 or more, as Megatron-Core asserts")
    ranks = plan.tp * plan.cp * plan.dp
    if ranks % (etp * ep):
        reasons.append(f"etp x ep = {etp} x {ep} must divide the {ranks} ranks of a pipeline stage (tp x cp x dp = "
                       f"{plan.tp} x {plan.cp} x {plan.dp}): the experts fold over the same ranks as attention")
    return reasons


def _root(n: int, power: int) -> int | None:
    r = round(n ** (1 / power))
    return next((c for c in (r - 1, r, r + 1) if c > 0 and c**power == n), None)


def _grid_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Shape and divisibility rules of the 2d, 2.5d and 3d grids (docs/equations.md, section 4)."""
    mode, t, d = plan.tp_mode, plan.tp, plan.tp_depth
    reasons = []
    axes = TP_AXES.get(mode, ())
    if not isinstance(plan.tp_axes, str) or (plan.tp_axes != "auto" and sorted(plan.tp_axes.split("-")) != sorted(axes)):
        reasons.append(f"tp_axes for {mode} must list {', '.join(axes)} innermost first, or be auto; got {plan.tp_axes!r}")
    if mode == "1d":
        return reasons
    if mode == "2d":
        q = _root(t, 2)
        if q is None:
            return reasons + [f"2d tensor parallelism needs a square; 4, 9, 16, 64 are allowed, got {t}"]
        rows = q
    elif mode == "2.5d":
        q = _root(t // d, 2) if t % d == 0 else None
        if q is None:
            return reasons + [f"2.5d tensor parallelism needs tp = q x q x depth; got tp {t} with depth {d}"]
        rows = d * q
    else:
        q = _root(t, 3)
        if q is None:
            return reasons + [f"3d tensor parallelism needs a cube; 8, 27, 64 are allowed, got {t}"]
        rows = q * q
    if plan.mbs % rows:
        reasons.append(f"{mode} tensor parallelism splits the micro-batch {rows} ways: mbs must be a multiple of {rows}, got {plan.mbs}")
    weight_rows = q * q if mode == "3d" else q
    for name, size in (("hidden", model.hidden), ("MLP width", model.ffn_size)):
        if size % weight_rows:
            reasons.append(f"{mode} tensor parallelism needs the {name} {size} to be a multiple of {weight_rows}")
    if model.heads % q or model.kv_head_count % q:
        reasons.append(f"{mode} tensor parallelism splits heads {q} ways: {q} must divide the heads and key/value heads")
    return reasons


def split_words(plan: Plan) -> str:
    """An uneven pipeline split in words, "" for an even one: "7 layers on the first stage, 7 on the
    last", or "layout Et*3|(tt|)*29,m|L"."""
    if plan.pp_layout:
        return f"layout {plan.pp_layout}"
    words = [f"{plan.first_stage_layers} layer{'s' * (plan.first_stage_layers != 1)} on the first stage"] \
        if plan.first_stage_layers else []
    if plan.last_stage_layers:
        layers = f"layer{'s' * (plan.last_stage_layers != 1)} on"
        words.append(f"{plan.last_stage_layers} {'on' if words else layers} the last")
    return ", ".join(words)


def plan_summary(plan: Plan, long: bool = False, dtype: str = "bf16") -> str:
    """A plan in words, one wording for every command and chart. Short, for tables and chart labels:
    "TP 8 1d+SP, PP 8 interleaved x2, DP 2, ZeRO-1, mbs 1, recompute full, tp-dp-pp"; long (predict's
    report, chart hover text) adds the global batch and micro-batch count: "TP 8 (1d+SP) x PP 8
    (interleaved x2) x DP 2, ZeRO-1, micro-batch 1, global batch 64 (32 micro-batches per pipeline),
    recompute full, order tp-dp-pp". Both end with stack_words and a dtype other than bf16."""
    mode = plan.tp_mode + ("+SP" if plan.sp else "") + (f" depth {plan.tp_depth}" if plan.tp_mode == "2.5d" else "") \
        + (" regather" if plan.tp_regather else "")
    schedule, split = plan.schedule + (f" x{plan.vpp}" if plan.vpp > 1 else ""), split_words(plan)
    if long:
        pipeline = ", ".join(filter(None, (schedule, split)))
        words = (f"TP {plan.tp} ({mode}) x PP {plan.pp} ({pipeline}) x DP {plan.dp}, ZeRO-{plan.zero}, micro-batch {plan.mbs}, "
                 f"global batch {plan.gbs} ({plan.microbatches} micro-batches per pipeline), recompute {plan.recompute}, "
                 f"order {plan.order}")
    else:
        words = (f"TP {plan.tp} {mode}, PP {plan.pp} {schedule}" + (f" ({split})" if split else "")
                 + f", DP {plan.dp}, ZeRO-{plan.zero}, mbs {plan.mbs}, recompute {plan.recompute}, {plan.order}")
    extras = [w for w in (stack_words(plan), dtype if dtype != "bf16" else "") if w]
    return ", ".join([words] + extras)


def uneven(plan: Plan) -> bool:
    """Whether the plan gives its first or last stage a layer count of its own, or a layout."""
    return bool(plan.first_stage_layers or plan.last_stage_layers or plan.pp_layout)


def layout_plan_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Why the plan's pipeline layout (pp_layout) cannot lay out `model` under the plan: its own
    problems (spec/layout.py), and where its chunk count or the plan's split disagree with it."""
    if not plan.pp_layout:
        return []
    if not isinstance(plan.pp_layout, str):
        return [f"pp_layout must be a Megatron-Core layout string, got {plan.pp_layout!r}"]
    from perfsim.spec.layout import layout_problems, virtual_stages

    problems = layout_problems(plan.pp_layout, plan.pp, model.layers)
    if problems:
        return problems
    if plan.first_stage_layers or plan.last_stage_layers:
        return ["a pipeline layout (--pp-layout) places every layer itself: leave out --first-stage-layers and "
                "--last-stage-layers"]
    vpp = len(virtual_stages(plan.pp_layout)[0]) // plan.pp
    if plan.vpp != vpp:
        return [f"the pipeline layout has {vpp * plan.pp} virtual stages: with pp {plan.pp} that is vpp {vpp}, "
                f"not {plan.vpp} (leave --vpp out, or give {vpp})"]
    return []


def stage_layers(layers, pp, first_layers, last_layers) -> tuple:
    """(first, middle, last) stages' layer counts (numbers or numpy arrays): the first and last
    stage's own counts where given (> 0), the other layers spread evenly over the other stages
    (docs/equations.md 9.4). One stage holds every layer; a middle count with pp <= 2 is unused."""
    first_given, last_given = first_layers > 0, last_layers > 0
    others = pp - first_given - last_given  # stages sharing the rest evenly
    # with no such stage (pp 2, both ends given) the middle count is unused: the even share, not 0
    rest = np.where(others > 0, (layers - first_layers - last_layers) / np.maximum(others, 1), layers / pp)
    return np.where(first_given, first_layers, rest), rest, np.where(last_given, last_layers, rest)


def pipeline_split_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """Why the plan's uneven pipeline split cannot lay out `model`'s layers (empty for an even split)."""
    first, last = plan.first_stage_layers, plan.last_stage_layers
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return [f"{name} must be a whole number of layers (0: as the other stages), got {value!r}"]
    if not (first or last):
        return []
    if plan.pp < 2:
        return ["--first-stage-layers and --last-stage-layers need a pipeline (--pp 2 or more)"]
    given = f"{model.layers} layers less {first + last} on the first and last stage"
    others = plan.pp - (first > 0) - (last > 0)
    if others == 0 and first + last != model.layers:
        return [f"with pp 2 the first and last stage hold every layer: {first} + {last} must be {model.layers}"]
    rest = model.layers - first - last
    v = plan.vpp if isinstance(plan.vpp, int) and plan.vpp > 1 else 1
    if others and (rest < others * v or rest % (others * v)):
        chunks = f" and {v} chunks each" if v > 1 else ""
        return [f"the {given} must spread evenly over the other {others} stages{chunks}, at least one layer each "
                f"(pp {plan.pp}, {model.layers} layers: e.g. --first-stage-layers "
                f"{max(1, (model.layers + 2) // plan.pp - 1)} --last-stage-layers {max(1, (model.layers + 2) // plan.pp - 1)} "
                f"where that divides)"]
    reasons = []
    for name, count in (("first", first), ("last", last)):
        if count and edge_chunk_layers(count, v) < 0:
            reasons.append(f"{count} layers on the {name} stage do not fill its {v} chunks: each chunk but the one "
                           f"holding the {'embedding' if name == 'first' else 'loss'} holds ceil({count}/{v}) = "
                           f"{-(-count // v)} (docs/equations.md 9.4); give a count of at least {(v - 1) * -(-count // v)}, "
                           f"a multiple of {v}, or a layout (--pp-layout)")
    return reasons


def edge_chunk_layers(layers, vpp):
    """Layers of the chunk of an end stage that holds the embedding (the first stage's chunk 0) or
    the loss (the last stage's chunk vpp - 1), when the stage holds `layers` layers over `vpp`
    chunks: its other chunks hold ceil(layers / vpp) each (Megatron-Core's even chunks where vpp
    divides the count; one layer fewer on the edge chunk is its --account-for-embedding-in-pipeline-split
    and --account-for-loss-in-pipeline-split; docs/equations.md 9.4). Negative: the count cannot
    fill the chunks. Numbers or numpy arrays."""
    return layers - (vpp - 1) * -(-layers // vpp)
