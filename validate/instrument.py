"""Counting what a real step does: collectives by kind and size, as torch dispatches them.

DTensor (torch 2.13) redistributes through torch.distributed._functional_collectives, which calls
the `_c10d_functional` ops (`all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
their `_coalesced` forms, and `wait_tensor`); the loss (validate.loss) calls plain all_reduce. Plain
`torch.distributed` calls (all_reduce, all_gather_into_tensor, reduce_scatter_tensor) dispatch
the in-place `c10d` ops (`allreduce_`, `_allgather_base_`, `_reduce_scatter_base_`). A
TorchDispatchMode sees both families on the local tensors, whatever Python wrapper issued them,
so one counter serves DTensor layers and hand-written autograd Functions alike.

Each record is (kind, elements of the full tensor, bytes per element, group size): the full
tensor is what perfsim's Collective.nbytes means (the gathered size for all-gather and
reduce-scatter). FLOPs come from torch.utils.flop_counter.FlopCounterMode, which counts matrix
products (mm, addmm, bmm, baddbmm, matmul's decompositions, convolutions), and fused attention
kernels at perfsim's count (`fused_attention_flops`); it does not see
element-wise work (LayerNorm, GeLU, softmax, bias adds, the loss), embedding lookups or
collectives, which perfsim does not count as FLOPs either.

What gloo sends: all-reduce and all-gather run gloo's own algorithms (ring-like, the volumes
perfsim's sent_bytes assumes). Reduce-scatter has no gloo algorithm: ProcessGroupGloo's
reduce_scatter_tensor_coalesced clones the whole input, all-reduces it and keeps its chunk, so on
gloo each reduce-scatter moves an all-reduce's bytes, 2 (P-1)/P n instead of (P-1)/P n.
`by_kind` counts the collective the program asked for (what perfsim models for a real backend);
`gloo_wire_by_kind` counts what gloo's implementation sends (what a CPU timing run pays).
An all-to-all (`alltoall_base_`, dist.all_to_all_single: validate.moe's dispatch and combine)
is recorded as kind "all_to_all" with the elements this rank sends to the other ranks (the split
it keeps left out), which are its sent bytes. Point-to-point `send` and `recv_`
(dist.isend/irecv, batch_isend_irecv, hence
torch.distributed.pipelining) are recorded as kinds "send" and "recv": a send counts its tensor's
bytes as sent, a receive counts none (`Record.nbytes` still gives what it received).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
SEND, RECV = "send", "recv"  # point-to-point (pipeline stages): c10d `send` and `recv_`
ALL_TO_ALL = "all_to_all"  # c10d `alltoall_base_` (all_to_all_single): elements sent to the other ranks


@dataclass(frozen=True)
class Record:
    kind: str
    elements: int  # of the full tensor: the gathered size for all-gather and reduce-scatter
    element_bytes: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.elements * self.element_bytes

    def sent_bytes(self) -> float:
        """Bytes each member sends with ring (all-*) and pipelined (broadcast, reduce) algorithms,
        averaged over the members (perfsim's sent_bytes convention); a send sends its tensor, a
        receive sends nothing (its bytes are the sender's)."""
        if self.kind in (SEND, RECV):
            return float(self.nbytes) if self.kind == SEND else 0.0
        if self.kind == ALL_TO_ALL:  # elements: what this rank sends to the others, its own rows left out
            return float(self.nbytes)
        share = (self.group_size - 1) / self.group_size
        return (2 if self.kind == ALL_REDUCE else 1) * share * self.nbytes


def _named_group_size(group_name) -> int:
    """Size of the process group a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _group_object_size(group) -> int:
    """Size of the ProcessGroup a c10d op receives (boxed as a TorchScript object)."""
    from torch.distributed import ProcessGroup

    return (ProcessGroup.unbox(group) if not isinstance(group, ProcessGroup) else group).size()


def _tensors(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _declined(types) -> bool:
    """DTensor arguments: the mode declines, so DTensor dispatches the local ops (with the mode
    still active, so they are seen) instead of the mode seeing global shapes."""
    from torch.distributed.tensor import DTensor

    return any(issubclass(t, DTensor) for t in types)


def _real(types) -> bool:
    """Whether an op runs on real data: plain tensors, or the results of functional collectives
    (AsyncCollectiveTensor, which DTensor hands on without waiting, e.g. a sequence-parallel
    all-gather at micro-batch 1); not the fake tensors of DTensor's sharding propagation."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return all(t is torch.Tensor or issubclass(t, AsyncCollectiveTensor) for t in types)


class CollectiveCounter(TorchDispatchMode):
    """Records every collective dispatched while active (use as a context manager)."""

    def __init__(self):
        super().__init__()
        self.records: list[Record] = []

    def _add(self, kind, tensors, group_size, full_factor):
        for t in tensors:
            self.records.append(Record(kind, t.numel() * full_factor, t.element_size(), group_size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _declined(types):
            return NotImplemented  # let DTensor unwrap first; its local ops come back here
        if not _real(types):
            return func(*args, **kwargs)  # fake tensors of DTensor's sharding propagation: not real work
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "_c10d_functional":
            if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
                self._add(ALL_REDUCE, _tensors(args[0]), _named_group_size(args[2]), 1)
            elif name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
                self._add(ALL_GATHER, _tensors(args[0]), args[1], args[1])  # args[1]: group size
            elif name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
                self._add(REDUCE_SCATTER, _tensors(args[0]), args[2], 1)
        elif ns == "c10d":
            if name == "allreduce_":
                self._add(ALL_REDUCE, _tensors(args[0]), _group_object_size(args[1]), 1)
            elif name == "_allgather_base_":
                self._add(ALL_GATHER, [args[0]], _group_object_size(args[2]), 1)  # args[0]: the gathered output
            elif name in ("broadcast_", "reduce_"):  # pipelined: about (P-1)/P n sent per member
                kind = BROADCAST if name == "broadcast_" else REDUCE
                self._add(kind, _tensors(args[0]), _group_object_size(args[1]), 1)
            elif name in ("send", "recv_"):  # point-to-point: group size 2 (the two ends)
                self._add(SEND if name == "send" else RECV, _tensors(args[0]), 2, 1)
            elif name == "alltoall_base_":  # (output, input, group, output_splits, input_splits)
                self._add_all_to_all(args[1], _group_object_size(args[2]), args[2], args[4])
            elif name == "_reduce_scatter_base_":
                self._add(REDUCE_SCATTER, [args[1]], _group_object_size(args[2]), 1)  # args[1]: the full input
        return func(*args, **kwargs)

    def _add_all_to_all(self, tensor, group_size, group, input_splits):
        """An all-to-all: the rows of `tensor` this rank sends to the other ranks of its group (its
        own split stays; equal splits when none are given)."""
        from torch.distributed import ProcessGroup

        rows = tensor.shape[0] if tensor.dim() else 1
        splits = list(input_splits) or [rows // group_size] * group_size
        me = (ProcessGroup.unbox(group) if not isinstance(group, ProcessGroup) else group).rank()
        per_row = tensor.numel() // rows if rows else 0
        self.records.append(Record(ALL_TO_ALL, (rows - splits[me]) * per_row, tensor.element_size(), group_size))

    def gloo_wire_by_kind(self) -> dict:
        """Sent bytes per member by kind as gloo implements them (reduce-scatter as all-reduce)."""
        out = defaultdict(float)
        for r in self.records:
            kind = ALL_REDUCE if r.kind == REDUCE_SCATTER else r.kind
            out[r.kind] += Record(kind, r.elements, r.element_bytes, r.group_size).sent_bytes()
        return dict(out)

    def by_kind(self, element_bytes: int | None = None) -> dict:
        """Sent bytes per member by collective kind; `element_bytes` re-prices every element
        (e.g. 2 to compare fp32 CPU runs with perfsim's bf16 volumes)."""
        out = defaultdict(float)
        for r in self.records:
            size = element_bytes or r.element_bytes
            out[r.kind] += Record(r.kind, r.elements, size, r.group_size).sent_bytes()
        return dict(out)


FUSED_ATTENTION_PRODUCTS = {"forward": 2, "backward": 5}


def fused_attention_pass(func) -> str | None:
    """"forward" or "backward" for a fused attention kernel of scaled_dot_product_attention (the
    flash, memory-efficient, cuDNN, CPU-flash and XPU "overrideable" ops and their backwards),
    None for any other op (the math fallback decomposes into bmm, which is counted as it runs)."""
    name = func._schema.name.split("::")[-1]
    if func.namespace != "aten" or not name.startswith("_scaled_dot_product_") or "math" in name:
        return None
    return "backward" if name.endswith("_backward") else "forward"


def fused_attention_flops(func, args) -> int:
    """Matrix FLOPs of one fused attention kernel as perfsim counts them (docs/equations.md 2.1,
    3.9): the full s_q x s_k square of every head, no causal halving; forward two products (scores
    and context), backward five (the scores recomputed, then dP, dV, dQ, dK), each 2 b a s_q s_k d.
    The kernel's work is not visible from outside, so this is the model's count, not a measurement;
    FlopCounterMode's own formulas count four backward products, leaving out the recomputation."""
    passed = fused_attention_pass(func)
    q, k = (args[1], args[2]) if passed == "backward" else (args[0], args[1])  # backward: grad_out first
    b, heads, s_q, d = q.shape
    return FUSED_ATTENTION_PRODUCTS[passed] * 2 * b * heads * s_q * k.shape[-2] * d


class OpCounter(TorchDispatchMode):
    """How many ops the host dispatches (every ATen op, of any tensor type): what
    perfsim.cost.host's op tables count and scale the host's time per layer by."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class LocalFlopCounter(TorchDispatchMode):
    """FlopCounterMode's formulas applied to the ops a rank really runs.

    FlopCounterMode itself sees a DTensor op before DTensor unwraps it, so it prices the global
    shapes; this mode declines tensor subclasses (NotImplemented) and counts the local ops that
    the subclass then dispatches. Fused attention kernels are counted by `fused_attention_flops`
    (perfsim's convention) instead of FlopCounterMode's formulas, which have none for the CPU
    kernel and no recomputation in the backward."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import FlopCounterMode

        self.counter = FlopCounterMode(display=False)
        self.fused_attention = defaultdict(int)  # "forward" / "backward": FLOPs by perfsim's count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _declined(types):
            return NotImplemented
        out = func(*args, **kwargs)
        if not _real(types):
            return out
        passed = fused_attention_pass(func)
        if passed:
            self.fused_attention[passed] += fused_attention_flops(func, args)
        elif func._overloadpacket in self.counter.flop_registry:
            self.counter._count_flops(func._overloadpacket, out, args, kwargs)
        return out

    def total(self) -> int:
        return self.counter.get_total_flops() + sum(self.fused_attention.values())

    def by_op(self) -> dict:
        ops = {str(k): v for k, v in self.counter.get_flop_counts()["Global"].items()}
        ops.update({f"fused_attention_{k}": v for k, v in self.fused_attention.items()})
        return ops


def storage_of(t):
    """The storage that holds a saved tensor's memory: a DTensor's local shard, a wrapper
    subclass's inner tensor (functional collectives' results), else the tensor's own."""
    while True:
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        elif type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            t = getattr(t, names[0])
        else:
            break
    return t, t.untyped_storage()


class SavedBytes:
    """Peak of the bytes saved for backward that are alive at once, by distinct storage
    (torch.autograd.graph.saved_tensors_hooks; enter `hooks()` around the step).

    A storage counts from the first tensor saved from it until the autograd graph drops the last
    one (backward frees saved tensors as it goes). Parameters (and views of them) are weights,
    not activations, and are skipped. Floating-point storages are priced at `element_bytes` (2:
    perfsim's bf16, for an fp32 run compared with perfsim; None: their own size), those saved
    inside `loss_scope` at 4 when re-pricing (the fp32 softmax of the loss, as perfsim prices it);
    integer and boolean storages (token ids, targets, causal masks) are counted apart, at their
    own size, since perfsim does not count them."""

    def __init__(self, parameters, element_bytes: int | None = None):
        self.skip = {storage_of(p)[1].data_ptr() for p in parameters}
        self.element_bytes = element_bytes
        self.live = self.peak = self.live_other = self.peak_other = 0
        self.in_loss = False
        self._refs: dict = {}

    class _Held:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def _price(self, local, storage) -> tuple[int, bool]:
        if not local.is_floating_point() or self.element_bytes is None:
            return storage.nbytes(), local.is_floating_point()
        elements = storage.nbytes() // local.element_size()
        return elements * (4 if self.in_loss else self.element_bytes), True

    def _release(self, key):
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            if entry[2]:
                self.live -= entry[1]
            else:
                self.live_other -= entry[1]
            del self._refs[key]

    def _pack(self, t):
        base = t._base if t._base is not None else t
        if t.device.type == "meta" or (base.is_leaf and base.requires_grad):  # a parameter (FSDP's unsharded too)
            return t
        local, storage = storage_of(t)
        key = storage.data_ptr()
        if key in self.skip:
            return t
        if key not in self._refs:
            nbytes, floating = self._price(local, storage)
            self._refs[key] = [0, nbytes, floating]
            if floating:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            else:
                self.live_other += nbytes
                self.peak_other = max(self.peak_other, self.live_other)
        self._refs[key][0] += 1
        held = self._Held(t)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, SavedBytes._Held) else x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def loss_scope(self, fn):
        """`fn` with what it saves priced as the loss's fp32 (when re-pricing)."""
        def wrapped(*args, **kwargs):
            self.in_loss = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_loss = False
        return wrapped
