"""System profiles: one machine described in TOML (see docs/profile-format.md), checked on load."""

from __future__ import annotations

import math
import os
from perfsim.spec._toml import read_toml
from dataclasses import dataclass, field, fields, replace

from perfsim.errors import PerfsimError, did_you_mean
from perfsim.spec.plan import ATTENTION
from perfsim.uncertainty.ranges import parse_ranges

# hwprofiles/ at the top of the repository, shipped inside the package through the
# perfsim/hwprofiles link so that a plain `pip install .` finds it too.
PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hwprofiles")
PROVENANCES = ("spec", "measured", "derived", "assumed", "calibrated")

INF = math.inf

# Element-wise kernel kinds the optional [device.operation_memory_efficiency] table may name: each
# kind's forward kernel by its name, its backward kernel as "<kind>_backward" (perfsim.cost.layer
# gives every element-wise op its kind; "gelu" stands for SwiGLU too).
MEMORY_KINDS = ("layernorm", "softmax", "gelu", "add", "dropout", "cross_entropy")
BACKWARD = "_backward"
MEMORY_OPERATIONS = MEMORY_KINDS + tuple(kind + BACKWARD for kind in MEMORY_KINDS)


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops_bf16: float
    peak_flops_fp16: float
    peak_flops_fp32: float
    memory_bytes: float
    memory_bandwidth_Bps: float
    gemm_efficiency: float
    gemm_half_dim: float
    memory_efficiency: float
    kernel_overhead_s: float
    # Optional per-kind efficiencies, ((name, value), ...) in MEMORY_OPERATIONS order, only the kinds
    # the profile names (a tuple: the dataclass stays hashable). An entry replaces memory_efficiency
    # for that kind's forward or backward kernel; a kind left out keeps memory_efficiency, and its
    # backward is MEMORY_BACKWARD x its forward time (perfsim.cost.layer.memory_times).
    operation_memory_efficiency: tuple = ()
    # Optional fractions of peak a fused (flash) attention kernel reaches on the FLOPs it executes,
    # forward and backward (perfsim.cost.layer.flash_attention_times); None: the GEMM model's
    # efficiency at the scores GEMM's shape, the backward at the forward's.
    flash_forward_efficiency: float | None = None
    flash_backward_efficiency: float | None = None
    # Optional seconds the fused kernel's softmax adds per score it executes, beside its products at
    # the efficiencies above (perfsim.cost.layer.flash_curve_times); None: none.
    flash_score_s: float | None = None
    # Optional FP8 tensor-core peak (dense) and the best-case fraction of it a GEMM reaches
    # (--dtype fp8, perfsim.cost.layer.gemm_time); no peak: the device cannot train in FP8; no
    # efficiency: FP8 GEMMs follow the bf16 GEMM efficiency model (docs/equations.md 3.11).
    peak_flops_fp8: float | None = None
    fp8_gemm_efficiency: float | None = None
    # Optional half-dimension of the reduction dimension k in the GEMM efficiency model
    # (perfsim.cost.layer.gemm_efficiency, docs/equations.md 3.1); None: gemm_half_dim, as m and n.
    gemm_half_dim_k: float | None = None
    # Optional typical times of the calibration's reference kernels (validate.microbench.References:
    # a fixed GEMM and LayerNorm per device kind), at which `perfsim validate`'s speed probes judge
    # whether a step's machine ran at the profile's speed (validate.speed_probe).
    speed_reference_gemm_s: float | None = None
    speed_reference_norm_s: float | None = None
    # Optional measured kernel tables ([device.measured.<kernel>.<dtype>], perfsim.cost.measured):
    # KernelTables that correct the curves near measured shapes; `kernel_dtype` is the dtype a
    # prediction runs (set by `for_dtype`), whose tables apply.
    measured: tuple = ()
    kernel_dtype: str = ""
    # Optional: the device's SMs, out of which overlapped communication kernels take theirs
    # (framework.*_comm_sms; perfsim.cost.contention); None: no SM contention priced.
    sm_count: int | None = None
    # Optional, in (0, 1]: the SM clock a GPU holds in a job on more than one GPU over the clock of
    # the profile's kernel rates (perfsim.cost.clocks); None: the kernel rates' own clock.
    sustained_clock_ratio: float | None = None
    # Optional, in (0, 1]: what SM-bound kernels of a multi-GPU job lose beyond every named term,
    # fitted where a published table needs it (perfsim.cost.clocks); None: nothing.
    unattributed_at_scale_ratio: float | None = None
    # Optional, in (0, 1]: the fused attention kernel's rate with dropout over its rate without,
    # forward and backward (perfsim.cost.attention_dropout); None: dropout costs the kernel nothing.
    flash_dropout_forward_ratio: float | None = None
    flash_dropout_backward_ratio: float | None = None

    def memory_efficiency_of(self, kind: str, backward: bool = False):
        """The efficiency of one kind's forward or backward kernel; None where the profile names none."""
        if not self.operation_memory_efficiency or not kind:
            return None
        name = kind + BACKWARD if backward else kind
        for entry, value in self.operation_memory_efficiency:
            if entry == name:
                return value
        return None


@dataclass(frozen=True)
class Node:
    devices_per_node: int
    devices_per_card: int
    card_link_bandwidth_Bps: float
    card_link_latency_s: float
    node_link_bandwidth_Bps: float
    node_link_latency_s: float


@dataclass(frozen=True)
class Network:
    topology: str
    nics_per_node: int
    nic_bandwidth_Bps: float
    latency_s: float
    oversubscription: float


# Collective algorithms a profile may fix (collectives.algorithm); "auto" takes the fastest per call.
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
ZERO_IMPLEMENTATIONS = ("deepspeed", "fsdp2")
# Operations the optional per-operation tables may name (collectives.operation_efficiency.<op>,
# collectives.operation_latency_factor.<op>, collectives.operation_step_overhead_s.<op>); "send" is
# the point-to-point hop of a pipeline, "all_to_all" expert parallelism's dispatch and combine.
OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send", "all_to_all")
# Optional per-operation tables, "section.table" -> (the names an entry may have, what a name is,
# allowed range of each entry's value, value of a name the table leaves out). A collective
# efficiency is a fraction, a latency factor any positive multiplier, a step overhead seconds; an
# element-wise kind's efficiency may exceed 1 (a kind that runs in cache beats the streaming
# memory_bandwidth_Bps) and defaults to device.memory_efficiency (None here).
OPERATION_TABLES = {
    "collectives.operation_efficiency": (OPERATIONS, "operation", ("float", 0.0, 1.0, False), 1.0),
    "collectives.operation_latency_factor": (OPERATIONS, "operation", ("float", 0.0, INF, False), 1.0),
    "collectives.operation_step_overhead_s": (OPERATIONS, "operation", ("float", 0.0, INF, True), 0.0),
    "device.operation_memory_efficiency": (MEMORY_OPERATIONS, "kind", ("float", 0.0, INF, False), None)}
# what a collectives table gives an operation it leaves out, by table name
OPERATION_TABLE_DEFAULTS = {key.split(".")[1]: spec[3] for key, spec in OPERATION_TABLES.items()
                            if key.startswith("collectives.")}


@dataclass(frozen=True)
class Collectives:
    card_efficiency: float
    node_efficiency: float
    network_efficiency: float
    algorithm: str = "auto"  # optional plain string, one of ALGORITHMS (docs/topology.md section 4)
    # Optional per-operation factors, ((op, value), ...) in OPERATIONS order, only the ops the profile
    # names (tuples: the dataclass stays hashable). An operation's bandwidth terms are divided by its
    # efficiency and its latency terms multiplied by its latency factor; an op left out gets 1.
    operation_efficiency: tuple = ()
    operation_latency_factor: tuple = ()
    # Optional seconds a call of the operation pays inside a training step beyond what the link
    # model gives (the fastest repetition): on a CPU rank, gloo's threads waking after compute
    # (docs/topology.md section 4, "Step overhead"). Added to every call; an op left out gets 0.
    operation_step_overhead_s: tuple = ()
    # Optional measured tables ([collectives.measured.<op>.<dtype>], perfsim.cost.measured): each
    # operation's calls by group size, stride and bytes, correcting the link model near them
    measured: tuple = ()
    # Optional, in (0, 1]: the share of the shorter of (overlapped communication, the compute beside
    # it) that running them together hides (perfsim.cost.overlap; docs/equations.md 6.1). 1: all of
    # it; a CPU rank whose collective threads compete with the GEMMs for the cores hides less.
    # None: the profile leaves it out (`overlap_or_perfect` gives 1).
    overlap_efficiency: float | None = None

    def overlap_or_perfect(self) -> float:
        """overlap_efficiency, or 1 (perfect overlap) when the profile leaves it out."""
        return 1.0 if self.overlap_efficiency is None else self.overlap_efficiency

    def operation_factors(self, op: str) -> tuple[float, float, float]:
        """(efficiency, latency factor, step overhead in s) of one operation; (1, 1, 0) when the
        profile names none of them."""
        return (dict(self.operation_efficiency).get(op, 1.0), dict(self.operation_latency_factor).get(op, 1.0),
                dict(self.operation_step_overhead_s).get(op, 0.0))


@dataclass(frozen=True)
class Framework:
    grad_bytes_per_param: float
    dp_overlap: float  # 0 or 1: the default of plans' dp_overlap (the stack overlaps data-parallel communication)
    reserved_memory_bytes: float
    allocator_overhead_fraction: float
    step_overhead_s: float
    # Optional: share of ZeRO-3's per-micro-batch gathers and reduce-scatter that prefetching can
    # hide behind the micro-batch's compute (1: all of it, as on GPUs with a communication stream).
    zero3_overlap: float = 1.0
    # Optional: host seconds a 1d tensor-parallel implementation adds per transformer layer and
    # micro-batch (forward and backward) beyond its kernels and collectives, without and with
    # sequence parallelism: DTensor's dispatch, redistributions and asynchronous-collective waits in
    # torch.distributed.tensor.parallel (docs/equations.md 8.1). 0: Megatron-LM's hand-written layers.
    tp_layer_overhead_s: float = 0.0
    sp_layer_overhead_s: float = 0.0
    # Optional: host seconds the training loop adds beyond its kernels and collectives, per layer and
    # micro-batch (forward and backward: autograd, module dispatch) and per micro-batch of a stage
    # (its loop, the loss's and the schedule's Python), measured by construction from real steps of
    # a calibration model (perfsim.calibrate.overheads; docs/equations.md 8.2). 0: not measured.
    layer_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    # Optional: whose ZeRO-2/3 the step runs (docs/equations.md 6.2). "deepspeed": gradients
    # reduce-scattered in buckets, weights kept whole beside the shards in ZeRO-2. "fsdp2": torch's
    # fully_shard, one call per module, with its buffer copies and memory (as validate/ runs it).
    zero_implementation: str = "deepspeed"
    # Optional: copies of a reduce-scatter's input the collective library makes and holds while the
    # call runs, alive at FSDP2's peak (docs/equations.md 6.2): gloo clones the input (1); NCCL and
    # oneCCL reduce from it in place (None, left out: none).
    reduce_scatter_input_copies: float | None = None
    # Optional: the attention kernel a plan runs when it names none (`--attention`): "unfused"
    # (two batched GEMMs around a softmax, the SC21-era stacks) or "flash" (one fused kernel).
    attention: str = "unfused"
    # Optional, 0 or 1: whether plans with 1d + SP pipeline their tensor-parallel collectives with
    # the GEMMs by default (the plan's tp_overlap; Megatron-Core's --tp-comm-overlap).
    tp_overlap: float = 0.0
    # Optional, 0 or 1: whether the host issues kernels ahead of the device (a GPU's queue), so that
    # the loop's own host time above (layer, micro-batch and step overheads) runs beside the kernels
    # and only what exceeds them shows (1), or whether the host runs the kernels itself, one after
    # its own work (0 or left out: a CPU rank). docs/equations.md 8.3.
    host_overlap: float | None = None
    # Optional, 0 or 1: the step runs under torch.autocast (the harness on a GPU): LayerNorm and
    # softmax compute in fp32 on fp32 copies of their bf16 inputs, each with cast kernels around
    # it, and keep those fp32 tensors for backward (docs/equations.md 3.5, 7.2). 0 or left out: fused
    # kernels with bf16 inputs and outputs (Megatron-Core, Transformer Engine), or no mixed precision.
    autocast: float | None = None
    # Optional: bytes the optimizer step moves per parameter it updates; None: Megatron's Adam on
    # fp32 main gradients (2 x grad_bytes_per_param + 2 x 12 + the weight's bytes, docs/equations.md
    # 6.3). The harness's MasterAdam moves its own (perfsim.calibrate.overheads.as_trained).
    optimizer_bytes_per_param: float | None = None
    # Optional: bytes per parameter each micro-batch after a step's first moves to add its gradients
    # to those accumulated (eager PyTorch's AccumulateGrad: read both, write one, 3 x grad bytes);
    # 0 or left out: accumulated inside the weight-gradient GEMM (Megatron's gradient-accumulation
    # fusion).
    grad_accumulation_bytes_per_param: float | None = None
    # Optional, 0 or 1: gradients are freed after every optimizer step (PyTorch's
    # zero_grad(set_to_none=True), as the harness does) and allocated by the next backward, not held
    # in buffers of their own (0 or left out: Megatron's contiguous gradient buffer). docs/equations.md 7.4.
    grads_set_to_none: float | None = None
    # Optional: SMs the kernels of overlapped tensor-parallel (Transformer Engine's userbuffers),
    # data-parallel and context-parallel (NCCL channels) communication hold while they run beside
    # compute (perfsim.cost.contention; docs/equations.md 8.4); None: none priced.
    tp_comm_sms: float | None = None
    dp_comm_sms: float | None = None
    cp_comm_sms: float | None = None
    # Optional: bytes per parameter of a stage that passes over its whole gradient buffer move once
    # a step before the data-parallel reduction (Megatron-Core's NaN check and 1/dp scaling;
    # perfsim.cost.grad_passes); None: none.
    grad_buffer_pass_bytes_per_param: float | None = None
    # Optional, 0 or 1: FP8 layers hold their weights in FP8 (Megatron-Core's --fp8-param-gather, TE's
    # FP8 primary weights), with no bf16 copy beside them (perfsim.cost.fp8; docs/equations.md 3.11).
    fp8_param_gather: float | None = None
    # Optional: bytes the GEMM library's workspace holds in the caching allocator (Transformer
    # Engine's cuBLAS workspace), repeated per userbuffers stream with tp_overlap; None: none.
    workspace_bytes: float | None = None
    # Optional: elements each parameter's start is aligned to in the distributed optimizer's
    # contiguous parameter and gradient buffers (Megatron-Core: 64; buckets padded to lcm(dp, 128));
    # None: no padding (perfsim.cost.stack_memory; docs/equations.md 7.1).
    buffer_alignment_elements: float | None = None
    # Optional: the coefficient of variation of a rank's step time, the part the job's other ranks
    # do not share; a synchronous step waits for its slowest rank, sigma x E[max of n normals] of
    # the step (perfsim.cost.synchrony; docs/equations.md 9.5). None or 0: every rank alike.
    rank_jitter: float | None = None


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts numbers of the stack (an optional [moe] section; docs/equations.md 12)."""

    # max over mean token copies per expert-parallel rank under the stack's routing (the slowest
    # rank's share of the expert work and of the all-to-all); None: 1, perfectly balanced
    imbalance: float | None = None
    # host seconds per kernel Transformer Engine's grouped linear issues for one local expert (its
    # GEMM, and in FP8 the quantization of its input or gradient): the host issues a MoE layer's
    # expert kernels one expert at a time after the dispatcher's device-to-host synchronisation,
    # so what they take beyond the kernels' own time shows (cost/experts.py); None: 0
    expert_kernel_host_s: float | None = None


@dataclass(frozen=True)
class System:
    name: str
    description: str
    device: Device
    node: Node
    network: Network
    collectives: Collectives
    framework: Framework
    provenance: dict  # "section.key" -> (provenance, source)
    path: str = ""
    # "section.key" -> perfsim.uncertainty.ranges.Range for numbers with a range or causes
    ranges: dict = field(default_factory=dict)
    observations: str = ""  # path of the observations file the profile names (perfsim.uncertainty)
    moe: Moe = field(default_factory=Moe)


# Allowed range per key: (kind, lowest, highest, lowest allowed?). "int" keys must be whole numbers.
# REQUIRED_NUMBERS: the keys every profile section must give.
_POSITIVE = ("float", 0.0, INF, False)
_NONNEG = ("float", 0.0, INF, True)
_FRACTION = ("float", 0.0, 1.0, False)
_COUNT = ("int", 1, INF, True)
REQUIRED_NUMBERS = {
    "device": {f.name: _POSITIVE for f in fields(Device)
               if f.name not in ("name", "operation_memory_efficiency", "flash_forward_efficiency",
                                 "flash_backward_efficiency", "flash_score_s", "peak_flops_fp8", "fp8_gemm_efficiency", "gemm_half_dim_k", "measured", "kernel_dtype",
                                 "speed_reference_gemm_s", "speed_reference_norm_s", "sm_count",
                                 "sustained_clock_ratio", "unattributed_at_scale_ratio", "flash_dropout_forward_ratio",
                                 "flash_dropout_backward_ratio")}
    | {"gemm_efficiency": _FRACTION, "memory_efficiency": _FRACTION, "kernel_overhead_s": _NONNEG},
    "node": {"devices_per_node": _COUNT, "devices_per_card": _COUNT, "card_link_bandwidth_Bps": _POSITIVE,
             "card_link_latency_s": _NONNEG, "node_link_bandwidth_Bps": _POSITIVE, "node_link_latency_s": _NONNEG},
    "network": {"nics_per_node": _COUNT, "nic_bandwidth_Bps": _POSITIVE, "latency_s": _NONNEG,
                "oversubscription": ("float", 1.0, INF, True)},
    "collectives": {f.name: _FRACTION for f in fields(Collectives) if f.name.endswith("_efficiency")
                    and f"collectives.{f.name}" not in OPERATION_TABLES and f.name != "overlap_efficiency"},
    "framework": {"grad_bytes_per_param": _POSITIVE, "dp_overlap": ("float", 0.0, 1.0, True),
                  "reserved_memory_bytes": _NONNEG, "allocator_overhead_fraction": ("float", 0.0, 1.0, True),
                  "step_overhead_s": _NONNEG},
}
# Optional numbers (value, provenance and source like the others); left out, the dataclass default.
OPTIONAL_NUMBERS = {"framework": {"zero3_overlap": ("float", 0.0, 1.0, True), "tp_layer_overhead_s": _NONNEG,
                           "sp_layer_overhead_s": _NONNEG, "tp_overlap": ("float", 0.0, 1.0, True),
                           "host_overlap": ("float", 0.0, 1.0, True), "autocast": ("float", 0.0, 1.0, True),
                           "optimizer_bytes_per_param": _POSITIVE, "grad_accumulation_bytes_per_param": _NONNEG,
                           "grads_set_to_none": ("float", 0.0, 1.0, True),
                           "layer_overhead_s": _NONNEG, "microbatch_overhead_s": _NONNEG,
                           "reduce_scatter_input_copies": _NONNEG, "tp_comm_sms": _NONNEG,
                           "dp_comm_sms": _NONNEG, "cp_comm_sms": _NONNEG,
                           "grad_buffer_pass_bytes_per_param": _NONNEG,
                           "fp8_param_gather": ("float", 0.0, 1.0, True), "workspace_bytes": _NONNEG,
                           "buffer_alignment_elements": _COUNT, "rank_jitter": ("float", 0.0, 1.0, True)},
             "collectives": {"overlap_efficiency": _FRACTION},
             "moe": {"imbalance": ("float", 1.0, INF, True), "expert_kernel_host_s": _NONNEG},
             "device": {"flash_forward_efficiency": _FRACTION, "flash_backward_efficiency": _FRACTION,
                        "flash_score_s": _NONNEG,
                        "peak_flops_fp8": _POSITIVE, "fp8_gemm_efficiency": _FRACTION, "gemm_half_dim_k": _POSITIVE,
                        "speed_reference_gemm_s": _POSITIVE, "speed_reference_norm_s": _POSITIVE,
                        "sm_count": _COUNT, "sustained_clock_ratio": _FRACTION, "unattributed_at_scale_ratio": _FRACTION,
                        "flash_dropout_forward_ratio": _FRACTION, "flash_dropout_backward_ratio": _FRACTION}}
_STRINGS = {"device": ("name",), "network": ("topology",)}
# Optional plain strings (no provenance table): section -> key -> allowed values; left out, the
# dataclass default applies.
_CHOICES = {"collectives": {"algorithm": ALGORITHMS},
            "framework": {"zero_implementation": ZERO_IMPLEMENTATIONS, "attention": ATTENTION}}
_TOPOLOGIES = ("fat-tree",)
_TOP_LEVEL = ("schema", "name", "description", "observations")
_OPTIONAL_SECTIONS = ("moe",)  # sections a profile may leave out, every key optional
_NUMBER_PARTS = ("value", "provenance", "source", "range", "distribution", "causes")


def _section_keys(section: str) -> tuple:
    """Every key [section] may hold, required or optional (anything else is an error)."""
    tables = tuple(key.split(".")[1] for key in OPERATION_TABLES if key.startswith(section + "."))
    return (_STRINGS.get(section, ()) + tuple(_CHOICES.get(section, {})) + tuple(REQUIRED_NUMBERS[section])
            + tuple(OPTIONAL_NUMBERS.get(section, {})) + tables + (("measured",) if section in _MEASURED_KERNELS else ()))


_TABLE_PARTS = ("provenance", "source", "width_octaves", "columns", "points")
TABLE_DTYPES = ("bf16", "fp16", "fp32", "fp8")
MOST_TABLE_POINTS = 100_000  # a table is interpolated point by point: more is a mistake, not a measurement


# what [<section>.measured.<kernel>.<dtype>] tables a section may hold: kernel names (None: GEMM, flash
# attention and the element-wise kernels, spelt out in _measured_tables to keep this module free of cost imports)
_MEASURED_KERNELS = {"device": None, "collectives": OPERATIONS}


def _measured_tables(where: str, raw, section: str = "device") -> tuple:
    """[<section>.measured.<kernel>.<dtype>] tables as KernelTables (perfsim.cost.measured), in
    file order; every problem names the table. Device tables hold GEMMs and element-wise kernels,
    collectives tables the operations (by group size, stride and bytes)."""
    from perfsim.cost.measured import COLLECTIVE_COLUMNS, GEMM_COLUMNS, MEMORY_COLUMNS, SHAPE_KERNELS, KernelTable

    kernels = _MEASURED_KERNELS[section] or SHAPE_KERNELS + MEMORY_OPERATIONS
    if not isinstance(raw, dict):
        raise PerfsimError(f"{where}: {section}.measured must hold tables [{section}.measured.<kernel>.<dtype>]")
    tables = []
    for kernel, by_dtype in raw.items():
        if kernel not in kernels:
            raise PerfsimError(f"{where}: unknown kernel {section}.measured.{kernel}{did_you_mean(kernel, kernels)}; "
                               f"one of {', '.join(kernels)}")
        if not isinstance(by_dtype, dict):
            raise PerfsimError(f"{where}: {section}.measured.{kernel} must hold one table per dtype ({', '.join(TABLE_DTYPES)})")
        for dtype, table in by_dtype.items():
            key = f"{section}.measured.{kernel}.{dtype}"
            if dtype not in TABLE_DTYPES:
                raise PerfsimError(f"{where}: unknown dtype {key}{did_you_mean(dtype, TABLE_DTYPES)}; one of {', '.join(TABLE_DTYPES)}")
            if not isinstance(table, dict):
                raise PerfsimError(f"{where}: {key} must be a table with provenance, source, width_octaves, columns and points")
            _refuse_unknown(where, table, _TABLE_PARTS, f"{key}.", "a measured table holds " + ", ".join(_TABLE_PARTS))
            for part in _TABLE_PARTS:
                if part not in table:
                    raise PerfsimError(f"{where}: {key} has no {part}")
            if table["provenance"] != "measured":
                raise PerfsimError(f"{where}: {key}.provenance must be \"measured\", got {table['provenance']!r}")
            if not isinstance(table["source"], str) or not table["source"].strip():
                raise PerfsimError(f"{where}: {key}.source must say where the measurements come from")
            width = _number(where, f"{key}.width_octaves",
                            {"value": table["width_octaves"], "provenance": "measured", "source": "-"}, _POSITIVE)
            columns = list(COLLECTIVE_COLUMNS if section == "collectives" else GEMM_COLUMNS if kernel in SHAPE_KERNELS
                           else MEMORY_COLUMNS)
            if table["columns"] != columns:
                raise PerfsimError(f"{where}: {key}.columns must be {columns}, got {table['columns']!r}")
            points = table["points"]
            if not isinstance(points, list) or not points or len(points) > MOST_TABLE_POINTS:
                raise PerfsimError(f"{where}: {key}.points must be a list of 1 to {MOST_TABLE_POINTS:,} rows")
            for i, row in enumerate(points):
                if (not isinstance(row, list) or len(row) != len(columns)
                        or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
                               for x in row)):
                    raise PerfsimError(f"{where}: {key}.points[{i}] must be {len(columns)} positive numbers "
                                       f"({', '.join(columns)}), got {row!r}")
            tables.append(KernelTable(kernel, dtype, tuple(tuple(float(x) for x in row) for row in points), float(width),
                                      table["source"]))
    return tuple(tables)


def for_dtype(system, dtype: str):
    """`system` whose device applies its measured tables of `dtype`, its kernels' and its
    collectives' (the same system when it has none)."""
    dtype = TABLE_DTYPE_OF.get(dtype, dtype)
    if not (system.device.measured or system.collectives.measured) or system.device.kernel_dtype == dtype:
        return system
    return replace(system, device=replace(system.device, kernel_dtype=dtype))


# An fp8 step runs its element-wise kernels, attention and communication in bf16 (docs/equations.md
# 3.11): their tables are bf16's; its fp8 GEMMs take no table of another dtype (gemm_time_and_share).
TABLE_DTYPE_OF = {"fp8": "bf16"}


def _refuse_unknown(where: str, table: dict, allowed, prefix: str, holds: str) -> None:
    """A PerfsimError naming the first key of `table` not in `allowed` (with the closest allowed
    one): a misspelt key would otherwise be ignored, or reported as missing."""
    for key in table:
        if key not in allowed:
            raise PerfsimError(f"{where}: unknown key {prefix}{key}{did_you_mean(key, allowed)}; {holds}")


def _number(where: str, key: str, entry, rule) -> float:
    if not isinstance(entry, dict):
        raise PerfsimError(f"{where}: {key} must be a table with value, provenance and source (see docs/profile-format.md)")
    _refuse_unknown(where, entry, _NUMBER_PARTS, f"{key}.", "a number holds value, provenance, source and optionally range, distribution or causes")
    for part in ("value", "provenance", "source"):
        if part not in entry:
            raise PerfsimError(f"{where}: {key} has no {part}")
    if entry["provenance"] not in PROVENANCES:
        raise PerfsimError(f"{where}: {key}.provenance must be one of {', '.join(PROVENANCES)}, got {entry['provenance']!r}")
    if not isinstance(entry["source"], str) or not entry["source"].strip():
        raise PerfsimError(f"{where}: {key}.source must say where the number comes from")
    kind, low, high, low_ok = rule
    value = entry["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "int" and not isinstance(value, int)):
        wanted = "a whole number" if kind == "int" else "a number"
        raise PerfsimError(f"{where}: {key}.value must be {wanted}, got {value!r}")
    if not math.isfinite(value) or value < low or (value == low and not low_ok) or value > high:
        bound = f"{'at least' if low_ok else 'above'} {low:g}" + (f" and at most {high:g}" if high != INF else "")
        raise PerfsimError(f"{where}: {key}.value must be {bound}, got {value!r}")
    return value


def _operation_table(where: str, key: str, raw, provenance: dict) -> tuple:
    """An optional per-operation table (key "section.table", see OPERATION_TABLES) as
    ((name, value), ...) in the order of its allowed names."""
    names, noun, rule, _ = OPERATION_TABLES[key]
    if not isinstance(raw, dict):
        raise PerfsimError(f"{where}: {key} must be a table of {noun}s "
                           f"({', '.join(names)}), each with value, provenance and source")
    unknown = [name for name in raw if name not in names]
    if unknown:
        raise PerfsimError(f"{where}: unknown {noun} {key}.{unknown[0]}{did_you_mean(unknown[0], names)}; "
                           f"one of {', '.join(names)}")
    entries = []
    for name in names:
        if name in raw:
            entries.append((name, float(_number(where, f"{key}.{name}", raw[name], rule))))
            provenance[f"{key}.{name}"] = (raw[name]["provenance"], raw[name]["source"])
    return tuple(entries)


def operation_names(key: str) -> tuple:
    """The names an optional per-operation table ("collectives.operation_efficiency",
    "device.operation_memory_efficiency", ...) may hold, in the order a System keeps them."""
    return OPERATION_TABLES[key][0]


def parse_system(data: dict, where: str, path: str = "") -> System:
    """Build a System from parsed TOML; every problem names `where` and the key."""
    _refuse_unknown(where, data, _TOP_LEVEL + tuple(REQUIRED_NUMBERS) + _OPTIONAL_SECTIONS, "",
                    f"a profile holds {', '.join(_TOP_LEVEL)} and the sections "
                    f"{', '.join(f'[{s}]' for s in REQUIRED_NUMBERS)} (docs/profile-format.md)")
    schema = data.get("schema")
    if isinstance(schema, bool) or schema != 1:
        raise PerfsimError(f"{where}: schema must be 1, got {schema!r}")
    for key in ("name", "description"):
        if not isinstance(data.get(key), str):
            raise PerfsimError(f"{where}: {key} must be a string")
    sections, provenance = {}, {}
    for section, rules in REQUIRED_NUMBERS.items():
        raw = data.get(section)
        if raw is None:
            raise PerfsimError(f"{where}: missing section [{section}]")
        if not isinstance(raw, dict):
            raise PerfsimError(f"{where}: {section} must be the section [{section}], got {raw!r}")
        _refuse_unknown(where, raw, _section_keys(section), f"{section}.",
                        f"docs/profile-format.md lists the keys of [{section}]")
        values = {}
        for key in _STRINGS.get(section, ()):
            if not isinstance(raw.get(key), str):
                raise PerfsimError(f"{where}: {section}.{key} must be a string")
            values[key] = raw[key]
        for key, allowed in _CHOICES.get(section, {}).items():
            if key in raw:
                if not isinstance(raw[key], str) or raw[key] not in allowed:
                    got = repr(raw[key]) if isinstance(raw[key], str) else (
                        "a table" if isinstance(raw[key], dict) else f"{raw[key]!r}")
                    raise PerfsimError(f"{where}: {section}.{key} must be a plain string, one of "
                                       f"{', '.join(allowed)}; got {got}")
                values[key] = raw[key]
        for key in OPERATION_TABLES:
            table_section, table = key.split(".")
            if table_section == section and table in raw:
                values[table] = _operation_table(where, key, raw[table], provenance)
        for key, rule in rules.items():
            if key not in raw:
                raise PerfsimError(f"{where}: missing key {section}.{key}")
            values[key] = _number(where, f"{section}.{key}", raw[key], rule)
            provenance[f"{section}.{key}"] = (raw[key]["provenance"], raw[key]["source"])
        for key, rule in OPTIONAL_NUMBERS.get(section, {}).items():
            if key in raw:
                values[key] = _number(where, f"{section}.{key}", raw[key], rule)
                provenance[f"{section}.{key}"] = (raw[key]["provenance"], raw[key]["source"])
        if section in _MEASURED_KERNELS and "measured" in raw:
            values["measured"] = _measured_tables(where, raw["measured"], section)
        sections[section] = values
    for section in _OPTIONAL_SECTIONS:
        raw = data.get(section, {})
        if not isinstance(raw, dict):
            raise PerfsimError(f"{where}: {section} must be the section [{section}], got {raw!r}")
        _refuse_unknown(where, raw, tuple(OPTIONAL_NUMBERS[section]), f"{section}.",
                        f"docs/profile-format.md lists the keys of [{section}]")
        sections[section] = {}
        for key, rule in OPTIONAL_NUMBERS[section].items():
            if key in raw:
                sections[section][key] = _number(where, f"{section}.{key}", raw[key], rule)
                provenance[f"{section}.{key}"] = (raw[key]["provenance"], raw[key]["source"])
    if sections["network"]["topology"] not in _TOPOLOGIES:
        raise PerfsimError(f"{where}: network.topology must be one of {', '.join(_TOPOLOGIES)}")
    for key, what in (("dp_overlap", "whether plans overlap data-parallel communication by default"),
                      ("tp_overlap", "whether plans overlap tensor-parallel communication by default"),
                      ("host_overlap", "whether the host issues kernels ahead of the device"),
                      ("autocast", "whether the step runs under torch.autocast"),
                      ("grads_set_to_none", "whether gradients are freed after every step")):
        value = sections["framework"].get(key, 0)
        if value not in (0, 1):
            raise PerfsimError(f"{where}: framework.{key}.value must be 0 or 1 ({what}), got {value!r}")
    node = sections["node"]
    if node["devices_per_node"] % node["devices_per_card"]:
        raise PerfsimError(f"{where}: node.devices_per_node must be a multiple of node.devices_per_card")
    return System(
        name=data["name"], description=data["description"], device=Device(**sections["device"]),
        node=Node(**node), network=Network(**sections["network"]),
        collectives=Collectives(**sections["collectives"]), framework=Framework(**sections["framework"]),
        provenance=provenance, path=path, ranges=parse_ranges(where, data, provenance, number_rule),
        observations=_observations_path(where, data, path), moe=Moe(**sections["moe"]),
    )


def forced_balance(system: System) -> System:
    """`system` under routing forced to balance the experts' tokens (Megatron-Core's
    --moe-router-force-load-balancing, as MoE benchmarks run): moe.imbalance 1, its range dropped."""
    ranges = {k: v for k, v in system.ranges.items() if k != "moe.imbalance"}
    return replace(system, moe=replace(system.moe, imbalance=1.0), ranges=ranges)


def available_systems() -> list[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".toml"))
    except FileNotFoundError:
        return []


def load_system(text: str) -> System:
    """A profile name from hwprofiles/ or a path to a TOML file."""
    if text.endswith(".toml") or os.path.sep in text:
        path = text
    else:
        path = os.path.join(PROFILE_DIR, text + ".toml")
        if not os.path.exists(path):
            raise PerfsimError(f"unknown system {text!r}; available: {', '.join(available_systems())} (or a path to a .toml profile)")
    return parse_system(read_toml(path, "system profile"), f"system profile {path}", path)


def number_rule(key: str):
    """(kind, lowest, highest, lowest allowed?) of a profile number, "section.key" or
    "section.table.name"; None for anything else (a measured table)."""
    section, _, rest = key.partition(".")
    table = f"{section}.{rest.split('.')[0]}"
    if table in OPERATION_TABLES:
        return OPERATION_TABLES[table][2]
    return REQUIRED_NUMBERS.get(section, {}).get(rest) or OPTIONAL_NUMBERS.get(section, {}).get(rest)


def number_value(system: System, key: str):
    """The loaded value of a profile number ("section.key" or "section.table.name"); None for a
    key that is not one number."""
    section, _, rest = key.partition(".")
    name, _, entry = rest.partition(".")
    value = getattr(getattr(system, section), name, None)
    if entry:  # an entry of a per-operation table, ((name, value), ...); a measured table is no number
        pairs = [p for p in value if isinstance(p, tuple) and len(p) == 2] if isinstance(value, tuple) else []
        value = dict(pairs).get(entry)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _observations_path(where: str, data: dict, path: str) -> str:
    """The observations file a profile names (relative to the profile's folder), or ""."""
    name = data.get("observations")
    if name is None:
        return ""
    if not isinstance(name, str) or not name.strip():
        raise PerfsimError(f"{where}: observations must be the path of an observations file (docs/profile-format.md)")
    return os.path.realpath(os.path.join(os.path.dirname(path), name)) if path and not os.path.isabs(name) else name
