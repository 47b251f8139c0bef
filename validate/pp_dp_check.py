"""Correctness and exactness of real pipeline-parallel and data-parallel training steps, per rank.

Run as ranks (`python -m validate.pp_dp_check OUT.json --cases all`, launched by
validate.launcher.launch_ranks). For every case (a Plan with pp, vpp, schedule, dp, zero and
recompute; tp = 1) each rank builds the same seeded GPT, trains a single-process reference on the
whole global batch with gradient accumulation over its micro-batches and one MasterAdam step, and
runs the same step with validate.pipeline / validate.sharded_dp, recording:

- loss, gradients (before the step) and updated parameters (after it) against the reference;
- matrix FLOPs it ran (LocalFlopCounter) against perfsim's for its stage and micro-batch count;
- bytes sent per collective kind and dimension (CollectiveCounter) against perfsim's volumes,
  with torch's differences from perfsim's (DeepSpeed's) algorithms computed beside them;
- parameter, gradient and optimizer-state bytes it holds against perfsim.cost.memory;
- the peak of bytes saved for backward (saved_tensors_hooks) against perfsim's activations;
- once per run, the copies of its input gloo allocates in a reduce-scatter, against the profile's
  framework.reduce_scatter_input_copies.

Prices (the run is fp32, perfsim's model bf16 with `G` gradient bytes): activations, pipeline
messages, weights and weight gathers/broadcasts are re-priced at 2 bytes an element; gradients and
their reductions stay at 4 bytes, perfsim's G in the profile used here (hwprofiles/cpu-example:
grad_bytes_per_param = 4, "CPU validation runs train in fp32"), which is also Megatron's fp32
gradient accumulation; the loss's softmax is fp32 in perfsim and here. docs/real-steps-pipeline-dp.md
gives every convention and the observed numbers.

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import copy
import math

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.counts import ATTENTION_CORE
from perfsim.cost.layer import BF16
from perfsim.cost.memory import OPTIMIZER_BYTES_PER_PARAM, memory_breakdown, microbatches_in_flight, stage_params
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

MODEL = "layers=4,hidden=32,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false"
SYSTEM = "cpu-example"  # framework.grad_bytes_per_param = 4: the fp32 gradients this run holds
MBS, MICROBATCHES = 2, 4
LR, EPS = 1e-2, 1e-4  # Adam's first step is lr g / (|g| + eps): eps bounds its sensitivity to g


def case_plan(name: str) -> Plan:
    """"gpipe-pp2", "1f1b-pp4", "interleaved-pp2-vpp2", "zero3-dp2", "1f1b-pp2-dp2", "...-full"."""
    parts = name.split("-")
    recompute = "full" if parts[-1] == "full" else "none"
    fields = dict(pp=1, vpp=1, dp=1, zero=0, schedule="1f1b")
    for part in parts:
        if part in ("gpipe", "1f1b", "interleaved"):
            fields["schedule"] = part
        elif part.startswith("zero"):
            fields["zero"] = int(part[4:])
        elif part[:2] in ("pp", "dp") or part.startswith("vpp"):
            key = "vpp" if part.startswith("vpp") else part[:2]
            fields[key] = int(part[len(key):])
    return Plan(mbs=MBS, gbs=MBS * MICROBATCHES * fields["dp"], recompute=recompute, **fields)


CASES = {
    2: ["gpipe-pp2", "1f1b-pp2", "interleaved-pp2-vpp2", "1f1b-pp2-full",
        "zero0-dp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "zero3-dp2-full"],
    4: ["gpipe-pp4", "1f1b-pp4", "zero0-dp4", "zero1-dp4", "zero2-dp4", "zero3-dp4", "1f1b-pp2-dp2"],
}


def gemm_flops(g) -> float:
    return 2 * g.count * g.m * g.n * g.k


def perfsim_flops(model, plan: Plan, layers: int, head: bool) -> float:
    """Matrix FLOPs of `plan.microbatches` forward + backward passes through `layers` layers (and
    the head), recomputation as perfsim.cost.counts defines it."""
    layout = tpc.layout_of(model, columns_of(plan))
    gemms = tpc.layer_gemms(layout, model, plan.mbs)
    layer = sum(gemm_flops(g) for g in gemms)
    head_flops = gemm_flops(tpc.head_gemm(layout, model, plan.mbs, model.padded_vocab(1))) if head else 0.0
    recompute = {"none": 0, "full": layer, "selective": sum(gemm_flops(g) for g in gemms if g.name in ATTENTION_CORE)}
    return float(plan.microbatches * (3 * (layers * layer + head_flops) + layers * recompute[plan.recompute]))


def stage_kind(first: bool, last: bool, pp: int) -> str:
    return "first" if first or pp == 1 else ("last" if last else "middle")


def perfsim_memory(model, plan: Plan, kind: str) -> dict:
    """perfsim's weights, gradients and optimizer bytes for a device of the stage `kind`, and its
    activations (memory_breakdown computes only the first and the last stage)."""
    c, system = columns_of(plan), load_system(SYSTEM)
    params = float(stage_params(model, c, kind))
    if kind == "middle":
        dp = plan.dp
        shard_too = plan.zero == 2 and dp > 1 and system.framework.zero_implementation == "fsdp2"
        return {"params": params, "weights": BF16 * params / (dp if plan.zero >= 3 else 1) + shard_too * BF16 * params / dp,
                "gradients": system.framework.grad_bytes_per_param * params / (dp if plan.zero >= 2 else 1),
                "optimizer": OPTIMIZER_BYTES_PER_PARAM * params / (dp if plan.zero >= 1 else 1), "activations": None}
    mem = memory_breakdown(model, system, c, last_stage=kind == "last")
    out = {k: float(mem[k]) for k in ("weights", "gradients", "optimizer", "activations")}
    out["params"] = params
    out["in_flight"] = float(microbatches_in_flight(c, kind == "last"))
    return out


def perfsim_pp_bytes(model, plan: Plan) -> float:
    """perfsim's pipeline traffic of one device per step (stage_costs: 2 v hops of the bf16
    activation [mbs, seq, hidden] / t per micro-batch, on every stage)."""
    if plan.pp == 1:
        return 0.0
    return float(plan.microbatches * 2 * plan.vpp * BF16 * plan.mbs * model.seq * model.hidden / plan.tp)


def perfsim_dp_bytes(model, plan: Plan, params: float) -> tuple[dict, dict]:
    """(perfsim's bytes sent per kind per step by one data-parallel member, what torch's
    implementation sends by the same prices), docs/equations.md section 6.1.

    torch differs in ZeRO-1 (ZeroRedundancyOptimizer behind DDP): it all-reduces the gradients
    instead of reduce-scattering them, and broadcasts each owner's updated parameters instead
    of all-gathering the shards (the same bytes as the gather). ZeRO-2 and 3 are FSDP2's, which
    the profile names (framework.zero_implementation = "fsdp2": ZeRO-3 gathers twice per
    micro-batch, also under full recomputation)."""
    from perfsim.cost.traffic import dp_sent_by_kind

    d = plan.dp
    if d == 1:
        return {}, {}
    perfsim = {k: float(v) for k, v in dp_sent_by_kind(load_system(SYSTEM), plan, params).items()}
    G = load_system(SYSTEM).framework.grad_bytes_per_param
    ar = float(tpc.sent_bytes(tpc.ALL_REDUCE, G * params, d))
    torch_sends = dict(perfsim)  # ZeRO-0, 2 and 3 send what perfsim says
    if plan.zero == 1:  # DDP's all-reduce, then the owners' broadcasts (the all-gather's bytes)
        torch_sends = {"all_reduce": ar, "broadcast": perfsim["all_gather"]}
    return perfsim, torch_sends


def reference_step(torch, gpt, tokens, targets, mbs: int):
    """Gradient accumulation over all micro-batches of the global batch in one process, then one
    MasterAdam step: (loss, gradients by name, updated parameters by name)."""
    from validate.optim import MasterAdam
    from validate.pipeline import token_loss

    chunks = list(zip(tokens.split(mbs), targets.split(mbs)))
    total = 0.0
    for x, y in chunks:
        loss = token_loss(gpt(x), y) / len(chunks)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in gpt.named_parameters()}
    opt = MasterAdam(gpt.parameters(), lr=LR, eps=EPS)
    opt.step()
    return total, grads, {n: p.detach().clone() for n, p in gpt.named_parameters()}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_numel(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def groups(dist, pp: int, dp: int, rank: int):
    """(pipeline group, data-parallel group, pipeline rank, data-parallel rank) for the order
    tp-dp-pp: data innermost, pipeline outermost (rank = pipeline rank x dp + data rank)."""
    pp_groups = [dist.new_group([j + k * dp for k in range(pp)]) for j in range(dp)] if dp > 1 and pp > 1 else None
    dp_groups = [dist.new_group([k * dp + j for j in range(dp)]) for k in range(pp)] if dp > 1 and pp > 1 else None
    pp_rank, dp_rank = rank // dp, rank % dp
    if pp_groups is None:
        return None, None, pp_rank, dp_rank
    return pp_groups[dp_rank], dp_groups[pp_rank], pp_rank, dp_rank


def run_case(torch, dist, model, name: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from validate.gpt import GPT, GPTConfig
    from validate.instrument import RECV, SEND, CollectiveCounter, LocalFlopCounter, SavedBytes
    from validate.pipeline import Pipeline, token_loss
    from validate.sharded_dp import DataParallel
    from validate.training import synthetic_batches

    plan = case_plan(name)
    cfg = GPTConfig.from_spec(model, 1, plan.recompute)
    m, mbs = plan.microbatches, plan.mbs
    torch.manual_seed(0)
    init = GPT(cfg)
    reference = copy.deepcopy(init)
    tokens, targets = synthetic_batches(plan.dp * m * mbs, cfg.seq, model.vocab)
    ref_loss, ref_grads, ref_params = reference_step(torch, reference, tokens, targets, mbs)

    pp_group, dp_group, pp_rank, dp_rank = groups(dist, plan.pp, plan.dp, dist.get_rank())
    rows = slice(dp_rank * m * mbs, (dp_rank + 1) * m * mbs)
    mine_x, mine_y = tokens[rows], targets[rows]
    flops, comms = LocalFlopCounter(), CollectiveCounter()
    unsharded = []
    from validate.optim import MasterAdam

    if plan.pp > 1:
        wrap = (lambda mod: DDP(mod, process_group=dp_group)) if plan.dp > 1 else None
        meter_box = {}
        loss_fn = lambda out, y: meter_box["meter"].loss_scope(token_loss)(out, y)  # noqa: E731
        pipe = Pipeline(init, plan.pp, plan.vpp, plan.schedule, m, mbs, pp_rank, group=pp_group, wrap=wrap,
                        loss_fn=loss_fn)
        named = dict(pipe.named_parameters())
        adam = optimizer = MasterAdam(list(named.values()), lr=LR, eps=EPS)
        adam.init_states()
        meter = meter_box["meter"] = SavedBytes(named.values(), element_bytes=BF16)
        first, last = pipe.has_first, pipe.has_last
        layers = sum(len(mod.layer_ids) for mod in pipe.modules)
        with flops, comms, meter.hooks():
            loss = pipe.step(mine_x, mine_y)
    else:
        dp = DataParallel(init, plan.zero, group=dp_group, lr=LR, eps=EPS)
        adam, optimizer = dp.adam, dp.optimizer
        dp.on_forward = lambda i: unsharded.append(
            sum(p.numel() for p in dp.module.parameters() if not hasattr(p, "to_local"))) if i == 0 else None
        meter = None  # activations are checked on the pipeline cases only
        first = last = True
        layers = cfg.layers
        with flops, comms:
            loss = dp.forward_backward(mine_x, mine_y, m)
        named = dict(dp.named_parameters())

    # what the rank holds between backward and the optimizer step
    params_local = sum(local_numel(p) for p in named.values())
    grads_bytes = sum(local_numel(p.grad) * p.grad.element_size() for p in named.values() if p.grad is not None)
    optimizer_bytes = adam.state_bytes()
    grad_err, grad_scale = 0.0, 0.0
    for n, p in named.items():
        grad_err = max(grad_err, float((full(p.grad) - ref_grads[n]).abs().max()))
        grad_scale = max(grad_scale, float(ref_grads[n].abs().max()))
    with comms:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    param_err = max(float((full(p.detach()) - ref_params[n]).abs().max()) for n, p in named.items())
    moved = max(float((ref_params[n] - q.detach()).abs().max()) for n, q in init.named_parameters())

    kind = stage_kind(first, last, plan.pp)
    expected = perfsim_memory(model, plan, kind)
    dp_perfsim, dp_torch = perfsim_dp_bytes(model, plan, expected["params"])

    activation = mbs * cfg.seq * cfg.hidden
    pp_sent = {"activations": 0.0, "control": 0.0}
    pp_recv = {"activations": 0.0, "control": 0.0}
    dp_asked, dp_priced = {}, {}
    for r in comms.records:
        if r.kind in (SEND, RECV):
            into = pp_sent if r.kind == SEND else pp_recv
            if r.elements == activation:
                into["activations"] += r.elements * BF16
            else:
                into["control"] += r.nbytes
            continue
        grads_kind = r.kind in ("all_reduce", "reduce_scatter")
        priced = r.sent_bytes() * (1 if grads_kind else BF16 / r.element_bytes)
        dp_priced[r.kind] = dp_priced.get(r.kind, 0.0) + priced
        dp_asked[r.kind] = dp_asked.get(r.kind, 0.0) + r.sent_bytes()
    edge_hops = (1 if first else 0) + (1 if last else 0)
    pp_perfsim = perfsim_pp_bytes(model, plan)
    pp_torch = pp_perfsim - edge_hops * m * BF16 * activation if plan.pp > 1 else 0.0

    return {
        "rank": dist.get_rank(), "pp_rank": pp_rank, "dp_rank": dp_rank, "stage": kind, "layers": layers,
        "loss": loss, "reference_loss": ref_loss,
        "grad_max_abs_error": grad_err, "grad_max_abs": grad_scale,
        "param_max_abs_error": param_err, "param_max_abs_update": moved,
        "flops": {"counted": float(flops.total()), "perfsim": perfsim_flops(model, plan, layers, last)},
        "pp_bytes": {"sent": pp_sent, "received": pp_recv, "perfsim": pp_perfsim, "torch_expected": pp_torch},
        "dp_bytes": {"counted": dp_priced, "as_asked_fp32": dp_asked, "perfsim": dp_perfsim, "torch_expected": dp_torch,
                     "gloo_wire_fp32": comms.gloo_wire_by_kind()},
        "memory": {"counted": {"params": params_local, "weights": BF16 * params_local, "gradients": grads_bytes,
                               "optimizer": optimizer_bytes,
                               "unsharded_params_in_step": unsharded[0] if unsharded else None},
                   "perfsim": expected},
        "activations": {"counted": meter.peak if meter else None,
                        "non_float": meter.peak_other if meter else None,
                        "perfsim": expected.get("activations")},
    }


def reduce_scatter_copies(torch, dist, world: int) -> float:
    """Copies of its input the collective library makes in a reduce-scatter (perfsim's
    framework.reduce_scatter_input_copies, alive at FSDP2's peak): the allocator's peak over one
    call, the output allocated before it, in input sizes."""
    from validate.device import Device

    shard = 2 ** 18  # 1 MiB of fp32 per rank
    inp, out = torch.ones(world * shard), torch.empty(shard)
    dist.reduce_scatter_tensor(out, inp)  # the first call sets gloo up
    with Device("cpu").allocation_peak() as peak:
        dist.reduce_scatter_tensor(out, inp)
    return peak.bytes / (inp.numel() * inp.element_size())


def main(argv=None) -> int:
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.pp_dp_check", MODEL,
                          "comma list of case names (CASES), or all for the world size")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    with gloo_ranks(args.timeout) as ranks:
        model = load_model(args.model)
        names = CASES.get(ranks.world, []) if args.cases == "all" else args.cases.split(",")
        results = []
        for name in names:
            if case_plan(name).devices != ranks.world:
                raise ValueError(f"case {name} needs {case_plan(name).devices} ranks, not {ranks.world}")
            everyone = every_rank(run_case(torch, dist, model, name))
            losses = [r["loss"] for r in everyone if not math.isnan(r["loss"])]
            results.append({"case": name, "plan": case_plan(name).as_dict(), "loss": sum(losses) / len(losses),
                            "ranks": everyone})
        copies = every_rank(reduce_scatter_copies(torch, dist, ranks.world))
        write_on_rank0(ranks, args.out, model=args.model, system=SYSTEM, cases=results, reduce_scatter_input_copies=copies)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
