"""Correctness and exactness of real expert-parallel training steps (validate.moe), per rank.

Run as ranks (`python -m validate.moe_check OUT.json --cases all`, launched by
validate.launcher.launch_ranks; gloo, fp32). For every case (EP over `ep` of `dp` data-parallel
ranks, a dispatcher and a routing) each rank builds the same seeded GPT with experts, trains a
single-process reference (every expert, ep = 1) on the whole global batch, each data-parallel
rank's micro-batches in turn, and runs the same step with validate.moe.ExpertParallelStep,
recording:

- loss and gradients (after the reductions, before the optimizer step) against the reference:
  the dense ones whole, this rank's experts against the reference's experts of the same global
  index;
- matrix FLOPs it ran (LocalFlopCounter) and bytes it sent per collective kind (CollectiveCounter:
  the all-to-alls, the gradient all-reduces) against `hand_count`, the harness's own count written
  out from the shapes (module doc of validate.moe), and against perfsim's where perfsim prices
  experts (`perfsim_count`: perfsim.predict and perfsim.cost.experts), with `named_differences`,
  what the harness runs as Megatron-Core does and perfsim prices otherwise, each by its formula;
- the bytes one MoE layer keeps for backward (SavedBytes around that layer's forward alone) against
  the hand count.

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import dataclasses

from perfsim.spec.model import load_model

MODEL = ("layers=3,hidden=32,heads=4,kv_heads=2,ffn=64,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=16,vocab=256,"
         "experts=8,topk=2,expert_ffn=16,shared_expert_ffn=32,dense_layers=1")
MBS, MICROBATCHES = 2, 2
SYSTEM = "cpu-example"

CASES = {
    2: ["ep2-dp2", "ep2-dp2-topk", "ep2-dp2-allgather", "ep1-dp2", "ep2-dp2-full", "ep2-tp2", "ep1-tp2",
        "ep1-tp2-etp2"],
    4: ["ep4-dp4", "ep2-dp4", "ep4-dp4-topk"],
}


@dataclasses.dataclass(frozen=True)
class CasePlan:
    """The plan fields an expert-parallel step reads (perfsim's Plan where it has `ep`)."""
    dp: int
    ep: int
    moe_dispatcher: str = "alltoall"
    mbs: int = MBS
    gbs: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    etp: int = 1
    sp: bool = False
    zero: int = 0
    recompute: str = "none"
    attention: str = "unfused"

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def devices(self) -> int:
        return self.tp * self.dp


def case_plan(name: str):
    """"ep2-dp4", "ep2-dp2-allgather", "ep4-dp4-topk" (routing is the case's, not the plan's),
    "ep2-dp2-full" (full recomputation: the layer's forward, all-to-alls included, again in backward),
    "ep2-tp2" (1d + SP, experts not tensor-parallel: the attention's ranks folded into EP),
    "ep1-tp2-etp2" (the experts tensor-parallel over the attention's ranks, Megatron-Core's default)."""
    fields = {"moe_dispatcher": "allgather" if name.endswith("allgather") else "alltoall",
              "recompute": "full" if name.endswith("full") else "none", "dp": 1}
    for part in name.split("-"):
        if part[:2] in ("ep", "dp", "tp"):
            fields[part[:2]] = int(part[2:])
        elif part.startswith("etp"):
            fields["etp"] = int(part[3:])
    if fields.get("tp", 1) > 1:
        fields.setdefault("etp", 1)
        fields["sp"] = True
    fields["gbs"] = MBS * MICROBATCHES * fields["dp"]
    from perfsim.spec.plan import Plan

    if "ep" in Plan.__dataclass_fields__:
        return Plan(**{k: v for k, v in fields.items()}, mbs=MBS)
    return CasePlan(**fields)


def case_routing(name: str) -> str:
    return "topk" if name.endswith("topk") else "balanced"


def gemm_forward_flops(model, tokens: int, received: int, moe: bool, tp: int = 1) -> int:
    """Forward matrix FLOPs of one layer on `tokens` tokens on one of `tp` tensor-parallel ranks
    (1d: the attention's and the dense or shared MLP's columns / tp; the unfused core: baddbmm and
    bmm over the full s x s square of heads / tp), its router on the rank's tokens / tp (its
    sequence shard) and its experts on `received` token copies."""
    h, a, s = model.hidden, model.heads, model.seq
    d = h // a
    kv = model.kv_head_count * d
    f = (2 * tokens * h * (h + 2 * kv) + 2 * tokens * h * h) // tp  # QKV, projection
    f += 2 * 2 * (tokens // s) * (a // tp) * s * s * d  # QK^T and AV
    glu = 2 if model.activation == "swiglu" else 1
    if not moe:
        return f + (2 * tokens * h * glu * model.ffn_size + 2 * tokens * model.ffn_size * h) // tp
    f += 2 * (tokens // tp) * h * model.experts  # router
    f += 2 * received * h * glu * model.expert_ffn + 2 * received * model.expert_ffn * h
    if model.shared_expert_ffn:
        f += (2 * tokens * h * glu * model.shared_expert_ffn + 2 * tokens * model.shared_expert_ffn * h) // tp
    return f


def hand_count(model, plan, element_bytes: int, dense_params: int, expert_params: int) -> dict:
    """What one rank of a balanced step does, from the shapes alone (validate.moe's module doc):
    FLOPs (backward twice forward: every GEMM's input and weight gradients; full recomputation the
    layers' forward once more), bytes sent in the all-to-alls (dispatch of tokens and
    probabilities, combine; the same again backward, and forward again under full recomputation), the
    gradient all-reduces (dense over dp, experts over dp / ep), and what one MoE layer keeps."""
    ep, t, k, tp = plan.ep, plan.mbs * model.seq, model.topk, plan.tp
    etp = plan.etp or tp
    received = t // tp * k  # balanced: every rank gets T k / (tp ep) copies from each of ep ranks' shards
    moe_layers = model.layers - model.dense_layers
    layer_fwd = (model.dense_layers * gemm_forward_flops(model, t, received, False, tp)
                 + moe_layers * gemm_forward_flops(model, t, received, True, tp)
                 + 2 * t * model.hidden * model.vocab // tp)  # the head (a 128 x tp multiple vocabulary: unpadded)
    passes = 3 if plan.recompute != "full" else 4  # full recomputation: every layer's forward again
    # (the head's not: checkpointed are the transformer layers)
    flops = (passes * layer_fwd - (passes - 3) * 2 * t * model.hidden * model.vocab // tp) * plan.microbatches
    sent = received * (ep - 1) // ep  # token copies a rank sends to the others in one all-to-all
    h = model.hidden
    bytes_a2a = 0 if ep == 1 or plan.moe_dispatcher != "alltoall" else \
        (passes - 1) * (2 * sent * h + sent) * element_bytes * moe_layers * plan.microbatches
    edp = plan.dp * tp // ep
    # tensor parallelism: its all-reduces (sequence-parallel gradients, the vocabulary-parallel
    # loss) are tests/test_validate_gpt.py's; not counted here
    reduce = None if tp > 1 else \
        (2 * (plan.dp - 1) / plan.dp * dense_params + 2 * (edp - 1) / edp * expert_params) * element_bytes
    glu = 2 if model.activation == "swiglu" else 1
    f, fs = model.expert_ffn, model.shared_expert_ffn
    # the shared expert's FC1 input is the router's, or under SP the sequence its column-parallel
    # FC1 gathers (DTensor keeps the gathered copy)
    shared = (t * (glu * fs + fs) // tp + (t * h if tp > 1 else 0)) if fs else 0
    # the experts compute the copies of their ETP group's members (gathered), on f / etp columns each
    rows, fe = etp * received, f // etp
    saved = (t // tp * h + t // tp * k  # router input (the layer's input), the top-k softmax (fp32 here as the run)
             + rows * (h + glu * fe + 1 + fe)  # FC1 input, SwiGLU input, probability, FC2 input
             + shared) * element_bytes
    return {"flops": flops, "all_to_all_bytes": bytes_a2a, "all_reduce_bytes": reduce, "moe_layer_saved_bytes": saved}


def perfsim_count(model, plan, element_bytes: int) -> dict | None:
    """perfsim's figures for one rank of the plan, where perfsim prices experts (else None): the
    step's FLOPs (hardware, over the ranks), the bytes its all-to-alls send (dispatch and combine,
    forward and backward and the recomputed forward, every MoE layer and micro-batch, the
    probabilities' beside the tokens; perfsim.cost.traffic.ep_all_to_all_bytes)
    and what one MoE layer keeps (perfsim.cost.experts.saved_activation_bytes), at `element_bytes`
    an element as the run."""
    try:
        from perfsim.cost import experts
    except ImportError:
        return None
    from perfsim.cost.columns import columns_of
    from perfsim.cost.traffic import ep_all_to_all_bytes
    from perfsim.predict import predict
    from perfsim.spec.system import load_system

    c = columns_of(plan)
    layers = model.layers - model.dense_layers
    sent = ep_all_to_all_bytes(model, plan, element_bytes)  # one layer, micro-batch and pass
    return {"flops": predict(model, load_system(SYSTEM), plan, "fp32").hardware_flops_per_step / plan.devices,
            "all_to_all_bytes": directions(plan) * sent * layers * plan.microbatches,
            "moe_layer_saved_bytes": float(experts.saved_activation_bytes(model, c, element=element_bytes))}


def named_differences(model, plan, element_bytes: int) -> dict:
    """What the harness (Megatron-Core as of 0.13, 2025) does that perfsim.cost.experts prices
    otherwise, each by its formula, harness less perfsim, for one rank of a balanced step:

    - all_to_all_bytes: none. (The routing probabilities ride an all-to-all of their own beside
      the tokens, MoEAlltoAllTokenDispatcher.token_dispatch's global_probs, the copies sent x an
      element each pass; perfsim prices it too, perfsim.cost.traffic.ep_all_to_all_bytes.)
    - moe_layer_saved_bytes (one layer's forward alone): + the router's input (perfsim counts it
      in the dense region, as the norm's output); + the top-k softmax's fp32 output [T, k] (the
      harness's softmax runs over the k chosen logits, moe_router_pre_softmax off, and no
      auxiliary loss); + the probability of each copy kept by the weighted SwiGLU (since
      Megatron-Core 0.13's memory-efficient permutation the probabilities are applied in the
      experts' activation); - perfsim's fp32 probabilities over every expert [T, E]; - its fp32
      top-k scores and int64 indices per copy (the harness keeps the indices, integer storages
      SavedBytes counts apart); - its experts' outputs kept for the unpermutation's weighting by
      the probabilities (Megatron-Core before 0.13); under SP (tp > 1) + the sequence the shared
      expert's column-parallel FC1 gathers, which DTensor keeps and Megatron-Core gathers again in
      backward (the GPT's named SP difference, docs/real-steps.md "SP keeps the gathered linear
      inputs")."""
    e, h, k = element_bytes, model.hidden, model.topk
    t = plan.mbs * model.seq // plan.tp  # the rank's tokens: its sequence shard under SP
    copies = t * k  # sent by a rank, and (balanced) received by its local experts
    computed = (plan.etp or plan.tp) * copies  # with its ETP group's members' gathered
    saved = t * h * e + 4 * t * k + e * computed - 4 * t * model.experts - (4 + 8) * copies - e * h * computed
    if plan.tp > 1 and model.shared_expert_ffn:  # SP's gathered input of the shared expert's FC1
        saved += plan.mbs * model.seq * h * e
    return {"all_to_all_bytes": 0, "moe_layer_saved_bytes": saved}


def directions(plan) -> int:
    """Passes a layer's dispatch and combine run per micro-batch: forward and backward, and the
    forward again under full recomputation (perfsim.cost.stage: "the recomputed forward
    dispatches again")."""
    return 2 + (plan.recompute == "full")


def run_case(torch, dist, model_spec: str, name: str) -> dict:
    from validate.gpt import GPT, GPTConfig
    from validate.instrument import CollectiveCounter, LocalFlopCounter, OpCounter, SavedBytes
    from validate.expert_parallel import ExpertParallelStep
    from validate.moe import is_expert_parameter, moe_layers
    from validate.training import synthetic_batches

    model = load_model(model_spec)
    plan = case_plan(name)
    rank = dist.get_rank()
    cfg = dataclasses.replace(GPTConfig.from_spec(model, plan.tp, plan.recompute, plan.attention),
                              routing=case_routing(name))
    torch.manual_seed(0)
    reference = GPT(cfg)
    step = ExpertParallelStep(plan, model, torch.device("cpu"), torch.float32, reference=reference)

    # the reference: every data-parallel rank's micro-batches in turn, each loss over m dp
    rows = plan.microbatches * plan.mbs
    tokens, targets = synthetic_batches(plan.dp * rows, model.seq, model.vocab)
    ref_loss = 0.0
    for x, y in zip(tokens.split(plan.mbs), targets.split(plan.mbs)):
        loss = reference.loss(x, y) / (plan.microbatches * plan.dp)
        loss.backward()
        ref_loss += float(loss.detach())

    flops, comms = LocalFlopCounter(), CollectiveCounter()
    with flops, comms:
        loss = step.forward_backward()
        step.finish_gradients()
    every_loss = torch.tensor([loss])
    dist.all_reduce(every_loss)
    ref_grads = dict(reference.named_parameters())
    ep_rank, local = (rank // step.etp) % step.ep, model.experts // step.ep
    etp_rank = rank % step.etp
    worst, largest = 0.0, 0.0
    for n, p in step.module.named_parameters():
        ref_name = n
        if is_expert_parameter(n):
            parts = n.split(".")
            i = parts.index("experts") + 1
            parts[i] = str(ep_rank * local + int(parts[i]))
            ref_name = ".".join(parts)
        ref = ref_grads[ref_name].grad
        if is_expert_parameter(n) and step.etp > 1:  # this member's columns of FC1, rows of FC2's input
            ref = (ref.chunk(step.etp, 0) if ".fc1." in n else ref.chunk(step.etp, 1))[etp_rank]
        mine = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a tensor-parallel shard: whole
        worst = max(worst, float((mine - ref).abs().max()))
        largest = max(largest, float(ref.abs().max()))

    # what one MoE layer keeps for backward, its forward alone on this rank's first micro-batch
    layer = moe_layers(step.module)[0]
    leaf = torch.randn(plan.mbs, model.seq // plan.tp, model.hidden, generator=torch.Generator().manual_seed(rank),
                       requires_grad=True)  # the rank's sequence shard under SP
    x = leaf * 1.0  # an activation, as the norm's output (SavedBytes skips leaves as parameters)
    kept = SavedBytes(step.module.parameters())
    with kept.hooks():
        out = layer(x)
    (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    # the ops that layer dispatches forward and backward (perfsim.cost.host.harness_moe_ops)
    ops = OpCounter()
    with ops:
        out = layer(leaf * 1.0)
        (out.to_local() if hasattr(out, "to_local") else out).sum().backward()

    dense = sum(p.numel() for n, p in step.module.named_parameters() if not is_expert_parameter(n))
    expert = sum(p.numel() for n, p in step.module.named_parameters() if is_expert_parameter(n))
    sent = comms.by_kind()
    balanced = case_routing(name) == "balanced"
    return {"rank": rank, "loss": float(every_loss) / dist.get_world_size(), "reference_loss": ref_loss,
            "grad_max_abs_error": worst, "grad_max_abs": largest,
            "flops": flops.total(), "sent_bytes_by_kind": sent,
            "moe_layer_saved_bytes": kept.peak, "moe_layer_ops": ops.ops,
            "hand": hand_count(model, plan, 4, dense, expert) if balanced else None,
            "perfsim": perfsim_count(model, plan, 4) if balanced else None,
            "named_differences": named_differences(model, plan, 4) if balanced else None}


def main(argv=None) -> int:
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.moe_check", MODEL, "comma list of case names (CASES), or all")
    parser.add_argument("--broken-backward", dest="broken_backward", action="store_true",
                        help="test hook: the all-to-all's backward hands the gradient back unsent (a wrong backward "
                             "the gradient checks must catch)")
    args = parser.parse_args(argv)
    if args.broken_backward:
        from validate import moe

        moe.AllToAll.backward = staticmethod(lambda ctx, grad: (grad, None, None, None))

    import torch
    import torch.distributed as dist

    with gloo_ranks(args.timeout) as ranks:
        names = CASES.get(ranks.world, []) if args.cases == "all" else args.cases.split(",")
        results = []
        for name in names:
            plan = case_plan(name)
            if plan.devices != ranks.world:
                raise ValueError(f"case {name} needs {plan.devices} ranks, not {ranks.world}")
            results.append({"case": name, "plan": dataclasses.asdict(plan), "routing": case_routing(name),
                            "ranks": every_rank(run_case(torch, dist, args.model, name))})
        write_on_rank0(ranks, args.out, model=args.model, cases=results)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
