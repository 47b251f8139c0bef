"""How each tensor-parallel mode splits a layer over its P devices, and what it communicates
(docs/equations.md, section 4).

- 1d (Megatron): QKV and FC1 split by columns, output projection and FC2 by rows; one all-reduce
  of [b, s, h] after attention and one after the MLP forward (operator g), one each backward
  (operator f). With sequence parallelism each becomes an all-gather entering the parallel region
  and a reduce-scatter leaving it (same volume), and the norm/dropout region is split too.
- 2d (SUMMA on a q x q grid, axes row and col): activations [b/q, h/q], weight blocks
  [h_in/q, h_out/q]; forward broadcasts X blocks along the row and W blocks along the column,
  q steps; backward broadcasts W (col) and reduces dX partials (row), broadcasts X (row) and
  reduces dW partials (col).
- 2.5d (q x q x d): d SUMMA slices on b/d tokens each, weights replicated over the depth axis,
  whose weight gradients are all-reduced over depth.
- 3d (q^3, axes input, weight, output): activation [b/q^2, h_in/q], weight [h_in/q^2, h_out/q];
  forward all-gathers X (input axis) and W (weight axis) and reduce-scatters Y (output axis);
  backward all-gathers dY (output), reduce-scatters dX (input) and dW (weight), and re-gathers X
  and W unless the gathered copies were kept. Input and output axes swap roles every linear.

A collective names the grid axis it runs on; `layout.axes` gives each axis's size and stride
inside the tensor-parallel group. Axes are placed heaviest-traffic-innermost (so on the fastest
links) unless the plan fixes the order. Everything takes numbers or numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.cost.counts import attention_key_mix, head_widths
from perfsim.cost.layer import BF16, FP32, Gemm
from perfsim.errors import PerfsimError
from perfsim.spec.model import ModelSpec

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
AXES = {"1d": ("tp",), "2d": ("row", "col"), "2.5d": ("row", "col", "depth"), "3d": ("input", "weight", "output")}


@dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: object  # the full tensor's bytes (gathered size for all-gather / reduce-scatter)
    count: object = 1  # how many such collectives (0 where a plan does not issue it)
    axis: str = "tp"


@dataclass
class Layout:
    """One mode's split of a layer: grid side q, depth d, and the divisors of each tensor class."""

    mode: str
    size: object  # P devices
    q: object
    depth: object
    region_split: object  # norm / dropout / residual tensors
    split: object  # everything else: linear outputs, attention scores, MLP internals
    regather: object  # 3d: re-gather X and W in backward instead of keeping the gathered copies
    axes: dict  # axis -> (size, stride inside the tensor-parallel group)


def weight_shard(mode: str, tp, depth=1):
    """How many ways a mode splits each weight matrix (2.5d replicates over its depth)."""
    return tp / depth if mode == "2.5d" else tp


def grid(mode: str, tp, depth=1):
    """(q, d) of a mode with tp devices."""
    if mode == "2d":
        return np.rint(np.sqrt(tp)), 1
    if mode == "2.5d":
        return np.rint(np.sqrt(tp / depth)), depth
    if mode == "3d":
        return np.rint(np.cbrt(tp)), 1
    return tp, 1


def layout_of(model: ModelSpec, c) -> Layout:
    if model.mla and c.tp_mode != "1d":
        raise PerfsimError(f"latent attention (attention_type = mla) is priced with 1d tensor parallelism only, "
                           f"not --tp-mode {c.tp_mode}")
    q, d = grid(c.tp_mode, c.tp, c.tp_depth)
    if c.tp_mode == "1d":
        region = np.where(c.sp, c.tp, 1)
        sizes = {"tp": c.tp}
    else:
        region = c.tp
        sizes = {"row": q, "col": q, "depth": d} if c.tp_mode != "3d" else {"input": q, "weight": q, "output": q}
        sizes = {a: sizes[a] for a in AXES[c.tp_mode]}
    layout = Layout(c.tp_mode, c.tp, q, d, region, c.tp, c.regather, {a: (s, 1) for a, s in sizes.items()})
    layout.axes = _place_axes(layout, model, c.mbs, c.tp_axes, sizes)
    return layout


def _place_axes(layout: Layout, model: ModelSpec, b, fixed: str, sizes: dict) -> dict:
    """Strides of the grid axes inside the TP group: innermost first as `fixed` lists them, or
    by traffic per layer, heaviest innermost (ties in the mode's axis order)."""
    names = list(sizes)
    if fixed and fixed != "auto":
        order = fixed.split("-")
        traffic = {a: -order.index(a) for a in names}
    else:
        forward, backward = layer_collectives(layout, model, b)
        traffic = {a: sum(x.count * sent_bytes(x.kind, x.nbytes, sizes[a]) for x in forward + backward if x.axis == a)
                   for a in names}
    placed = {}
    for i, a in enumerate(names):
        stride = 1
        for j, other in enumerate(names):
            before = (traffic[other] > traffic[a]) | ((traffic[other] == traffic[a]) & (j < i))
            stride = stride * np.where(before, sizes[other], 1)
        placed[a] = (sizes[a], stride)
    return placed


def sent_bytes(kind: str, nbytes, group_size):
    """Bytes each member sends with ring (all-*) and pipelined (broadcast/reduce) algorithms,
    averaged over the members."""
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if kind == ALL_REDUCE else share * nbytes


def linear_gemm(layout: Layout, name: str, tokens, h_in, h_out, column_parallel: bool) -> Gemm:
    """The GEMM one device runs for Y = X W (X: tokens x h_in), `count` times."""
    q, d, mode = layout.q, layout.depth, layout.mode
    if mode == "1d":
        t = layout.size
        if column_parallel is None:  # duplicated on every rank, on its own tokens (1/t of them with SP)
            return Gemm(name, 1, tokens / layout.region_split, h_out, h_in)
        return Gemm(name, 1, tokens, h_out / t, h_in) if column_parallel else Gemm(name, 1, tokens, h_out, h_in / t)
    if mode == "3d":
        return Gemm(name, 1, tokens / q, h_out / q, h_in / q)
    return Gemm(name, q, tokens / (d * q), h_out / q, h_in / q)


def linear_collectives(layout: Layout, index: int, tokens, h_in, h_out, element=BF16) -> tuple[list, list]:
    """(forward, backward) collectives of the `index`-th linear of a layer (2d, 2.5d, 3d), in
    `element`-byte activations and weights."""
    q, d = layout.q, layout.depth
    if layout.mode == "3d":
        into, out = ("input", "output") if index % 2 == 0 else ("output", "input")
        x, w, y = element * tokens * h_in / q**2, element * h_in * h_out / q**2, element * tokens * h_out / q**2
        forward = [Collective(ALL_GATHER, x, 1, into), Collective(ALL_GATHER, w, 1, "weight"),
                   Collective(REDUCE_SCATTER, y, 1, out)]
        regather = np.where(layout.regather, 1, 0)
        backward = [Collective(ALL_GATHER, y, 1, out), Collective(REDUCE_SCATTER, x, 1, into),
                    Collective(REDUCE_SCATTER, w, 1, "weight"),
                    Collective(ALL_GATHER, x, regather, into), Collective(ALL_GATHER, w, regather, "weight")]
        return forward, backward
    x, w = element * tokens / d * h_in / q**2, element * h_in * h_out / q**2
    forward = [Collective(BROADCAST, x, q, "row"), Collective(BROADCAST, w, q, "col")]
    backward = [Collective(BROADCAST, w, q, "col"), Collective(REDUCE, x, q, "row"),
                Collective(BROADCAST, x, q, "row"), Collective(REDUCE, w, q, "col")]
    if layout.mode == "2.5d":
        backward.append(Collective(ALL_REDUCE, w, np.where(d > 1, 1, 0), "depth"))
    return forward, backward


def _hidden_axis(layout: Layout) -> str:
    """The axis over which the hidden dimension of the norm region is split."""
    return "output" if layout.mode == "3d" else "row"


def layer_linears(model: ModelSpec):
    """(name, h_in, h_out, split in 1d) of a layer's linears, in order: column-parallel (True),
    row-parallel (False) or, for latent attention's down projections, duplicated on every tensor
    rank (None: Megatron-Core's MLASelfAttention builds linear_q_down_proj and linear_kv_down_proj
    as TELinear with parallel_mode "duplicated", run on the rank's own tokens)."""
    h, f = model.hidden, model.ffn_size
    mlp = (("fc1", h, 2 * f if model.gated_mlp else f, True), ("fc2", f, h, False))
    if model.mla:
        a, (qk, v) = model.heads, head_widths(model)
        query = ((("q_down", h, model.q_lora_rank, None), ("q_up", model.q_lora_rank, a * qk, True))
                 if model.q_lora_rank else (("q", h, a * qk, True),))
        return (*query, ("kv_down", h, model.kv_lora_rank + model.qk_rope_dim, None),
                ("kv_up", model.kv_lora_rank, a * (model.qk_nope_dim + v), True), ("proj", a * v, h, False), *mlp)
    return (("qkv", h, model.q_width + 2 * model.kv_hidden, True), ("proj", model.q_width, h, False), *mlp)


def attention_core_gemms(model: ModelSpec, heads, cp=1) -> list[Gemm]:
    """The scores and context products of one layer for `heads` sequence-heads: cp x cp ring
    blocks of (s/cp) queries each; keys per query s, or the window on sliding-window layers (a
    model mixing both gets one pair per kind, counts in proportion to its layers)."""
    qk, v = head_widths(model)
    block = model.seq / cp
    gemms = []
    for share, keys in attention_key_mix(model):
        blocks = heads * cp * cp if share == 1 else heads * share * cp * cp
        key_block = block if keys == model.seq else keys / cp
        gemms += [Gemm("scores", blocks, block, key_block, qk), Gemm("context", blocks, block, v, key_block)]
    return gemms


def layer_gemms(layout: Layout, model: ModelSpec, b, cp=1) -> list[Gemm]:
    """The GEMMs of one layer on one device for `b` sequences' worth of tokens. With context
    parallelism b is mbs/cp (a rank's s/cp tokens of each of mbs sequences, and by causal load
    balancing 1/cp of their attention) and the attention products are cut into the ring's
    blocks: cp x cp blocks of (s/cp) x (s/cp) per sequence-head of the b (docs/equations.md 11.2)."""
    tokens = b * model.seq
    gemms = [linear_gemm(layout, name, tokens, h_in, h_out, col) for name, h_in, h_out, col in layer_linears(model)]
    heads = b * model.heads / layout.size  # whole sequences, heads / P of them, in every mode
    return gemms + attention_core_gemms(model, heads, cp)


def layer_collectives(layout: Layout, model: ModelSpec, b, element=BF16) -> tuple[list, list]:
    """(forward, backward) collectives of one layer, `element` bytes an activation and weight
    element (4 when training in fp32); full recomputation repeats the forward."""
    tokens = b * model.seq
    if layout.mode == "1d":
        activation = element * tokens * model.hidden
        if model.mla:
            return _mla_boundaries(model, tokens, element, layout.region_split > 1)
        return _boundary(activation, layout.region_split > 1, 2), _boundary(activation, layout.region_split > 1, 2)
    forward, backward = [], []
    for index, (_, h_in, h_out, _) in enumerate(layer_linears(model)):
        fwd, bwd = linear_collectives(layout, index, tokens, h_in, h_out, element)
        forward += fwd
        backward += bwd
    stats = norm_statistics(layout, model, tokens, 2)  # two norms a layer
    return forward + [stats], backward + [stats]


def _mla_boundaries(model: ModelSpec, tokens, element, sp) -> tuple[list, list]:
    """(forward, backward) 1d collectives of a latent-attention layer (MLASelfAttention's
    _qkv_down_projection and get_query_key_value_tensors): the down projections run on the rank's
    tokens, so what enters the parallel region is the query latent (or, without q_lora_rank, the
    layer input), the key/value latent and the rotary key: with SP each all-gathered (their
    gradients reduce-scattered backward), without SP the column-parallel up projections' input
    gradients all-reduced backward (the rotary key feeds no tensor-parallel linear). Leaving:
    the projection's [T, h], then the MLP's two boundaries as in any 1d layer."""
    query = model.q_lora_rank or model.hidden
    latents = [element * tokens * width for width in (query, model.kv_lora_rank)]
    rope = element * tokens * model.qk_rope_dim
    activation = element * tokens * model.hidden
    forward = [Collective(ALL_GATHER, x, np.where(sp, 1, 0)) for x in latents + [rope]]
    forward += [Collective(ALL_REDUCE, activation, np.where(sp, 0, 1)), Collective(REDUCE_SCATTER, activation,
                                                                                  np.where(sp, 1, 0))]
    backward = [Collective(REDUCE_SCATTER, x, np.where(sp, 1, 0)) for x in latents + [rope]]
    backward += [Collective(ALL_REDUCE, x, np.where(sp, 0, 1)) for x in latents]
    backward += [Collective(ALL_GATHER, activation, np.where(sp, 1, 0))]
    mlp = _boundary(activation, sp, 1)
    return forward + mlp, backward + mlp


def overlapped_pairs(model: ModelSpec, activation_bytes) -> tuple[list, tuple]:
    """1d + SP with tp_overlap: ((collective, the GEMM it is pipelined with) of one layer, the
    collectives no GEMM hides as (forward, backward) lists, or ()). `activation_bytes`: the
    layer's [b, s, h]. Latent attention gathers its query and key/value latents into the up
    projections (the query's layer input into the direct projection without q_lora_rank); its
    rotary key's gather and scatter stay exposed."""
    gather, scatter = Collective(ALL_GATHER, activation_bytes), Collective(REDUCE_SCATTER, activation_bytes)
    mlp = [(gather, "fc1"), (scatter, "fc2")]
    if not model.mla:
        return [(gather, "qkv"), (scatter, "proj")] + mlp, ()
    per_width = activation_bytes / model.hidden
    query = ((Collective(ALL_GATHER, per_width * model.q_lora_rank), "q_up") if model.q_lora_rank else (gather, "q"))
    latents = [query, (Collective(ALL_GATHER, per_width * model.kv_lora_rank), "kv_up"), (scatter, "proj")]
    rope = per_width * model.qk_rope_dim
    return latents + mlp, ([Collective(ALL_GATHER, rope)], [Collective(REDUCE_SCATTER, rope)])


def norm_statistics(layout: Layout, model: ModelSpec, tokens, norms) -> Collective:
    """The all-reduces of `norms` norms over the axis splitting the hidden dimension (2d, 2.5d,
    3d), one direction, per token of the device's block, fp32: a LayerNorm's sum and sum of
    squares forward and the two sums of its gradient backward; an RMSNorm's sum of squares
    forward and one sum backward (the gradient times the normalised input)."""
    axis = _hidden_axis(layout)
    stats = 2 if model.norm == "layernorm" else 1
    return Collective(ALL_REDUCE, stats * FP32 * tokens * layout.axes[axis][0] / layout.size, norms, axis)


def _boundary(activation_bytes, sp, count):
    """`count` 1d region boundaries: all-reduces, or all-gather + reduce-scatter with SP."""
    return [Collective(ALL_REDUCE, activation_bytes, np.where(sp, 0, count)),
            Collective(ALL_GATHER, activation_bytes, np.where(sp, count, 0)),
            Collective(REDUCE_SCATTER, activation_bytes, np.where(sp, count, 0))]


def embedding_collectives(layout: Layout, model: ModelSpec, b, element=BF16) -> tuple[list, list]:
    """Vocabulary-parallel embedding: the partial lookups of the vocabulary shards are summed.

    1d: all-reduce of [b, s, h] (reduce-scatter into the SP region, all-gather back in backward).
    2d/2.5d: each device holds E[V/q rows, h/q columns] (rows split over `col`), looks its rows up
    for every token of its depth slice, [T/d, h/q], and the partial sums are reduce-scattered over
    `col` to the [T/(dq), h/q] activation block; backward all-gathers the gradient over `col`, and
    2.5d all-reduces the [V/q, h/q] weight gradient over `depth` (replicas of the block).
    3d: the [V/q^2, h/q] shard is all-gathered over `weight` to [V/q, h/q], looked up for the T/q
    tokens of the device's super-block and reduce-scattered over `input`; backward all-gathers the
    gradient over `input` and reduce-scatters the weight gradient over `weight`.
    Weight gradients are in the activations' `element` bytes here, as the linears' weight-gradient
    collectives (docs/equations.md 4.7)."""
    activation = element * b * model.seq * model.hidden
    if layout.mode == "1d":
        sp = layout.region_split > 1
        return ([Collective(ALL_REDUCE, activation, np.where(sp, 0, 1)),
                 Collective(REDUCE_SCATTER, activation, np.where(sp, 1, 0))],
                [Collective(ALL_GATHER, activation, np.where(sp, 1, 0))])
    q, d = layout.q, layout.depth
    weight = element * model.padded_vocab(layout.size) / q * model.hidden / q  # [V/q, h/q]
    if layout.mode == "3d":
        lookups = activation / q**2  # [T/q, h/q]
        return ([Collective(ALL_GATHER, weight, 1, "weight"), Collective(REDUCE_SCATTER, lookups, 1, "input")],
                [Collective(ALL_GATHER, lookups, 1, "input"), Collective(REDUCE_SCATTER, weight, 1, "weight")])
    lookups = activation / (d * q)  # [T/d, h/q]
    backward = [Collective(ALL_GATHER, lookups, 1, "col")]
    if layout.mode == "2.5d":
        backward.append(Collective(ALL_REDUCE, weight, np.where(d > 1, 1, 0), "depth"))
    return [Collective(REDUCE_SCATTER, lookups, 1, "col")], backward


def head_gemm(layout: Layout, model: ModelSpec, b, vocab) -> Gemm:
    return linear_gemm(layout, "logits", b * model.seq, model.hidden, vocab, True)


def head_collectives(layout: Layout, model: ModelSpec, b, vocab, element=BF16) -> tuple[list, list]:
    """Logits (a vocabulary-parallel linear) and the vocabulary-parallel cross-entropy, which
    all-reduces the max, the target logit and the sum of exponentials ([tokens] in fp32); in
    2d/2.5d/3d also the final LayerNorm's statistics (1d: its rows are whole, no collective)."""
    tokens = b * model.seq
    if layout.mode == "1d":
        activation = element * tokens * model.hidden
        sp = layout.region_split > 1
        forward = [Collective(ALL_GATHER, activation, np.where(sp, 1, 0)), Collective(ALL_REDUCE, FP32 * tokens, 3)]
        backward = [Collective(ALL_REDUCE, activation, np.where(sp, 0, 1)),
                    Collective(REDUCE_SCATTER, activation, np.where(sp, 1, 0))]
        return forward, backward
    forward, backward = linear_collectives(layout, 0, tokens, model.hidden, vocab, element)
    final_norm = norm_statistics(layout, model, tokens, 1)  # the final norm before the logits
    forward, backward = [final_norm] + forward, [final_norm] + backward
    # the axis that splits the logits' vocabulary: the output block of a first linear lies along
    # `row` in 2d/2.5d and along `input` in 3d (section 4.1); its tokens are those of that block
    axis = "input" if layout.mode == "3d" else "row"
    local_tokens = tokens * layout.axes[axis][0] / layout.size
    return forward + [Collective(ALL_REDUCE, FP32 * local_tokens, 3, axis)], backward


def collective_time(comm, x: Collective, group_size, stride):
    if x.kind == ALL_REDUCE:
        return comm.all_reduce(x.nbytes, group_size, stride)
    if x.kind == BROADCAST:
        return comm.broadcast(x.nbytes, group_size, stride)
    if x.kind == REDUCE:
        return comm.reduce(x.nbytes, group_size, stride)
    if x.kind == REDUCE_SCATTER:  # a profile may price it apart from the all-gather (gloo: an all-reduce)
        return comm.reduce_scatter(x.nbytes, group_size, stride)
    return comm.all_gather(x.nbytes, group_size, stride)


def collectives_time(comm, layout: Layout, collectives: list, tp_stride):
    groups = {axis: (size, stride * tp_stride) for axis, (size, stride) in layout.axes.items()}
    total = 0.0
    for x in collectives:
        total = total + x.count * collective_time(comm, x, *groups[x.axis])
    return total


def collectives_sent_bytes(layout: Layout, collectives: list):
    return sum(x.count * sent_bytes(x.kind, x.nbytes, layout.axes[x.axis][0]) for x in collectives)


# Weights 1d tensor parallelism keeps whole on every rank while SP feeds each rank its own tokens:
# latent attention's down projections (Megatron-Core's MLASelfAttention builds linear_q_down_proj
# and linear_kv_down_proj as TELinear with parallel_mode "duplicated", which marks their weights
# sequence_parallel) and the latents' norms. Each rank's gradient is its tokens' part, summed over
# the TP group once a step (finalize_model_grads: _allreduce_non_tensor_model_parallel_grads).
TP_REPLICATED_GRADS = ("q_down", "q_norm", "kv_down", "kv_norm")


def replicated_grad_params(model: ModelSpec, c):
    """Parameters of one layer whose gradients the TP group all-reduces once a step (docs/equations.md
    4.2): latent attention's down projections and their norms under 1d TP with SP (tp > 1); 0
    otherwise (without SP every rank sees every token: their gradients agree). The layer's input
    and post-attention norms, SP norms summed in the same call, are left out (as for every model)."""
    from perfsim.cost.counts import layer_params

    if not model.mla:
        return 0.0
    replicated = sum(layer_params(model).get(k, 0) for k in TP_REPLICATED_GRADS)
    return np.where((c.tp_mode == "1d") & (c.tp > 1) & (np.asarray(c.sp) > 0), replicated, 0.0)


def replicated_grad_time(system, comm, c, params):
    """Seconds of the TP all-reduce of `params` replicated parameters' gradients (the profile's
    grad_bytes_per_param each: the fp32 main gradients), once a step; 0 without them."""
    grads = system.framework.grad_bytes_per_param * params
    return np.where(params > 0, comm.all_reduce(grads, c.tp, c.strides["tp"]), 0.0)
