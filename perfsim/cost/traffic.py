"""Bytes a whole training step sends, by parallel dimension, summed over every device.

The volumes behind the times of stage.py and data_parallel.py, in the ring convention of
tensor_parallel.sent_bytes (an all-reduce member sends 2 (n-1)/n of the buffer, an all-gather or
reduce-scatter member (n-1)/n). The validation harness counts what a real step sends and compares
it with these numbers (docs/equations.md, section 10).
"""

from __future__ import annotations

from perfsim.cost import experts, pipeline
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import ELEMENT_BYTES, columns_of, stage_layer_count
from perfsim.cost.context_parallel import kv_block_bytes
from perfsim.cost.data_parallel import zero3_gathers
from perfsim.cost.layer import BF16
from perfsim.cost.memory import stage_params
from perfsim.spec.model import ModelSpec
from perfsim.spec.plan import Plan
from perfsim.spec.system import System


def tp_collectives(model: ModelSpec, plan: Plan, element=BF16) -> tuple:
    """(layout, one layer's collectives, the embedding's and head's) of one micro-batch, forward
    and backward, the layer's forward once more under full recomputation; `element`-byte tensors."""
    layout = tpc.layout_of(model, columns_of(plan))
    b, vocab = plan.mbs / plan.cp, model.padded_vocab(plan.tp)  # a context-parallel rank's mbs/cp sequences' worth
    fwd, bwd = tpc.layer_collectives(layout, model, b, element)
    layer = fwd + bwd + (fwd if plan.recompute == "full" else [])
    edges = [x for pair in (tpc.embedding_collectives(layout, model, b, element),
                            tpc.head_collectives(layout, model, b, vocab, element))
             for x in pair[0] + pair[1]]
    return layout, layer, edges


def _tp_per_microbatch(model: ModelSpec, plan: Plan, element=BF16) -> float:
    """Bytes the tensor-parallel groups of one micro-batch send through every layer, the embedding
    and the head (all members together; cp groups with context parallelism)."""
    layout, layer, edges = tp_collectives(model, plan, element)
    member = model.layers * tpc.collectives_sent_bytes(layout, layer) + tpc.collectives_sent_bytes(layout, edges)
    return plan.tp * plan.cp * float(member)


def _pp_per_microbatch(model: ModelSpec, plan: Plan, element=BF16) -> float:
    """Activations forward and their gradients backward across the p v - 1 chunk boundaries of
    one micro-batch, each tensor-parallel member sending its 1/t share; in 1d without SP the
    receiving group all-gathers the shares again (stage.py)."""
    if plan.pp == 1:
        return 0.0
    activation = element * plan.mbs * model.seq * model.hidden
    hops = plan.pp * plan.vpp - 1
    regather = plan.tp * tpc.sent_bytes(tpc.ALL_GATHER, activation, plan.tp) \
        if plan.tp_mode == "1d" and not plan.sp else 0.0
    return 2 * hops * (activation + regather)


def dp_sent_by_kind(system: System, plan: Plan, params: float, element=BF16) -> dict:
    """Bytes one device sends per step for data parallelism over `params` parameters, by
    collective kind (data_parallel.py: ZeRO-0 all-reduce; ZeRO-1 reduce-scatter + weight
    all-gather; ZeRO-2 a reduce-scatter per micro-batch + the all-gather; ZeRO-3 per micro-batch
    two weight all-gathers (DeepSpeed: three with full recomputation) and a reduce-scatter)."""
    d = plan.dp * plan.cp  # gradients are reduced over data and context parallelism together
    if d == 1:
        return {}
    grads = system.framework.grad_bytes_per_param * params
    rs = tpc.sent_bytes(tpc.REDUCE_SCATTER, grads, d)
    ag = tpc.sent_bytes(tpc.ALL_GATHER, element * params, d)
    m = plan.microbatches
    if plan.zero == 0:
        return {tpc.ALL_REDUCE: tpc.sent_bytes(tpc.ALL_REDUCE, grads, d)}
    if plan.zero == 1:
        return {tpc.REDUCE_SCATTER: rs, tpc.ALL_GATHER: ag}
    if plan.zero == 2:
        return {tpc.REDUCE_SCATTER: m * rs, tpc.ALL_GATHER: ag}
    return {tpc.REDUCE_SCATTER: m * rs, tpc.ALL_GATHER: float(zero3_gathers(system, columns_of(plan))) * m * ag}


def _cp_per_microbatch(model: ModelSpec, plan: Plan, element=BF16) -> float:
    """Key/value blocks ring attention passes for one micro-batch (context_parallel.py): every
    rank of every layer sends cp - 1 blocks forward, and cp - 1 blocks with their gradients
    backward; recomputation (full or selective) runs the forward ring again."""
    if plan.cp == 1:
        return 0.0
    passes = 3 + (plan.recompute != "none")
    return model.layers * plan.tp * plan.cp * (plan.cp - 1) * passes * kv_block_bytes(model, plan.mbs, plan.cp, plan.tp, element)


INDEX_BYTES = 8  # an int64 expert index (the all-gather dispatcher gathers each token's chosen experts)


def ep_all_to_all_bytes(model: ModelSpec, plan: Plan, element=BF16) -> float:
    """Bytes one rank's all-to-alls send in one MoE layer for one micro-batch in one pass (the
    backward sends as much): the dispatched tokens there and back and their probabilities (an
    element a copy, 1/hidden of the tokens) there, each (ep - 1) / ep of its copies (the rest stay
    with its own experts); 0 under the all-gather and the flex dispatcher (no all-to-all)."""
    if plan.moe_dispatcher in ("allgather", "flex") or not model.moe:
        return 0.0
    sent = float(experts.alltoall_bytes_sent(model, columns_of(plan), element))  # tokens, one way
    return 2 * sent + sent / model.hidden


def _ep_per_layer_pass(model: ModelSpec, plan: Plan, element=BF16, system: System | None = None) -> float:
    """Bytes one rank sends in one MoE layer's dispatch and combine for one micro-batch in one pass
    (the forward, or the backward, which runs the reverse collectives on the gradients; docs/equations.md
    12.3), balanced routing. All-to-all dispatcher: the tokens there and back and their probabilities
    there over EP, each (ep - 1) / ep of the copies; with etp > 1 the received copies and probabilities
    all-gathered over ETP and the outputs reduce-scattered, each member sending (etp - 1) x its copies.
    All-gather dispatcher: over the etp x ep group g, the tokens gathered and the outputs
    reduce-scattered ((g - 1) x T tokens each), the copies' probabilities gathered (an element each;
    their gradients reduce-scattered in backward), and in the forward the chosen experts (int64; no
    gradient), averaged over the two passes. Flex dispatcher (DeepEP, on `system`'s nodes): each
    token of the rank's T to the other nodes holding its experts and each forwarded copy over
    NVLink (experts.flex_spread), there and back; DeepEP's per-token top-k indices and weights
    and source metadata (8 topk + 8 bytes over the network) are left out, 0.5% of a DeepSeek-V3 token."""
    c = columns_of(plan)
    if plan.moe_dispatcher == "flex":
        spread = experts.flex_spread(system, model, c)
        tokens = float(experts.local_tokens(model, c))
        return 2 * element * model.hidden * tokens * float(spread["network"] + spread["nvlink"])
    h, e = model.hidden, element
    copies = float(experts.dispatched_tokens(model, c))
    etp = float(c.expert_tp)
    if plan.moe_dispatcher == "allgather":
        g, t = etp * plan.ep, float(experts.local_tokens(model, c))
        return (g - 1) * (2 * t * h * e + copies * e + copies * INDEX_BYTES / 2)
    return ep_all_to_all_bytes(model, plan, element) + (etp - 1) * copies * e * (2 * h + 1)


def _ep_sent(model: ModelSpec, plan: Plan, element=BF16, system: System | None = None) -> float:
    """Bytes the whole job's expert-parallel dispatch and combine send in one step: every rank of
    a stage, every MoE layer, every micro-batch, forward and backward, and the forward once more
    under full recomputation (the recomputed forward dispatches again)."""
    if not model.moe:
        return 0.0
    passes = 2 + (plan.recompute == "full")
    ranks = plan.tp * plan.cp * plan.dp
    return ranks * model.moe_layers * plan.microbatches * passes * _ep_per_layer_pass(model, plan, element, system)


def expert_dp_sent_by_kind(system: System, plan: Plan, expert_params: float, element=BF16) -> dict:
    """Bytes one device sends per step reducing `expert_params` routed-expert parameters over the
    expert-data-parallel group (tp x cp x dp / (etp x ep) ranks, not dp x cp): an all-reduce with
    ZeRO 0, a reduce-scatter and the weights' all-gather with the distributed optimizer, as
    experts.expert_reduction_times prices them."""
    _, _, edp = experts.expert_sizes(columns_of(plan))
    edp = float(edp)
    if edp <= 1 or not expert_params:
        return {}
    grads = system.framework.grad_bytes_per_param * expert_params
    if plan.zero == 0:
        return {tpc.ALL_REDUCE: tpc.sent_bytes(tpc.ALL_REDUCE, grads, edp)}
    out = {tpc.REDUCE_SCATTER: tpc.sent_bytes(tpc.REDUCE_SCATTER, grads, edp)}
    if plan.zero == 1:
        out[tpc.ALL_GATHER] = tpc.sent_bytes(tpc.ALL_GATHER, element * expert_params, edp)
    return out


def step_sent_bytes(model: ModelSpec, system: System, plan: Plan, dtype: str = "bf16") -> dict:
    """{"tp", "cp", "pp", "dp", "ep", "total"}: bytes the whole job sends in one step, training in
    `dtype` (fp32 sends 4-byte activations and weights where bf16 sends 2). "dp" holds the gradient
    reductions, a model with experts' routed experts over their expert-data-parallel group; "ep" the
    dispatch and combine; "tp" with latent attention under 1d TP + SP also its down projections'
    gradients, all-reduced over TP once a step (tensor_parallel.replicated_grad_params)."""
    m, e = plan.microbatches, ELEMENT_BYTES.get(dtype, BF16)
    tp = plan.dp * m * _tp_per_microbatch(model, plan, e)  # every layer once per pipeline
    pp = plan.dp * m * _pp_per_microbatch(model, plan, e)  # linear in the tokens: cp ranks send 1/cp each
    cp = plan.dp * m * _cp_per_microbatch(model, plan, e)
    c = columns_of(plan)
    held = {pos: float(stage_params(model, c, pos)) for pos in pipeline.positions(c)}
    routed = {pos: float(experts.stage_expert_params(model, c, stage_layer_count(model, c, pos),
                                                     experts.stage_share(model, c, pos))) if model.moe else 0.0
              for pos in held}
    stages = [pipeline.position_of(c, i) for i in range(plan.pp)]
    dp = plan.tp * plan.cp * plan.dp * sum(sum(dp_sent_by_kind(system, plan, held[p] - routed[p], e).values())
                                           + sum(expert_dp_sent_by_kind(system, plan, routed[p], e).values())
                                           for p in stages)
    ep = _ep_sent(model, plan, e, system)
    if model.mla:  # latent attention's replicated weights: each stage's gradients all-reduced over TP once a step
        grads = system.framework.grad_bytes_per_param * float(tpc.replicated_grad_params(model, c))
        tp += plan.tp * plan.cp * plan.dp * sum(
            tpc.sent_bytes(tpc.ALL_REDUCE, grads * float(stage_layer_count(model, c, s) + pipeline.mtp_count(c, s)), plan.tp)
            for s in stages)
    if model.tied_embeddings and plan.pp > 1:  # the first and last stage all-reduce the word embedding's gradient
        word = model.padded_vocab(plan.tp) * model.hidden / tpc.weight_shard(plan.tp_mode, plan.tp, plan.tp_depth)
        pp += plan.tp * plan.cp * plan.dp * 2 * tpc.sent_bytes(tpc.ALL_REDUCE, system.framework.grad_bytes_per_param * word, 2)
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "total": tp + cp + pp + dp + ep}
