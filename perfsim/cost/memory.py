"""Peak memory of one device (docs/equations.md, section 7).

Model states follow mixed-precision Adam: bf16 weights (2 bytes), gradients (the framework's
grad_bytes_per_param), fp32 master weights, momentum and variance (12 bytes), sharded over the
data-parallel group by ZeRO stage: 1 shards the optimizer states, 2 also the gradients, 3 also
the weights. Activations follow Korthikanti et al. (2022) per layer, times the micro-batches a
pipeline stage holds at once. The first and the last stage are computed; the peak is the larger.
"""

from __future__ import annotations

import functools

import numpy as np

from perfsim.cost import counts, experts, fp8, pipeline, stack_memory
from perfsim.cost.columns import (FULL, GPIPE, INTERLEAVED, NONE, SELECTIVE, Columns, distinct_rows_of, rows_of,
                                  stage_layer_count)
from perfsim.cost.context_parallel import kv_block_bytes
from perfsim.cost.layer import BF16, FP8, FP32
from perfsim.cost.tensor_parallel import layout_of, weight_shard
from perfsim.spec.model import ModelSpec
from perfsim.spec.plan import edge_chunk_layers
from perfsim.spec.system import System

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights, Adam momentum and variance
# layer pieces (counts.layer_params) every 1d tensor rank holds whole
REPLICATED_1D = ("norms", "qk_norm", "q_down", "q_norm", "kv_down", "kv_norm")


def activation_bytes(model: ModelSpec, b, split, region_split, recompute, linear_input_split=None,
                     gathered_weight_bytes=0.0, flash=0, element=BF16, autocast=0, fp8=0):
    """Bytes one layer keeps for backward per micro-batch on one device, tensor by tensor.

    `split` divides the tensors inside the tensor-parallel region, `region_split` the norm,
    dropout and residual tensors; `linear_input_split` (default: as their region) the inputs the
    linears keep for their weight gradients, which 3d keeps gathered. For a GPT layer
    (ffn = 4h, kv_heads = heads, dropout) in 1d this is Korthikanti's sbh(10 + 24/t + 5as/(ht))
    without SP, (sbh/t)(34 + 5as/h) with SP, 34sbh/t (or sbh(10 + 24/t)) with selective
    recomputation, and 2sbh (2sbh/t with SP) with full recomputation. With `flash` attention no
    s x s tensor is kept: the fused kernel keeps one fp32 log-sum-exp per query row and head
    instead (4as b/t bytes), which selective recomputation drops with the rest of the core (its
    checkpoint keeps Q, K and V). Tensors are of
    `element` bytes (2 in bf16, the counts above; 4 when training in fp32), masks of 1. Under
    `autocast` (framework.autocast) a norm keeps the fp32 copy of its input it ran on, and the
    softmax its fp32 output beside the `element`-byte copy the context GEMM keeps (docs/equations.md 7.2).
    In `fp8` (Transformer Engine's FP8 layers) each of the four linears keeps an FP8 copy of its
    input (1 byte) instead of the input itself, and the fused attention kernel, unless recomputed,
    keeps its own `element`-byte output beside the projection's FP8 copy of it (7.2, "FP8").
    """
    s, h, a, f, kv, e = model.seq, model.hidden, model.heads, model.ffn_size, model.kv_hidden, element
    sbh = s * b * h
    mask = 1 if model.dropout else 0
    region_inputs = region_split if linear_input_split is None else linear_input_split
    inputs = split if linear_input_split is None else linear_input_split
    # norm inputs (2 x e sbh) and two dropout masks (1 byte each) in the norm region;
    # QKV and FC1 inputs (2 x e sbh, or their FP8 copies) there too, but kept by the linears
    norm = FP32 if autocast else e  # what a norm keeps of its input
    linear = np.where(np.asarray(fp8) > 0, FP8, e)  # what a linear keeps of its input: the input, or TE's FP8 copy of it
    region = (2 * norm + 2 * mask) * sbh / region_split + 2 * linear * sbh / region_inputs
    # Q and K for the scores, V for the context; the context is the projection's input. The unfused
    # core keeps K and V expanded to every query head (Megatron's repeat_interleave for kv_heads <
    # heads); the fused kernel, and selective recomputation (the core's inputs), keep kv_heads of them.
    # In FP8 the fused kernel's own output (kept for its backward) is not the projection's FP8 copy.
    q_width = model.q_width
    kept_kv = np.where(flash, kv, np.where(recompute == SELECTIVE, kv, q_width))
    core_output = e * np.asarray(fp8) * np.asarray(flash) * (recompute == NONE)
    if model.mla:
        attention = _mla_attention_bytes(model, s * b, split, region_split, region_inputs, inputs, e, norm, linear,
                                         core_output)
    else:
        sbq = s * b * q_width  # Q, the context and the projection's input: heads x head_dim wide
        attention = (e * sbq + 2 * e * s * b * kept_kv + core_output * sbq) / split + linear * sbq / inputs
    if model.qk_norm:  # each query and key head's norm keeps its input
        attention = attention + norm * s * b * (q_width + kv) / split
    # MLP internals: GeLU input, or SwiGLU's gate and up projections; FC2's input
    mlp = (2 * e if model.gated_mlp else e) * s * b * f / split + linear * s * b * f / inputs
    probabilities = FP32 + e if autocast else e  # the softmax's output (and under autocast its cast copy)
    keys = counts.mean_attention_keys(model)  # s, or fewer on sliding-window layers
    scores = (probabilities + mask * (1 + e)) * a * s * keys * b / split  # softmax output, dropout mask and output
    scores = np.where(flash, FP32 * a * s * b / split, scores)
    scores = np.where(recompute == SELECTIVE, 0, scores)  # the checkpointed core keeps its inputs alone
    kept = region + attention + mlp + gathered_weight_bytes + scores
    return np.where(recompute == FULL, e * sbh / region_split, kept)


def _mla_attention_bytes(model: ModelSpec, tokens, split, region_split, region_inputs, inputs, e, norm, linear,
                         core_output):
    """What a latent-attention block keeps for backward, as Megatron-Core's MLASelfAttention
    (multi_latent_attention.py, get_query_key_value_tensors) leaves it: the down projections share
    the layer's normed input (counted with the region's linear inputs); on the rank's tokens the
    latents' norms keep their inputs (the query latent, and the key/value latent viewed in the
    down projection's output with the rotary key) and the up projections their normed latents;
    the core keeps Q and K (qk_nope_dim + qk_rope_dim a head, the rotary key expanded to every
    head) and V (v_head_dim), and the projection its input, the context (a v_head_dim)."""
    a, (qk, v) = model.heads, counts.head_widths(model)
    q_lora, kv_lora = model.q_lora_rank, model.kv_lora_rank
    latents = norm * (q_lora + kv_lora + model.qk_rope_dim) * tokens / region_split
    latents = latents + linear * (q_lora + kv_lora) * tokens / region_inputs
    core = (e * tokens * a * (2 * qk + v) + core_output * tokens * a * v) / split
    return latents + core + linear * tokens * a * v / inputs


def layer_activation_bytes(model: ModelSpec, b, t, sp, recompute):
    """1d tensor parallelism of size t, with or without sequence parallelism."""
    return activation_bytes(model, b, t, np.where(sp, t, 1), recompute)


def layout_activation_bytes(model: ModelSpec, layout, b, recompute, flash=0, element=BF16, autocast=0, fp8=0):
    """Any tensor-parallel mode. 3d keeps X gathered over one axis ([b/q, h_in/q]) and W gathered
    ([h_in/q, h_out/q]) for backward unless it re-gathers them (tp_regather)."""
    if layout.mode != "3d":
        return activation_bytes(model, b, layout.split, layout.region_split, recompute, flash=flash, element=element,
                                autocast=autocast, fp8=fp8)
    keep = np.where((layout.regather > 0) | (layout.q == 1), 0, 1)  # one device gathers nothing
    linear_weights = sum(counts.layer_params(model)[k] for k in ("qkv", "proj", "fc1", "fc2"))
    weights = keep * element * linear_weights / layout.q**2
    inputs = np.where(keep, layout.q**2, layout.size)
    kept = activation_bytes(model, b, layout.split, layout.region_split, recompute, inputs, weights, flash, element,
                            autocast, fp8)
    return np.where(recompute == FULL, activation_bytes(model, b, layout.split, layout.region_split, recompute,
                                                        element=element, autocast=autocast), kept)


def microbatches_in_flight(c: Columns, last_stage: bool = False, stage=None):
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's whole
    layers; `stage` the stage's index (default 0, or pp - 1 for the last stage).

    GPipe: all m. 1F1B: stage i min(m, p - i) (the first p, the last one). Interleaved with v
    chunks: Megatron-Core's warm-up count plus one, (2 (p - i - 1) + (v - 1) p + 1) chunks: the
    first stage p (1 + (p-1)/(p v)) (Korthikanti), the last ((v-1) p + 1) / v = p - (p-1)/v; all m
    when m = p (every forward runs before the first backward). With chunks of unequal layers the
    peak is the most over the schedule (pipeline.peak_state; docs/equations.md 7.3).
    """
    m, p, v = c.microbatches, c.pp, c.vpp
    i = (p - 1 if last_stage else 0 * p) if stage is None else stage
    chunks = np.where(i == 0, p * (1 + (p - 1) / (p * v)),
                      np.where(i == p - 1, p - (p - 1) / v, (2 * (p - i - 1) + (v - 1) * p + 1) / v))
    interleaved = np.where(pipeline.warmup_forwards(p, i, m, v) == m * v, m, chunks)
    steady = np.where(c.schedule == INTERLEAVED, interleaved, np.minimum(m, p - i))
    return np.where(c.schedule == GPIPE, m, steady)


def stage_params(model: ModelSpec, c: Columns, stage: str):
    """Parameters one device holds for the "first", a "middle" or the "last" pipeline stage (or a
    layout's "stage i"), before ZeRO-3 sharding: its layers, and the embedding and the head (final
    norm and output layer) where it holds them. An MTP layer (layouts) is a layer, and its stage
    holds the head and the word embedding it runs unless it holds them already (9.4).

    1d shards the linears and the vocabulary t ways and replicates norms (the final one too) and
    the row-parallel biases; 2d and 2.5d shard everything, the final norm included, q^2 ways (2.5d
    replicates over its depth), 3d q^3 ways."""
    t, p = c.tp, c.pp
    pieces = counts.layer_params(model)
    h = model.hidden
    emb = counts.embedding_params(model, 1)
    if c.tp_mode == "1d":
        bias = h if model.bias else 0
        # norms (a layer's, qk norms, MLA's latent norms), the biases of the row-parallel linears,
        # and MLA's duplicated down projections
        replicated = sum(pieces.get(k, 0) for k in REPLICATED_1D) + 2 * bias
        per_layer = (sum(pieces.values()) - replicated) / t + replicated
        shard, position, final_norm = t, emb["position"], counts.norm_params(model)
    else:
        shard = weight_shard(c.tp_mode, t, c.tp_depth)
        per_layer = sum(pieces.values()) / shard
        position = emb["position"] / shard
        final_norm = counts.norm_params(model) / shard
    if model.moe:  # the routed experts split etp x ep ways, dense layers where they lie (cost/experts.py, 12.5-12.6)
        per_layer = sum(experts.layer_params_per_rank(model, c, experts.stage_share(model, c, stage)))
    mtp = pipeline.mtp_count(c, stage)
    params = per_layer * (stage_layer_count(model, c, stage) + mtp)
    word = model.padded_vocab(t) * h / shard
    first = word + position
    last = final_norm + np.where(model.tied_embeddings & (p == 1), 0, word)
    embedding, loss = pipeline.embedding_count(c, stage), pipeline.loss_count(c, stage)
    if mtp:
        embedding, loss = max(embedding, 1), max(loss, 1)
    return params + (embedding * first + loss * last)


def memory_breakdown(model: ModelSpec, system: System, c: Columns, last_stage: bool = False, second: bool = False,
                     position: str | None = None, layer: dict | None = None) -> dict:
    """Bytes by kind on one device of the first (or last) stage; `second`: the second stage, the
    middle stage with the most micro-batches in flight (1F1B: pp - 1), which an uneven split may
    give more layers than the first (docs/equations.md 9.4); `position`: any stage position
    (cost/pipeline.py: "first", "middle" for the second stage, "last", a layout's "stage i");
    `layer`: layer_bytes(model, system, c), where the caller has it."""
    # A context-parallel rank holds s/cp tokens of each of mbs sequences: the tokens of mbs/cp whole
    # sequences, and (causal load balancing) their attention scores too, so every per-token tensor
    # below is that of b = mbs/cp; ZeRO shards over the dp-cp group (docs/equations.md 11.6).
    b, t, dp, p = c.mbs / c.cp, c.tp, c.dp_cp, c.pp
    s, h = model.seq, model.hidden
    fw = system.framework
    stage = position or ("middle" if second else "last" if last_stage else "first")
    params = stage_params(model, c, stage)
    fsdp2 = (fw.zero_implementation == "fsdp2") & (c.zero >= 2) & (dp > 1)
    e = c.element  # bytes of a weight and an activation element: 2, or 4 when training in fp32
    weights = e * params / np.where(c.zero >= 3, dp, 1)
    # FSDP2's ZeRO-2 keeps the shard, the module's parameter, beside the copy gathered for the step
    weights = weights + np.where(fsdp2 & (c.zero == 2), e * params / dp, 0)
    layers = stage_layer_count(model, c, stage)
    # FP8 copies (or FP8 weights in place of the bf16 ones) and their scaling state
    weights = weights + fp8.weight_copy_bytes(model, c, layers, fw.fp8_param_gather)
    share = experts.stage_share(model, c, stage)  # the stage's MoE layers (its dense ones apart)
    if model.moe:  # FP8 copies of the experts' weights in place of the dense MLP's
        moe_linear = layers * experts.expert_linear_weights_per_rank(model, c, share)
        weights = weights + c.fp8 * (fp8.FP8_COPIES * FP8 - (fw.fp8_param_gather or 0) * e) * moe_linear
    grads = fw.grad_bytes_per_param * params / np.where(c.zero >= 2, dp, 1)
    # Gradients freed after every step (zero_grad(set_to_none=True)) and no buffer of their own (no
    # data parallelism, DDP's buckets): with one micro-batch, not yet allocated when the backward
    # starts, the peak (7.4)
    grads = np.where(bool(fw.grads_set_to_none) & (c.microbatches == 1) & (p == 1) & (dp == 1), 0.0, grads)
    # the routed experts' states shard over the expert-data-parallel group (cost/experts.py)
    expert_params = experts.stage_expert_params(model, c, stage_layer_count(model, c, stage), share)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * experts.optimizer_params(c, params, expert_params) / np.where(c.zero >= 1, dp, 1)
    first = np.asarray(pipeline.embedding_count(c, stage)) > 0  # the stage holds the embedding
    last = np.asarray(pipeline.loss_count(c, stage)) > 0  # and the head and the loss
    # the distributed optimizer's alignment padding in the parameter and gradient buffers (7.1)
    padding = stack_memory.bucket_padding_elements(fw, c, params, stack_memory.parameter_tensors(model, layers, first,
                                                                                                 last))
    weights = weights + e * padding
    grads = grads + fw.grad_bytes_per_param * padding

    layer = layer_bytes(model, system, c) if layer is None else layer
    autocast = fw.autocast
    imbalance = experts.moe_imbalance(system, model)
    moe_kept, moe_rebuilt = layer["moe_kept"], layer["moe_rebuilt"]
    if model.moe and model.dense_layers:  # the stage's own mix of MoE and dense layers
        moe_kept = experts.layer_saved_delta(model, c, e, c.fp8, imbalance, share=share)
        moe_rebuilt = experts.layer_saved_delta(model, c, e, c.fp8, imbalance, kept=False,
                                                share=np.where(share > 0, 1.0, 0.0))
    per_layer = layer["kept"] + moe_kept
    in_flight = microbatches_in_flight(c, stage=pipeline.stage_index(c, stage))
    region = layer["region"]
    activations, masks, mtp_heads = layer_activations(model, c, stage, per_layer,
                                                      s * b * h / region if model.dropout else 0.0, in_flight)
    # one layer rebuilt at a time: a MoE layer's where the stage has one
    rebuilt = layer["rebuilt"] + moe_rebuilt
    activations = activations + rebuilt + masks  # and the embedding's dropout masks
    vocab = model.padded_vocab(t)
    # final norm input (fp32 under autocast), the logits GEMM input and the fp32 softmax the loss keeps
    norm_input = (FP32 if autocast else e) * s * b * h / region
    head = norm_input + e * s * b * h / layer["split"] * np.where(c.tp_mode == "1d", t, 1) + FP32 * s * b * vocab / t
    activations = activations + np.where(last, head * np.where(c.schedule == GPIPE, c.microbatches, 1), 0)
    activations = activations + mtp_heads * head  # the MTP layers' heads (layouts), as their chunks keep them

    buffers = np.where(p > 1, 2 * e * s * b * h / t, 0)  # pipeline receive buffers
    # SP: the all-gathered input of a column-parallel linear (TE gathers its FP8 copy in FP8), while
    # its GEMM runs; with userbuffers (tp_overlap) it is gathered into one of them instead (7.5)
    gathered = np.where(np.asarray(c.fp8) > 0, FP8, e) * np.where(np.asarray(c.tp_overlap) > 0, 0, 1)
    buffers = buffers + np.where((region > 1) & (c.tp_mode == "1d"), gathered * s * b * h, 0)
    buffers = buffers + layer["ring_buffers"]
    if model.moe:  # one MoE layer's dispatch at a time (cost/experts.py), on a stage that has one
        buffers = buffers + np.where(share > 0, layer["dispatch"], 0.0)
    # selective recomputation's attention core, rebuilt for one layer's backward (7.5)
    buffers = buffers + np.where(c.recompute == SELECTIVE, layer["core"], 0)
    # the logits: alive from the logits GEMM until the loss has its fp32 copy, one micro-batch at a time
    logits = e * s * b * vocab / t
    buffers = buffers + np.where(last, logits, 0)
    shard = weight_shard(c.tp_mode, t, c.tp_depth)
    layer_weights = e * sum(counts.layer_params(model).values()) / shard
    zero3 = (c.zero >= 3) & (dp > 1)
    buffers = buffers + np.where(zero3 & ~fsdp2, 2 * layer_weights, 0)  # ZeRO-3: gathered + prefetched layer
    # FSDP2 peaks at the loss (everything above) or at a module's reduce-scatter in the last
    # micro-batch's backward, whichever holds more (docs/equations.md 6.2). At the reduce-scatter:
    # the module's unsharded gradients, their copy in the flat input, the output shard and the
    # copies the collective library makes of the input (framework.reduce_scatter_input_copies:
    # gloo clones it); the module itself resharded just before, which ZeRO-2's gathered weights
    # (counted whole above) leave out, and under ZeRO-3 the next module prefetched. What that
    # micro-batch's backward has already freed is gone: the head's tensors but the final norm's
    # input at the head's call; the head's and one layer's at the stage's last layer's; every
    # layer's at the word embedding's, the last call of the backward.
    word = e * model.padded_vocab(t) * h / shard
    copies = 0.0 if fw.reduce_scatter_input_copies is None else fw.reduce_scatter_input_copies
    head_gone = np.where(last, head + logits, 0)

    def at_reduce_scatter(module, prefetched, gone):
        scatter = fw.grad_bytes_per_param / e * module * (2 + 1 / dp + copies)
        return scatter + np.where(zero3, prefetched, -module) - gone

    holds_head = last & ~(model.tied_embeddings & (p == 1))  # tied in one stage: one module, reduced last
    calls = [np.where(holds_head, at_reduce_scatter(word, layer_weights, head_gone - norm_input), 0),
             np.where(layers > 0, at_reduce_scatter(layer_weights, layer_weights, head_gone + per_layer + rebuilt), 0),
             np.where(first, at_reduce_scatter(word, 0, head_gone + layers * per_layer + rebuilt), 0)]
    buffers = buffers + np.where(fsdp2, functools.reduce(np.maximum, calls, 0.0), 0)
    buffers = buffers + stack_memory.workspace_bytes(fw, c)  # the GEMM library's workspace (7.5)
    live = weights + grads + optimizer + activations + buffers
    # outside the caching allocator: the runtime (context, communicators) and TE's userbuffers;
    # inside it, its fragmentation over the live tensors (7.6)
    outside = fw.reserved_memory_bytes + stack_memory.userbuffer_bytes(model, c)
    buffers = buffers + outside + fw.allocator_overhead_fraction * live
    total = weights + grads + optimizer + activations + buffers
    return {"weights": weights, "gradients": grads, "optimizer": optimizer,
            "activations": activations, "buffers": buffers, "total": total}


# Columns layer_bytes does not read: a search's batch repeats each layer over them, so peak_memory
# prices each distinct layer once (columns.distinct_rows_of)
NOT_LAYER_FIELDS = ("pp", "vpp", "schedule", "zero", "first_layers", "last_layers", "gbs", "dp", "dp_overlap",
                    "tp_overlap", "ep_overlap")


def layer_bytes(model: ModelSpec, system: System, c: Columns) -> dict:
    """What memory_breakdown takes of one layer, whatever its stage: "kept", what the layer keeps
    for backward (its MoE block's "moe_kept" apart: a model with dense layers has its stage's
    mix, memory_breakdown's own); "rebuilt", what recomputation rebuilds of one layer at a time
    (likewise "moe_rebuilt" apart); "core", selective recomputation's attention core;
    "ring_buffers" and a MoE layer's "dispatch" buffers; the tensor-parallel "split" and "region"."""
    layout = layout_of(model, c)
    b, e, autocast = c.mbs / c.cp, c.element, system.framework.autocast
    imbalance = experts.moe_imbalance(system, model)
    kept = layout_activation_bytes(model, layout, b, c.recompute, c.flash, e, autocast, c.fp8) + ring_saved_bytes(model, c, e)
    # Full recomputation rebuilds one layer's activations at a time during backward.
    whole = layout_activation_bytes(model, layout, b, 0, c.flash, e, autocast, c.fp8)
    rebuilt = np.where(c.recompute == FULL, whole, 0)
    rebuilt = rebuilt + np.where(c.recompute != NONE, ring_saved_bytes(model, c, e, kept=False), 0)
    moe = model.moe and not model.dense_layers
    return {"kept": kept, "rebuilt": rebuilt,
            "moe_kept": experts.layer_saved_delta(model, c, e, c.fp8, imbalance) if moe else 0.0,
            "moe_rebuilt": experts.layer_saved_delta(model, c, e, c.fp8, imbalance, kept=False) if moe else 0.0,
            "core": whole - layout_activation_bytes(model, layout, b, SELECTIVE, c.flash, e, autocast, c.fp8),
            "ring_buffers": ring_attention_buffer_bytes(model, c),
            "dispatch": experts.dispatch_buffer_bytes(model, c, e, imbalance) if model.moe else 0.0,
            "split": layout.split, "region": layout.region_split}


def _layer_bytes_once_each(model: ModelSpec, system: System, c: Columns) -> dict:
    """layer_bytes of a batch, each distinct layer priced once and spread over the rows."""
    found = distinct_rows_of(c, NOT_LAYER_FIELDS, system=system)
    if found is None:
        return layer_bytes(model, system, c)
    u, _, inverse = found
    return {k: v[inverse] if np.ndim(v) else v for k, v in layer_bytes(model, system, u).items()}


def layer_activations(model: ModelSpec, c: Columns, stage: str, per_layer, mask, in_flight) -> tuple:
    """(bytes the layers of the stage at `stage` keep at its peak, bytes of the embedding's dropout
    masks then, MTP heads in flight then) from one layer's `per_layer` and one micro-batch's `mask`
    (docs/equations.md 7.3-7.4). Chunks of equal layers: the layers times the `in_flight` stage-loads.
    An interleaved end stage whose edge chunk holds fewer layers, and a layout's stage of unlike
    chunks (or MTP layers), peak where their chunks' loads add up to the most over the schedule
    (pipeline.peak_state); the masks are then in the load, on the embedding's chunk."""
    layers, embedding = stage_layer_count(model, c, stage), pipeline.embedding_count(c, stage)
    i = pipeline.stage_index(c, stage)
    edges = pipeline.chunk_edges(c, stage) if c.layout is not None else ()
    chunks = [n + u for n, (_, _, u) in zip(pipeline.chunk_layers(model, c, stage), edges)] if edges else []
    if len(set(chunks)) > 1 or any(u for _, _, u in edges):  # a layout's stage of unlike chunks
        load, state = pipeline.peak_state(c, i, [n * per_layer + e * mask for n, (e, _, _) in zip(chunks, edges)])
        return load, 0.0, sum(u * n for (_, _, u), n in zip(edges, state))
    masks = np.where(np.asarray(embedding) > 0, in_flight * mask, 0)
    even = layers * in_flight * per_layer
    q, edge = -(-layers // c.vpp), edge_chunk_layers(layers, c.vpp)
    uneven = (c.schedule == INTERLEAVED) & (edge != q)  # only an end stage's edge chunk can differ
    if stage == "middle" or c.layout is not None or not np.any(uneven):
        return even, masks, 0.0
    edge_load = edge * per_layer + (np.asarray(embedding) > 0) * mask
    shape = np.broadcast(uneven, even, edge_load).shape
    flat = lambda x: np.broadcast_to(x, shape).ravel()  # noqa: E731
    rows = np.flatnonzero(flat(uneven))
    exact = np.array(flat(even), dtype=float)
    exact[rows] = pipeline.edge_chunk_peak(*(flat(x)[rows] for x in (c.pp, c.vpp, c.microbatches, i, q * per_layer,
                                                                        edge_load)), 0 if stage == "first" else -1)
    return np.where(uneven, exact.reshape(shape), even), np.where(uneven, 0.0, masks), 0.0


def ring_saved_bytes(model: ModelSpec, c: Columns, element=BF16, kept=True):
    """What a layer's ring attention (cp > 1) keeps for backward beyond perfsim's flash layer: the
    key/value block its forward held last, where the backward's ring starts (Transformer Engine's
    schedule, docs/equations.md 11.6). Kept from the forward without recomputation, it takes the
    place of the rank's own K and V, which the flash layer counts and the ring does not keep (TE
    saves Q, that block, the output and the log-sum-exp): nothing more. With recomputation (`kept`
    False) the recomputed forward holds it beside its region's own K and V, for its layer's
    backward alone."""
    saved = kv_block_bytes(model, c.mbs, c.cp, c.tp, element)
    rebuilt = np.where((c.cp > 1) & (c.recompute != NONE), saved, 0.0)
    return 0 * rebuilt if kept else rebuilt


def ring_attention_buffer_bytes(model: ModelSpec, c: Columns):
    """Receive buffers of ring attention (cp > 1), at their backward peak: the key/value block a
    rank computes with and the one arriving, and likewise two blocks of their gradients; a block
    is the (s/cp) x (kv heads / tp) x head_dim keys and values of the micro-batch, in bf16."""
    return np.where(c.cp > 1, 4 * kv_block_bytes(model, c.mbs, c.cp, c.tp, c.element), 0.0)


def allocated_bytes(total, framework):
    """What the tensors of a device occupy, from memory_breakdown's `total`: less the runtime's
    reserved_memory_bytes and the allocator's slack (allocator_overhead_fraction of the tensors),
    as an allocator's allocated-bytes counter sees them."""
    return (total - framework.reserved_memory_bytes) / (1 + framework.allocator_overhead_fraction)


def peak_memory(model: ModelSpec, system: System, c: Columns, capacity=None) -> dict:
    """The stage (first or last; with an uneven split of 3 or more stages also the second; with a
    layout every stage) with the largest total; `stage` says which ("stage i" with a layout).
    `capacity` (bytes, a search's batch): the other stages are priced only for the rows the first
    leaves within it; a row over it there keeps the first stage's numbers, a lower bound of its
    peak (it does not fit either way)."""
    layer = _layer_bytes_once_each(model, system, c)  # what every stage takes of a layer
    if c.layout is not None:  # the first stage holding the most (per draw, under uncertainty)
        peak = None
        for i in range(c.layout.pp):
            pos = pipeline.position_of(c, i)
            mem = memory_breakdown(model, system, c, position=pos, layer=layer)
            use = True if peak is None else mem["total"] > peak["total"]
            peak = {k: np.where(use, mem[k], peak[k] if peak else 0) for k in mem} | {
                "stage": np.where(use, pos, peak["stage"] if peak else pos)}
        return peak
    first = memory_breakdown(model, system, c, last_stage=False, layer=layer)
    rows = None  # the rows still to price: all
    if capacity is not None and np.ndim(capacity) == 0 and np.ndim(c.tp) == 1 and np.ndim(first["total"]) == 1:
        rows = np.flatnonzero(first["total"] <= capacity)
        rows = None if len(rows) == len(first["total"]) else rows
    last = _breakdown_at(model, system, c, rows, layer, first, last_stage=True)
    use_last = last["total"] > first["total"]
    peak = {k: np.where(use_last, last[k], first[k]) for k in first}
    peak["stage"] = np.where(use_last, "last", "first")
    uneven = (c.pp > 2) & ((c.first_layers > 0) | (c.last_layers > 0))
    if np.any(uneven):
        second = _breakdown_at(model, system, c, rows, layer, first, second=True)
        use_second = uneven & (second["total"] > peak["total"])
        peak = {k: np.where(use_second, second[k], v) for k, v in peak.items() if k != "stage"} | {
            "stage": np.where(use_second, "second", peak["stage"])}
    return peak


def _breakdown_at(model: ModelSpec, system: System, c: Columns, rows, layer: dict, fill: dict, **stage) -> dict:
    """memory_breakdown of a stage at the rows `rows` of a batch (every row where None), `fill`'s
    numbers at the others."""
    if rows is None:
        return memory_breakdown(model, system, c, layer=layer, **stage)
    out = {k: np.array(np.broadcast_to(v, np.shape(c.tp)), dtype=float) for k, v in fill.items()}
    if len(rows):
        some = memory_breakdown(model, system, rows_of(c, rows), layer={k: v[rows] if np.ndim(v) else v
                                                                         for k, v in layer.items()}, **stage)
        for k, v in some.items():
            out[k][rows] = v
    return out
