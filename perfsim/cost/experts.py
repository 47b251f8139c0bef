"""Mixture-of-experts layers under expert parallelism (docs/equations.md, section 12).

A MoE layer is attention (priced as a dense layer's, cost/layer.py) followed by the MoE block,
which replaces the dense MLP: the router, the token dispatcher, the routed experts as grouped
GEMMs, the shared experts, and the combine. The layout is Megatron-Core's "parallel folding"
(megatron/core/parallel_state.py, initialize_model_parallel with expert_tensor_parallel_size):
attention runs on tp x cp x dp x pp ranks, the experts on etp x ep x edp x pp over the same ranks,
expert ranks ordered tp-ep-dp-pp (the expert tensor-parallel group innermost, stride 1; the
expert-parallel group stride etp; the expert-data-parallel group stride etp x ep).

What one rank does per MoE layer and micro-batch, with T = mbs / cp x seq / tp tokens (its
sequence-parallel shard; Megatron-Core requires --sequence-parallel with tp > 1 in MoE layers):

- router (megatron/core/transformer/moe/router.py, TopKRouter.forward / gating): a [T, h] x
  [h, experts] GEMM, a softmax (or sigmoid) and a top-k over [T, experts] in fp32;
- all-to-all dispatcher (moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher: dispatch_preprocess,
  token_dispatch, dispatch_postprocess, and the combine_* in reverse): permute the T x topk token
  copies by expert, all-to-all them over the EP group, all-gather them over the ETP group when
  etp > 1, sort them by local expert (sort_chunks_by_idxs); after the experts the reverse:
  sort back, reduce-scatter over ETP, all-to-all back, unpermute (weighted sum by the routing
  probabilities). Two all-to-alls forward and two backward per layer.
- all-gather dispatcher (MoEAllGatherTokenDispatcher): all-gather the T tokens over the ETP x EP
  group, permute locally; reduce-scatter back. One all-gather and one reduce-scatter each way.
- experts (moe/experts.py, TEGroupedMLP, Transformer Engine's GroupedLinear): experts / ep local
  experts, each an FFN of expert_ffn / etp columns, on its token copies: a grouped GEMM, one
  cuBLAS GEMM per local expert (TE's general_grouped_gemm), priced as `experts / ep` GEMMs of M
  tokens each by the same efficiency curve (and measured tables) as dense GEMMs, so a small M
  runs at a small efficiency; each expert's GEMM launches a kernel of its own.
- shared experts (moe/shared_experts.py, SharedExpertMLP): a dense FFN of shared_expert_ffn on
  every token, under the attention's tensor parallelism. Not overlapped with the dispatch:
  Megatron-Core overlaps them only with --moe-shared-expert-overlap, which perfsim does not model.

The slowest expert-parallel rank sets the pace: under real routing it receives `imbalance` (the
profile's moe.imbalance, max over mean token copies per EP rank) times the mean, both in its
all-to-all and in its grouped GEMMs; a forced-balanced benchmark has 1. A capacity factor below 1
drops the copies beyond it (counts.routed_tokens).

- flex dispatcher (MoEFlexTokenDispatcher with its DeepEP backend, _DeepepManager and
  fused_a2a.fused_dispatch): one fused dispatch over the ETP x EP group that sends a token once to
  each node holding one of its experts (over the network) and forwards it there over NVLink once to
  each rank holding one (DeepEP's internode kernels); the combine reduces the same way back. With
  node-limited routing (the model's routing_nodes, DeepSeek-V3's 4) a token reaches fewer nodes;
  under the all-to-all dispatcher, which sends a copy per routed expert, the limit moves no byte
  (flex_spread; docs/equations.md 12.3).

FP8: every dispatcher carries bf16 tokens: Megatron-Core sends the activations in the layer's dtype
(DeepEP's fused_dispatch too) and Transformer Engine casts them to FP8 inside GroupedLinear. Nothing here overlaps the dispatch with compute: Megatron-Core's
default does not (its overlap of one micro-batch's all-to-all with another's compute,
--overlap-moe-expert-parallel-comm / the "1F1B A2A overlap", and DeepSeek's DualPipe are opt-in and
out of scope).

Every function takes numbers or numpy arrays of plans (Columns).
"""

from __future__ import annotations

import numpy as np

from perfsim.cost import counts
from perfsim.cost.columns import FULL, Columns
from perfsim.cost.layer import BF16, FP8, FP32, Gemm, MemoryOp
from perfsim.spec.model import ModelSpec


# --- the layout ---
def expert_sizes(c: Columns) -> tuple:
    """(etp, ep, edp): expert tensor parallelism, expert parallelism and expert data parallelism
    (tp x cp x dp / (etp x ep)) of the plans in `c`."""
    etp = c.expert_tp
    return etp, c.ep, c.tp * c.cp * c.dp / (etp * c.ep)


def group_strides(c: Columns) -> dict:
    """Strides in rank space of the expert groups: Megatron-Core numbers a stage's tp x cp x dp
    ranks tp innermost and lays the expert groups over that numbering in the order tp-ep-dp (ETP
    members 1 apart, EP members etp apart, EDP members etp x ep apart, and the all-gather
    dispatcher's ETP x EP group 1 apart). A stage's ranks are contiguous in rank space when pp is
    outermost (the default order); otherwise its numbering jumps over the pipeline's ranks, and a
    group is priced as evenly spaced over the span its first and last member cover
    (stage_group_stride; docs/equations.md 12.1)."""
    etp = c.expert_tp
    return {"etp": stage_group_stride(c, 1, etp), "ep": stage_group_stride(c, etp, c.ep),
            "edp": stage_group_stride(c, etp * c.ep, c.tp * c.cp * c.dp / (etp * c.ep)),
            "etp_ep": stage_group_stride(c, 1, etp * c.ep)}


def stage_group_stride(c: Columns, step, size):
    """Rank-space stride of the group of `size` ranks `step` apart in a stage's numbering (tp
    innermost, then cp, then dp), starting at the stage's first rank: (rank of its last member) /
    (size - 1), exact where the group is evenly spaced in rank space; `step` where size is 1."""
    strides = c.strides
    last = step * (np.asarray(size, dtype=float) - 1)
    i_tp = np.mod(last, c.tp)
    rest = np.floor_divide(last, c.tp)
    i_cp, i_dp = np.mod(rest, c.cp), np.floor_divide(rest, c.cp)
    rank = i_tp * strides["tp"] + i_cp * strides["cp"] + i_dp * strides["dp"]
    return np.where(np.asarray(size) > 1, rank / np.maximum(np.asarray(size, dtype=float) - 1, 1), step)


def moe_share(model: ModelSpec) -> float:
    """Share of the model's layers that are MoE layers (the rest are the first dense_layers)."""
    return model.moe_layers / model.layers if model.moe else 0.0


def stage_share(model: ModelSpec, c: Columns, position: str):
    """Share of the MoE layers among the decoder layers of the position's stage: the first
    dense_layers lie on the stages that hold them (pipeline.dense_count; docs/equations.md 12.6),
    so a stage's memory and reductions are those of its own mix. moe_share where the model has no
    dense layers (1) or the stage no decoder layer."""
    from perfsim.cost import pipeline

    if not (model.moe and model.dense_layers):
        return moe_share(model)
    n = pipeline.layer_count(model, c, position)
    return np.where(n > 0, (n - pipeline.dense_count(model, c, position)) / np.maximum(n, 1), moe_share(model))


# --- tokens ---
def local_tokens(model: ModelSpec, c: Columns):
    """Tokens entering one rank's MoE block per micro-batch: its sequence-parallel shard,
    mbs / cp x seq / tp."""
    return c.mbs / c.cp * model.seq / c.tp


def dispatched_tokens(model: ModelSpec, c: Columns):
    """Token copies one rank sends into the dispatch per micro-batch: topk per local token, those
    beyond a capacity factor below 1 dropped (counts.routed_tokens)."""
    return counts.routed_tokens(model, local_tokens(model, c))


def expert_tokens(model: ModelSpec, c: Columns, imbalance=1.0):
    """Token copies one rank's local experts compute per micro-batch: what the EP group sends it
    (the mean, dispatched_tokens, times `imbalance` on the slowest rank) gathered over its ETP
    group (etp x that; the all-gather dispatcher gathers the same copies)."""
    return c.expert_tp * dispatched_tokens(model, c) * imbalance


def local_experts(model: ModelSpec, c: Columns):
    return model.experts / c.ep


# --- FLOPs ---
def expert_gemms(model: ModelSpec, c: Columns, imbalance=1.0) -> list[Gemm]:
    """The routed experts' GEMMs on one rank per micro-batch, forward: FC1 and FC2 of each local
    expert on M = expert_tokens / local experts token copies, expert_ffn / etp columns (2 x that
    for SwiGLU's FC1). Grouped: `count` = the local experts."""
    n = local_experts(model, c)
    m = expert_tokens(model, c, imbalance) / n
    f = model.expert_ffn / c.expert_tp
    fc1 = 2 * f if model.gated_mlp else f
    return [Gemm("expert_fc1", n, m, fc1, model.hidden), Gemm("expert_fc2", n, m, model.hidden, f)]


def shared_expert_gemms(model: ModelSpec, c: Columns) -> list[Gemm]:
    """The shared experts' GEMMs on one rank (the attention's tensor parallelism, its tokens
    gathered as a dense MLP's: mbs / cp x seq); none without shared experts."""
    if not model.shared_expert_ffn:
        return []
    tokens, f = c.mbs / c.cp * model.seq, model.shared_expert_ffn / c.tp
    return [Gemm("shared_fc1", 1, tokens, 2 * f if model.gated_mlp else f, model.hidden),
            Gemm("shared_fc2", 1, tokens, model.hidden, f)]


def router_gemm(model: ModelSpec, c: Columns) -> Gemm:
    """The router's logits on the rank's T tokens: [T, h] x [h, experts] (weights replicated)."""
    return Gemm("router", 1, local_tokens(model, c), model.experts, model.hidden)


def expert_forward_flops(model: ModelSpec, c: Columns, imbalance=1.0):
    """Forward matmul FLOPs of one rank's routed experts per micro-batch and MoE layer (2 m n k of
    each expert's FC1 and FC2); over the tp ranks of a replica, at imbalance 1, this is
    counts.moe_layer_forward_flops' expert_fc1 + expert_fc2 for mbs x seq / cp tokens."""
    return sum(2.0 * g.count * g.m * g.n * g.k for g in expert_gemms(model, c, imbalance))


def moe_block_forward_flops(model: ModelSpec, c: Columns, imbalance=1.0):
    """Forward matmul FLOPs of one rank's MoE block per micro-batch: router, routed and shared experts."""
    gemms = [router_gemm(model, c)] + expert_gemms(model, c, imbalance) + shared_expert_gemms(model, c)
    return sum(2.0 * g.count * g.m * g.n * g.k for g in gemms)


# --- element-wise work ---
def moe_memory_ops(model: ModelSpec, c: Columns, imbalance=1.0, element=BF16) -> list[MemoryOp]:
    """The MoE block's element-wise kernels on one rank per micro-batch, forward bytes (a
    backward moves layer.MEMORY_BACKWARD times as much, perfsim's convention):
    - router: reads the fp32 logits [T, experts], writes the fp32 probabilities, and the top-k;
    - permute: reads the T tokens, writes the dispatched copies (all-to-all) or reads the gathered
      tokens and writes the local copies (all-gather);
    - sort by local expert after the all-to-all and back before it (sort_chunks_by_idxs; only
      with more than one local expert and ep > 1): read and write the computed copies, twice;
    - the experts' activation (SwiGLU: reads two halves, writes one; GeLU: reads and writes);
    - unpermute: reads the copies and the probabilities, writes the T tokens (the all-gather
      dispatcher's: the gathered ones, reduce-scattered after)."""
    h, e = model.hidden, element
    t, sent = local_tokens(model, c), dispatched_tokens(model, c)
    computed = expert_tokens(model, c, imbalance)
    gathered = c.expert_tp * c.ep * t  # the all-gather dispatcher's tokens
    alltoall = 1 - np.asarray(c.allgather)
    arrived = np.where(alltoall, t, gathered)  # tokens a rank permutes from
    permuted = np.where(alltoall, sent, computed)  # copies it writes
    sort = alltoall * np.where((c.ep > 1) & (local_experts(model, c) > 1), 1, 0)
    if np.any(c.flex):  # flex: the tokens DeepEP delivered (one a rank) permuted to the copies, no sort
        flex = np.asarray(c.flex) > 0
        arrived = np.where(flex, flex_received(model, c, imbalance), arrived)
        permuted = np.where(flex, computed, permuted)
        sort = np.where(flex, 0, sort)
    f = model.expert_ffn / c.expert_tp
    activation = (3 * e if model.gated_mlp else 2 * e) * computed * f
    return [
        MemoryOp("router_softmax_topk", 3 * FP32 * t * model.experts),
        MemoryOp("moe_permute", e * h * (arrived + permuted)),
        MemoryOp("moe_sort_chunks", sort * 4 * e * h * computed),
        MemoryOp("expert_activation", activation),
        MemoryOp("moe_unpermute", e * h * (arrived + permuted) + FP32 * permuted),
    ]


# --- communication ---
def all_to_all_time(system, nbytes, size, stride):
    """Seconds of one all-to-all in which each of `size` ranks `stride` apart sends `nbytes` in
    all (nbytes / size to each member, itself included), every group of the dimension at once:
    perfsim.cost.topology.all_to_all_line (NVLink inside a node, the node's NICs across, one link
    latency) with the profile's all_to_all factors (efficiency, latency factor, step overhead) and
    measured table, as every collective operation. 0 for a group of one (docs/equations.md 12.3)."""
    from perfsim.cost.topology import TopologyCommModel

    return TopologyCommModel(system).all_to_all(nbytes, size, stride)


def alltoall_bytes_sent(model: ModelSpec, c: Columns, element=BF16, imbalance=1.0):
    """Bytes one rank sends to other ranks in one dispatch all-to-all per micro-batch (the
    combine sends as many back): its dispatched copies of h elements, less the 1/ep share its own
    local experts take; `imbalance` the slowest rank's receive share (a balanced rank sends and
    receives alike)."""
    return element * model.hidden * dispatched_tokens(model, c) * imbalance * (c.ep - 1) / c.ep


def chained(comm, seconds, op: str, size):
    """`seconds` of one `op` call over groups of `size` issued right after another collective of
    the same group with no compute between: without the profile's step overhead for `op` (the wait
    for the slowest rank and the wake-up after compute that a call after compute pays), the link's
    time kept (docs/equations.md 12.3)."""
    factors = getattr(comm, "operation_factors", {}).get(op)
    if not factors or not factors[2]:
        return seconds
    return np.maximum(seconds - np.where(np.asarray(size) > 1, factors[2], 0.0), 0.0)


def dispatch_times(system, comm, model: ModelSpec, c: Columns, imbalance=1.0, element=BF16):
    """Seconds of one MoE layer's dispatch and combine in one direction (forward; the backward
    runs the same collectives on the gradients): all-to-all dispatcher: two all-to-alls over EP
    and, with etp > 1, an all-gather and a reduce-scatter over ETP of the received copies;
    all-gather dispatcher: an all-gather and a reduce-scatter of the tokens over ETP x EP."""
    h, e = model.hidden, element
    strides = group_strides(c)
    etp = c.expert_tp
    sent = e * h * dispatched_tokens(model, c) * imbalance  # what the slowest rank receives, sends back
    # tokens there and back, and the copies' probabilities (an element each) beside them there: that
    # call follows the tokens' on the same group with no compute between (forward, and its gradient
    # after theirs backward), so the ranks have met already and it pays no step overhead (12.3)
    alltoall = (2 * comm.all_to_all(sent, c.ep, strides["ep"])
                + chained(comm, comm.all_to_all(sent / h, c.ep, strides["ep"]), "all_to_all", c.ep))
    alltoall = alltoall + np.where(etp > 1, comm.all_gather(etp * sent, etp, strides["etp"])
                                   + comm.reduce_scatter(etp * sent, etp, strides["etp"]), 0.0)
    group = etp * c.ep
    gathered = e * h * local_tokens(model, c) * group
    allgather = comm.all_gather(gathered, group, strides["etp_ep"]) + comm.reduce_scatter(gathered, group, strides["etp_ep"])
    if np.any(c.flex):  # flex (DeepEP): its dispatch and its combine, a token's bytes once each
        tokens = e * h * local_tokens(model, c) * imbalance  # flex_spread counts the kept copies
        alltoall = np.where(np.asarray(c.flex) > 0, 2 * flex_time(system, tokens, flex_spread(system, model, c)), alltoall)
    return np.where(np.asarray(c.allgather) > 0, allgather, alltoall)


# --- node-limited routing and the flex dispatcher (docs/equations.md 12.3) ---
def expected_bins_hit(pool, per_bin, k: int):
    """Expected distinct bins k draws without replacement from `pool` items, in bins of `per_bin`
    items each, land in: (pool / per_bin) (1 - C(pool - per_bin, k) / C(pool, k)), a bin missed
    by all k draws with the probability prod_i (pool - per_bin - i) / (pool - i), i < k (0 once
    the items outside the bin run out). Numbers or arrays; pool >= k."""
    pool, per_bin = np.asarray(pool, dtype=float), np.asarray(per_bin, dtype=float)
    missed = 1.0
    for i in range(int(k)):
        missed = missed * np.maximum(pool - per_bin - i, 0.0) / (pool - i)
    return pool / per_bin * (1 - missed)


def _kept(model: ModelSpec):
    """The share of the routed copies a capacity factor keeps (1 dropless; counts.routed_tokens)."""
    return counts.routed_tokens(model, 1.0) / model.topk


def flex_spread(system, model: ModelSpec, c: Columns) -> dict:
    """Where one token's copies go under the flex dispatcher (DeepEP) with uniform routing over
    the experts a token may reach, per token a rank dispatches: "network", the copies it sends
    to other nodes (one a node holding any of its experts); "nvlink", the copies a rank forwards
    inside a node (one to each other rank holding any: etp ranks an expert); "ranks", the
    expert-parallel ranks it reaches (each receives it once); "nodes", the nodes of the ETP x EP
    group. The experts lie on the group's nodes in order, experts x members in a node / group a
    node; node-limited routing (routing_nodes) draws the topk from the experts of routing_nodes
    of the nodes, chosen uniformly (the router's groups laid on the nodes, as Megatron-Core's
    node-limited routing sets them), at least the nodes topk experts need; a capacity factor
    scales the copies by its kept share."""
    etp, E, K = c.expert_tp, model.experts, model.topk
    group = etp * c.ep
    stride = np.maximum(group_strides(c)["etp_ep"], 1.0)
    members = np.minimum(np.maximum(np.floor(system.node.devices_per_node / stride), 1.0), group)  # in one node
    per_node = np.maximum(E * members / group, E / c.ep)  # experts a node holds (an EP rank's at least)
    nodes = E / per_node
    reach = model.routing_nodes or nodes
    reach = np.minimum(np.maximum(reach, np.ceil(K / per_node)), nodes)
    pool = reach * per_node
    kept = _kept(model)
    ranks = expected_bins_hit(pool, E / c.ep, K)
    return {"network": kept * expected_bins_hit(pool, per_node, K) * (nodes - 1) / nodes,
            "nvlink": kept * etp * ranks * (members - 1) / members, "ranks": kept * ranks, "nodes": nodes}


def flex_time(system, nbytes, spread: dict):
    """Seconds of one flex dispatch (or combine) in which each rank sends `nbytes` of tokens, one
    copy each (docs/equations.md 12.3): its copies to other nodes over its share of the node's
    NICs and the forwarded copies over NVLink at once (DeepEP pipelines the two), the slower of
    the two, plus one link latency (the network's across nodes). The link classes of the
    all-to-all line (topology.all_to_all_line), without the all_to_all operation's fitted
    factors: they were fitted to NCCL's all-to-all, not to DeepEP's kernels."""
    node, net, eff = system.node, system.network, system.collectives
    nvlink = node.node_link_bandwidth_Bps * eff.node_efficiency
    nic = net.nics_per_node * net.nic_bandwidth_Bps / net.oversubscription * eff.network_efficiency \
        / node.devices_per_node
    latency = np.where(spread["nodes"] > 1, net.latency_s, node.node_link_latency_s)
    return np.maximum(nbytes * spread["network"] / nic, nbytes * spread["nvlink"] / nvlink) + latency


def flex_received(model: ModelSpec, c: Columns, imbalance=1.0):
    """Tokens one rank receives from the flex dispatch per micro-batch (a token once a rank,
    whatever its local experts there): local tokens x the EP ranks a token reaches x etp, as
    every rank of the group sends as many; the slowest rank `imbalance` times that. Without the
    node limit (flex_spread's "ranks" has it, which needs the profile's node size): an upper
    bound where routing_nodes binds (DeepSeek-V3 at EP 64 on 8 nodes: 7.68 ranks a token, 7.36 under it)."""
    return c.expert_tp * local_tokens(model, c) * imbalance * _kept(model) * \
        expected_bins_hit(model.experts, model.experts / c.ep, model.topk)


# --- parameters ---
def expert_params_per_rank(model: ModelSpec, c: Columns):
    """Routed-expert parameters one rank holds per MoE layer: experts / ep experts, each split etp ways."""
    return model.experts * counts.expert_params(model) / (c.ep * c.expert_tp)


def moe_layer_params_per_rank(model: ModelSpec, c: Columns) -> tuple:
    """(parameters one rank holds of a MoE layer outside the routed experts, routed-expert
    parameters): attention and shared experts split tp ways (1d), the norms and the router
    replicated (Megatron-Core's TopKRouter weight is not tensor-parallel)."""
    pieces = counts.moe_layer_params(model)
    replicated = pieces["norms"] + pieces["router"] + (2 * model.hidden if model.bias else 0)
    split = sum(v for k, v in pieces.items() if k not in ("norms", "router", "experts")) - \
        (2 * model.hidden if model.bias else 0)
    return split / c.tp + replicated, expert_params_per_rank(model, c)


def dense_layer_params_per_rank(model: ModelSpec, c: Columns):
    """One dense layer's parameters on a rank under 1d tensor parallelism (memory.stage_params' rule)."""
    pieces = counts.layer_params(model)
    bias = model.hidden if model.bias else 0
    replicated = pieces["norms"] + 2 * bias
    return (sum(pieces.values()) - replicated) / c.tp + replicated


def layer_params_per_rank(model: ModelSpec, c: Columns, share=None) -> tuple:
    """(parameters of an average layer on one rank reduced over dp x cp, those reduced over the
    expert-data-parallel group): the mix `share` (default moe_share) of MoE and dense layers."""
    share = moe_share(model) if share is None else share
    other, experts = moe_layer_params_per_rank(model, c)
    dense = dense_layer_params_per_rank(model, c) if np.any(share < 1) else 0.0
    return share * other + (1 - share) * dense, share * experts


def expert_linear_weights_per_rank(model: ModelSpec, c: Columns, share=None):
    """Weight elements of an average layer's MoE GEMMs (routed and shared experts; FP8 copies are
    kept of them) one rank holds, less those of the dense MLP fp8.weight_copy_bytes counts for
    every layer: what FP8 training's copies change by in a MoE model."""
    h = model.hidden
    dense_mlp = h * (3 if model.gated_mlp else 2) * model.ffn_size / c.tp
    shared = h * (3 if model.gated_mlp else 2) * model.shared_expert_ffn / c.tp
    routed = model.experts * h * (3 if model.gated_mlp else 2) * model.expert_ffn / (c.ep * c.expert_tp)
    return (moe_share(model) if share is None else share) * (routed + shared - dense_mlp)


# --- memory ---
def saved_activation_bytes(model: ModelSpec, c: Columns, element=BF16, fp8=0, imbalance=1.0):
    """Bytes one rank's MoE block keeps for backward per micro-batch and MoE layer, without
    recomputation, beyond what the dense layer's region keeps (the norm's output, kept as the
    router's input as a dense layer keeps it as FC1's):
    - the router's fp32 probabilities [T, experts] (softmax backward) and its top-k scores;
    - the permuted copies each expert's FC1 keeps (its FP8 copy in FP8), the FC1 output (SwiGLU:
      gate and up, 2 f / etp a copy), FC2's input (FP8 copy in FP8), and the experts' output the
      unpermute's weighting by the probabilities keeps;
    - the shared experts as a dense MLP of shared_expert_ffn.
    The dense MLP's internals (memory.activation_bytes' mlp) are not kept in a MoE layer: the
    caller takes them out."""
    e = element
    h = model.hidden
    t = local_tokens(model, c)
    computed = expert_tokens(model, c, imbalance)
    f = model.expert_ffn / c.expert_tp
    linear = np.where(np.asarray(fp8) > 0, FP8, e)
    router = FP32 * t * model.experts + (FP32 + 8) * dispatched_tokens(model, c)  # probs; scores and indices
    experts = computed * (linear * h + (2 * e if model.gated_mlp else e) * f + linear * f + e * h)
    sf = model.shared_expert_ffn / c.tp  # 0 without shared experts
    shared = (c.mbs / c.cp * model.seq) * ((2 * e if model.gated_mlp else e) * sf + linear * sf)
    return router + experts + shared


def dense_mlp_saved_bytes(model: ModelSpec, c: Columns, element=BF16, fp8=0):
    """What memory.activation_bytes keeps of a dense layer's MLP internals under 1d tensor
    parallelism (GeLU input or SwiGLU's halves, FC2's input): taken out of a MoE layer's."""
    e, t = element, c.tp
    tokens = c.mbs / c.cp * model.seq
    linear = np.where(np.asarray(fp8) > 0, FP8, e)
    return (2 * e if model.gated_mlp else e) * tokens * model.ffn_size / t + linear * tokens * model.ffn_size / t


def layer_saved_delta(model: ModelSpec, c: Columns, element=BF16, fp8=0, imbalance=1.0, kept=True, share=None):
    """What an average layer of the model keeps beyond perfsim's dense layer: moe_share x (the MoE
    block's saved bytes less the dense MLP's), 0 under full recomputation (a layer keeps its
    input alone) and for a dense model; `kept` False: what one layer rebuilds in a fully
    recomputed backward (the same bytes, for that layer alone). `share`: a stage's MoE share
    (stage_share) in place of the model's."""
    if not model.moe:
        return 0.0
    delta = (moe_share(model) if share is None else share) * (saved_activation_bytes(model, c, element, fp8, imbalance)
                                - dense_mlp_saved_bytes(model, c, element, fp8))
    return np.where(c.recompute == FULL, 0.0, delta) if kept else np.where(c.recompute == FULL, delta, 0.0)


def dispatch_buffer_bytes(model: ModelSpec, c: Columns, element=BF16, imbalance=1.0):
    """Transient buffers of one MoE layer at its peak (one layer at a time, not kept): the
    permuted copies and the all-to-all's output (or the gathered tokens of the all-gather
    dispatcher), the ETP-gathered copies, and the experts' FC1 output while FC2 runs."""
    e, h = element, model.hidden
    sent = dispatched_tokens(model, c) * imbalance
    computed = expert_tokens(model, c, imbalance)
    f = model.expert_ffn / c.expert_tp
    alltoall = e * h * (2 * sent + computed) + (2 * e if model.gated_mlp else e) * computed * f
    if np.any(c.flex):  # flex: the tokens DeepEP delivered and their permuted copies
        flex = e * h * (flex_received(model, c, imbalance) + computed) + (2 * e if model.gated_mlp else e) * computed * f
        alltoall = np.where(np.asarray(c.flex) > 0, flex, alltoall)
    gathered = c.expert_tp * c.ep * local_tokens(model, c)  # tokens of the whole ETP x EP group
    allgather = e * h * (gathered + computed) + (2 * e if model.gated_mlp else e) * computed * f
    return np.where(np.asarray(c.allgather) > 0, allgather, alltoall)


# --- one layer's time ---
PER_EXPERT_PASSES = (2, 4)  # grouped GEMMs forward (FC1, FC2) and backward (their data and weight gradients)


def _scaled(work, factor):
    from dataclasses import fields

    return type(work)(**{f.name: factor * getattr(work, f.name) for f in fields(work)})


def _added(*works):
    from dataclasses import fields

    first = works[0]
    return type(first)(**{f.name: sum(getattr(w, f.name) for w in works) for f in fields(first)})


def moe_layer_work(model: ModelSpec, system, c: Columns, dense, mlp_gemms: list, mlp_ops: list, peak_flops, clock,
                   imbalance=None):
    """An average layer's Work (cost/layer.py) on the slowest expert-parallel rank: the dense
    layer's `dense` with moe_share of its MLP (`mlp_gemms` FC1 and FC2 and `mlp_ops`, its
    activation) replaced by the MoE block: router (bf16, as Megatron-Core's router linear runs
    in the input's dtype), the routed experts' grouped GEMMs at `imbalance` (default the
    profile's moe.imbalance, else 1) with a kernel launch per local expert beyond the first
    (PER_EXPERT_PASSES), the shared experts, and the block's element-wise kernels (moe_memory_ops),
    at the SM clock ratio `clock` (cost/clocks.py); FP8 where the dense GEMMs are (c.fp8)."""
    from perfsim.cost import clocks
    from perfsim.cost.layer import Work

    share = moe_share(model)
    if not share:
        return dense
    imbalance = moe_imbalance(system, model) if imbalance is None else imbalance
    dev = system.device
    mlp = clocks.clocked_work(clock, dev, peak_flops, mlp_gemms, mlp_ops, 0, c.fp8)
    block = clocks.clocked_work(clock, dev, peak_flops, expert_gemms(model, c, imbalance) + shared_expert_gemms(model, c),
                                moe_memory_ops(model, c, imbalance, c.element), 0, c.fp8)
    router = clocks.clocked_work(clock, dev, peak_flops, [router_gemm(model, c)], [], 0, 0)
    launches = (local_experts(model, c) - 1) * dev.kernel_overhead_s
    extra = Work(time_s=PER_EXPERT_PASSES[0] * launches, backward_s=PER_EXPERT_PASSES[1] * launches,
                 curve_s=sum(PER_EXPERT_PASSES) * launches)
    # the host's issue of the expert kernels, one expert after another (expert_host_times)
    host_fwd, host_bwd = expert_host_times(system, model, c)
    host = Work(time_s=host_fwd, backward_s=host_bwd)
    return _added(dense, _scaled(mlp, -share), _scaled(_added(block, router, extra, host), share))


EXPERT_KERNELS = ((2, 4), (2, 2))  # per local expert (forward, backward): GEMMs; FP8's quantizations


def expert_host_times(system, model: ModelSpec, c: Columns) -> tuple:
    """(forward, backward) host seconds one MoE layer's grouped linears take to issue their
    per-expert kernels (Transformer Engine's GroupedLinear splits its input by expert and issues
    each expert's GEMM, and in FP8 each expert's quantization, one after another: forward FC1 and
    FC2; backward their data and weight gradients, EXPERT_KERNELS): local experts x kernels x the
    profile's moe.expert_kernel_host_s. The all-to-all dispatcher waits for the device before it
    dispatches (the split sizes of the all-to-all are read back to the host: dispatch_preprocess),
    so the host cannot run ahead into the expert kernels, and each expert's kernels wait for
    their issue: the time adds to the layer's (docs/equations.md 12.4). 0 without the number."""
    tau = getattr(getattr(system, "moe", None), "expert_kernel_host_s", None)
    if tau is None:  # under draws of a profile's ranges an array
        return 0.0, 0.0
    (gemm_f, gemm_b), (cast_f, cast_b) = EXPERT_KERNELS
    n = local_experts(model, c)
    fp8 = np.asarray(c.fp8)
    return n * (gemm_f + fp8 * cast_f) * tau, n * (gemm_b + fp8 * cast_b) * tau


def moe_imbalance(system, model: ModelSpec | None = None):
    """The profile's moe.imbalance (max over mean token copies per EP rank), 1 where it has none;
    with a capacity factor (the model's capacity_factor) no expert takes more than that times its
    fair share, so no rank either: the imbalance is capped there (the copies beyond are dropped,
    counts.routed_tokens)."""
    value = getattr(getattr(system, "moe", None), "imbalance", None)
    value = 1.0 if value is None else value
    if model is not None and model.capacity_factor:
        value = np.minimum(value, max(model.capacity_factor, 1.0))
    return value


def ep_comm_times(system, comm, model: ModelSpec, c: Columns, imbalance=None) -> tuple:
    """(forward, backward) seconds of an average layer's expert-parallel communication on the
    slowest rank: moe_share x dispatch_times each way (docs/equations.md 12.3)."""
    if not model.moe:
        return 0.0, 0.0
    imbalance = moe_imbalance(system, model) if imbalance is None else imbalance
    each = moe_share(model) * dispatch_times(system, comm, model, c, imbalance, c.element)
    return each, each


EP_OVERLAP_PIECES = 4  # a layer's all-to-alls: dispatch and combine, forward and backward


def overlapped_ep_times(system, forward, backward, layer_compute) -> tuple:
    """(forward, backward) exposed seconds of an average layer's all-to-alls with ep_overlap
    (Megatron-Core's --overlap-moe-expert-parallel-comm: in the steady state the forward of one
    micro-batch and the backward of another run merged, each one's all-to-alls on a stream of
    their own beside the other's compute): the layer's EP_OVERLAP_PIECES all-to-alls beside its
    `layer_compute` seconds (forward and backward), overlap.overlapped_exposure, with the
    data-parallel collectives' efficiency (NCCL holds SMs alike: contention.py)."""
    from perfsim.cost.contention import overlap_efficiency
    from perfsim.cost.overlap import overlapped_exposure

    total = forward + backward
    exposed = overlapped_exposure(total, layer_compute, EP_OVERLAP_PIECES, overlap_efficiency(system, "dp"))
    share = np.divide(exposed, total, out=np.zeros_like(np.asarray(total * 1.0)), where=np.asarray(total) > 0)
    return forward * share, backward * share


def tp_comm_share(model: ModelSpec, c: Columns):
    """Share of a 1d layer's tensor-parallel collectives an average layer keeps: a MoE layer
    without shared experts has no MLP region to gather into and scatter out of (its router and
    dispatcher take the sequence-parallel shard; the expert TP's gathers are ep_comm's), half of
    the layer's two regions; with shared experts the MLP region's stay."""
    if not model.moe or model.shared_expert_ffn:
        return 1.0
    return 1 - moe_share(model) / 2


# --- what a stage holds and reduces ---
def stage_expert_params(model: ModelSpec, c: Columns, layers, share=None):
    """Routed-expert parameters one rank of a stage of `layers` layers holds (reduced and sharded
    over the expert-data-parallel group, not over dp x cp); `share` its MoE share (stage_share)."""
    if not model.moe:
        return 0.0
    return layers * layer_params_per_rank(model, c, share)[1]


def expert_reduction_times(system, comm, c: Columns, expert_params) -> tuple:
    """(gradient reduction, weight all-gather) of a stage's routed experts once per step over the
    expert-data-parallel group (etp x ep apart): an all-reduce with ZeRO 0, a reduce-scatter and
    an all-gather with the distributed optimizer (ZeRO 1), as data_parallel.step_reduction_time
    does for the other parameters over dp x cp."""
    _, _, edp = expert_sizes(c)
    stride = group_strides(c)["edp"]
    grads = system.framework.grad_bytes_per_param * expert_params
    reduction = np.where(c.zero == 0, comm.all_reduce(grads, edp, stride), comm.reduce_scatter(grads, edp, stride))
    gather = np.where(c.zero == 1, comm.all_gather(c.element * expert_params, edp, stride), 0.0)
    return reduction, gather


def optimizer_params(c: Columns, params, expert_params):
    """Parameters whose optimizer states a rank holds, scaled to dp x cp: with the distributed
    optimizer (ZeRO 1) the routed experts' are sharded over the expert-data-parallel group, the
    others over dp x cp, so `params` with the experts' counted at dp x cp / edp
    (data_parallel.optimizer_time and memory divide by dp x cp)."""
    _, _, edp = expert_sizes(c)
    return np.where(c.zero >= 1, params - expert_params + expert_params * c.dp_cp / edp, params)


def expert_weight_cast_time(model: ModelSpec, system, c: Columns, layers, share=None):
    """Seconds FP8 training spends once a step casting a stage's expert weights (in place of the
    dense MLP's fp8.weight_cast_time counts) to FP8 after the optimizer step: a streaming pass of
    FP8_CAST_BYTES a weight element (0 unless c.fp8 and the model is a mixture of experts)."""
    from perfsim.cost.layer import FP8_CAST_BYTES

    if not model.moe:
        return 0.0
    dev = system.device
    elements = layers * expert_linear_weights_per_rank(model, c, share)
    return c.fp8 * FP8_CAST_BYTES * elements / (dev.memory_bandwidth_Bps * dev.memory_efficiency)
