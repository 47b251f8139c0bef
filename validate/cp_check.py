"""Exactness of context-parallel training steps (validate.context_parallel), per rank.

Run as ranks (`python -m validate.cp_check OUT.json --model SPEC --mbs B`, launched by
validate.launcher.launch_ranks; the cases whose tp x cp x dp is the world size run). For every
case each rank builds the same seeded GPT with flash attention, keeps it unsharded as the
single-process reference (the whole batch, every token), shards a copy over tp (1d), gives it this
rank's s/cp tokens of its data-parallel rows and runs its attention as ring attention over cp;
one forward and backward, then the gradients summed over the dp x cp ranks. Each rank records:

- loss (the mean over the dp x cp ranks of their mean losses) and gradients (gathered to full
  tensors) against the reference;
- matrix FLOPs it ran (validate.instrument.LocalFlopCounter) and the block products the ring
  skipped above the causal diagonal (validate.context_parallel.skipped_blocks): together the full
  square perfsim counts, against perfsim's hardware FLOPs per device;
- bytes it sent: the ring's point-to-point sends, the tensor-parallel collectives and the gradient
  all-reduce, against perfsim.cost.traffic.step_sent_bytes per device ("cp", "tp", "dp");
- what its forward saved for backward (validate.tp_check.SavedTensorCounter), priced as perfsim
  prices it, against perfsim's flash activation bytes at s/cp tokens.

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import copy

from perfsim.cost.layer import BF16, FP32
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

MODEL = "layers=2,hidden=64,heads=4,seq=32,vocab=128,tied_embeddings=false,dropout=false"
# name: (tp, cp, dp, recompute, bf16)
CASES = {"cp2": (1, 2, 1, "none", False), "cp2-selective": (1, 2, 1, "selective", False),
         "cp2-full": (1, 2, 1, "full", False), "cp2-bf16": (1, 2, 1, "none", True),
         "cp4": (1, 4, 1, "none", False), "tp2-cp2": (2, 2, 1, "none", False), "cp2-dp2": (1, 2, 2, "none", False),
         "cp2-explicit": (1, 2, 1, "none", False)}
EXPLICIT = "-explicit"  # a case whose ring blocks run as explicit math, not the fused kernel
SYSTEM = "cpu-example"  # any profile: FLOPs and bytes do not depend on the machine


def case_plan(name: str, mbs: int) -> Plan:
    tp, cp, dp, recompute, _ = CASES[name]
    return Plan(tp=tp, cp=cp, dp=dp, recompute=recompute, attention="flash", mbs=mbs, gbs=mbs * dp)


def perfsim_per_rank(model, plan: Plan) -> dict:
    """perfsim's hardware FLOPs and bytes sent by dimension per device for one step of the plan
    (fp32 gradients, as this run holds them), and its activation bytes."""
    from perfsim.predict import predict
    from perfsim.cost.traffic import step_sent_bytes
    from validate.timing import harness_system
    from validate.tp_check import perfsim_saved_bytes

    system = harness_system(load_system(SYSTEM), "fp32")
    sent = step_sent_bytes(model, system, plan)
    return {"flops": float(predict(model, system, plan, "bf16").hardware_flops_per_step) / plan.devices,
            "sent": {k: float(sent[k]) / plan.devices for k in ("cp", "tp", "dp")},
            "saved": perfsim_saved_bytes(model, plan)}


def run_case(torch, model, name: str, mbs: int) -> dict:
    import torch.distributed as dist

    from validate.context_parallel import all_reduce_gradients, context_parallelize, data_context_groups, skipped_blocks
    from validate.gpt import GPT, GPTConfig, parallelize
    from validate.instrument import CollectiveCounter, LocalFlopCounter
    from validate.tp_check import SavedTensorCounter, counted_sent_bytes, price_saved

    tp, cp, dp, recompute, bf16 = CASES[name]
    plan = case_plan(name, mbs)
    mesh, cp_group, grad_group = data_context_groups("cpu", tp, cp, dp)
    torch.manual_seed(0)
    reference = GPT(GPTConfig.from_spec(model, tp, recompute, "flash"))
    parallel = copy.deepcopy(reference).to(torch.bfloat16 if bf16 else torch.float32)
    if tp > 1:
        parallelize(parallel, mesh["tp"], False)
    context_parallelize(parallel, cp_group, fused=not name.endswith(EXPLICIT))

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (dp * mbs, model.seq), generator=gen)
    targets = torch.randint(0, model.vocab, (dp * mbs, model.seq), generator=gen)
    ref_loss = reference.loss(tokens, targets)
    reference.backward(ref_loss)
    rows = slice(mesh.get_local_rank("dp") * mbs, (mesh.get_local_rank("dp") + 1) * mbs)
    columns = parallel.positions
    tokens, targets = tokens[rows][:, columns], targets[rows][:, columns]

    flops, sends, saved = LocalFlopCounter(), CollectiveCounter(), SavedTensorCounter(torch, parallel)
    with flops, sends, skipped_blocks() as skipped:
        with saved:
            loss = parallel.loss(tokens, targets)
        parallel.backward(loss)
    sync = CollectiveCounter()
    with sync:
        all_reduce_gradients(parallel, grad_group, dp * cp)
    mean_loss = torch.tensor([float(loss.detach())])
    dist.all_reduce(mean_loss, group=grad_group)

    grad_err, grad_scale = 0.0, 0.0
    ref_params = dict(reference.named_parameters())
    for pname, p in parallel.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_err = max(grad_err, float((g.float() - ref_params[pname].grad).abs().max()))
        grad_scale = max(grad_scale, float(ref_params[pname].grad.abs().max()))

    local_tokens = mbs * model.seq // cp
    tp_bytes, other = counted_sent_bytes([r for r in sends.records if r.kind not in ("send", "recv")],
                                         local_tokens, model.hidden)
    lse_shape = (mbs, model.heads // tp, model.seq // cp)  # the ring's log-sum-exp, fp32
    from validate.context_parallel import fused_block_kernels

    probe = torch.empty(0, dtype=torch.bfloat16 if bf16 else torch.float32)  # the blocks' device and dtype
    fused = not name.endswith(EXPLICIT) and fused_block_kernels(probe) is not None
    return {
        "blocks": "fused" if fused else "explicit",
        "dtype": "bf16" if bf16 else "fp32", "loss": float(mean_loss) / (dp * cp), "reference_loss": float(ref_loss.detach()),
        "grad_max_abs_error": grad_err, "grad_max_abs": grad_scale, "positions": columns.tolist(),
        "flops": {"counted": flops.total(), "skipped": sum(skipped.values()), "by_op": flops.by_op(),
                  "skipped_by_pass": dict(skipped)},
        "sent": {"ring_as_run": sends.by_kind().get("send", 0.0), "ring": sends.by_kind(BF16).get("send", 0.0),
                 "ring_messages": sum(r.kind == "send" for r in sends.records),
                 "tp": sum(tp_bytes.values()), "tp_other": other, "gradient_sync": sync.by_kind(FP32)},
        "saved": price_saved(saved.items, [lse_shape]), "perfsim": perfsim_per_rank(model, plan),
    }


def main(argv=None) -> int:
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.cp_check", MODEL, f"comma list of {', '.join(CASES)} or all "
                          "(those whose tp x cp x dp is the world size run)")
    parser.add_argument("--mbs", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    with gloo_ranks(args.timeout) as ranks:
        model = load_model(args.model)
        results = []
        for name, (tp, cp, dp, recompute, bf16) in CASES.items():
            if tp * cp * dp != ranks.world or (args.cases != "all" and name not in args.cases.split(",")):
                continue
            everyone = every_rank(run_case(torch, model, name, args.mbs))
            results.append({"case": name, "tp": tp, "cp": cp, "dp": dp, "recompute": recompute, "bf16": bf16,
                            "ranks": everyone})
        write_on_rank0(ranks, args.out, model=args.model, mbs=args.mbs, cases=results)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
