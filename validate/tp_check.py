"""Correctness and exactness of real 1D tensor-parallel training steps (validate.gpt), per rank.

Run as ranks (`python -m validate.tp_check OUT.json --model SPEC --mbs B`, launched by
validate.campaign.launch_ranks). For every case (1d and 1d+SP, recompute none/selective/full)
each rank builds the same seeded model, keeps an unsharded copy as the single-process reference,
shards the other, runs one forward and backward on the same batch and records:

- loss and gradients against the reference (gradients gathered to full tensors);
- matrix FLOPs it ran (validate.instrument.LocalFlopCounter) against perfsim's GEMMs for the plan
  (perfsim.cost.tensor_parallel.layer_gemms / head_gemm, recomputation as perfsim.cost.counts
  defines it);
- bytes each collective kind sends (validate.instrument.CollectiveCounter, ring convention)
  against perfsim.cost.tensor_parallel.collectives_sent_bytes over the embedding, layer and head
  collectives. The run is fp32 (CPU); perfsim prices activations in bf16, so counted activation
  collectives are re-priced at 2 bytes an element; the loss statistics ([tokens] each) are fp32 in
  both. Gradient synchronisation of replicated parameters is not a TP activation collective
  (perfsim does not model it) and is reported separately;
- parameter elements it holds against perfsim.cost.memory.stage_params (perfsim's weight bytes
  are 2 x that in bf16; this fp32 run holds 4 x).

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.counts import ATTENTION_CORE
from perfsim.cost.layer import BF16, FP32
from perfsim.cost.memory import stage_params
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan

CASES = [(sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]


def gemm_flops(g) -> float:
    return 2 * g.count * g.m * g.n * g.k


def perfsim_expected(model, plan: Plan) -> dict:
    """What perfsim says one rank does in one forward + backward of one micro-batch."""
    c = columns_of(plan)
    layout = tpc.layout_of(model, c)
    b, vocab = plan.mbs, model.padded_vocab(plan.tp)
    gemms = tpc.layer_gemms(layout, model, b)
    layer = sum(gemm_flops(g) for g in gemms)
    head = gemm_flops(tpc.head_gemm(layout, model, b, vocab))
    recompute = {"none": 0, "full": layer, "selective": sum(gemm_flops(g) for g in gemms if g.name in ATTENTION_CORE)}
    flops = 3 * (model.layers * layer + head) + model.layers * recompute[plan.recompute]

    fwd, bwd = tpc.layer_collectives(layout, model, b)
    e_fwd, e_bwd = tpc.embedding_collectives(layout, model, b)
    h_fwd, h_bwd = tpc.head_collectives(layout, model, b, vocab)
    layer_colls = fwd + bwd + (fwd if plan.recompute == "full" else [])
    per_kind = {}
    for kind in (tpc.ALL_REDUCE, tpc.ALL_GATHER, tpc.REDUCE_SCATTER):
        pick = [x for x in layer_colls if x.kind == kind]
        edge = [x for x in e_fwd + e_bwd + h_fwd + h_bwd if x.kind == kind]
        per_kind[kind] = float(model.layers * tpc.collectives_sent_bytes(layout, pick)
                               + tpc.collectives_sent_bytes(layout, edge))
    return {"flops": float(flops), "sent_bytes": per_kind, "params": float(stage_params(model, c, "first"))}


def counted_sent_bytes(records, tokens: int, hidden: int) -> tuple[dict, dict]:
    """(activation and loss collectives by kind at perfsim's prices, everything else by kind)."""
    from validate.instrument import Record

    activations, other = {}, {}
    for r in records:
        if r.elements == tokens and r.kind == "all_reduce":  # loss statistics: fp32 in perfsim too
            priced, into = Record(r.kind, r.elements, FP32, r.group_size), activations
        elif r.elements % (tokens * hidden) == 0:
            priced, into = Record(r.kind, r.elements, BF16, r.group_size), activations
        else:
            priced, into = r, other
        into[r.kind] = into.get(r.kind, 0.0) + priced.sent_bytes()
    return activations, other


def run_case(torch, mesh, model, sp: bool, recompute: str, mbs: int) -> dict:
    from validate.gpt import GPT, GPTConfig, local_parameter_elements, parallelize
    from validate.instrument import CollectiveCounter, LocalFlopCounter

    tp = mesh.size()
    cfg = GPTConfig.from_spec(model, tp, recompute)
    torch.manual_seed(0)
    reference = GPT(cfg)
    parallel = parallelize(copy.deepcopy(reference), mesh, sp)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)
    targets = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)

    ref_loss = reference.loss(tokens, targets)
    reference.backward(ref_loss)

    flops, collectives = LocalFlopCounter(), CollectiveCounter()
    with flops, collectives:
        loss = parallel.loss(tokens, targets)
        parallel.backward(loss)
    finish = CollectiveCounter()
    with finish:
        parallel.finish_gradients()

    grad_err, grad_scale, partial = 0.0, 0.0, []
    ref_params = dict(reference.named_parameters())
    for name, p in parallel.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            if any(pl.is_partial() for pl in g.placements):
                partial.append(name)
            g = g.full_tensor()
        grad_err = max(grad_err, float((g - ref_params[name].grad).abs().max()))
        grad_scale = max(grad_scale, float(ref_params[name].grad.abs().max()))
    loss_value = float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())

    plan = Plan(tp=tp, sp=sp, mbs=mbs, gbs=mbs, recompute=recompute)
    expected = perfsim_expected(model, plan)
    activation_bytes, other_bytes = counted_sent_bytes(collectives.records, mbs * model.seq, model.hidden)
    return {
        "loss": loss_value, "reference_loss": float(ref_loss.detach()), "grad_max_abs_error": grad_err,
        "grad_max_abs": grad_scale, "partial_grads": partial,
        "flops": {"counted": flops.total(), "perfsim": expected["flops"], "by_op": flops.by_op()},
        "sent_bytes": {"counted": activation_bytes, "perfsim": expected["sent_bytes"],
                       "other_in_step": other_bytes, "gradient_sync": finish.by_kind(),
                       "as_asked_fp32": collectives.by_kind(), "gloo_wire_fp32": collectives.gloo_wire_by_kind()},
        "params": {"counted": local_parameter_elements(parallel), "perfsim": expected["params"]},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validate.tp_check")
    parser.add_argument("out")
    parser.add_argument("--model", default="layers=2,hidden=32,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false")
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--cases", default="all", help="comma list of 1d-none, 1d+sp-full, ... or all")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks before this rank fails (a dead rank)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from validate.campaign import rank_environment

    ranks = rank_environment()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from datetime import timedelta

    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh("cpu", (ranks.world,), mesh_dim_names=("tp",))
        model = load_model(args.model)
        results = []
        for sp, rc in CASES:
            name = f"1d{'+sp' if sp else ''}-{rc}"
            if args.cases != "all" and name not in args.cases.split(","):
                continue
            mine = run_case(torch, mesh, model, sp, rc, args.mbs)
            everyone = [None] * ranks.world
            dist.all_gather_object(everyone, mine)
            results.append({"case": name, "sp": sp, "recompute": rc, "ranks": everyone})
        if ranks.rank == 0:
            with open(args.out, "w") as fh:
                json.dump({"world": ranks.world, "model": args.model, "mbs": args.mbs, "cases": results}, fh, indent=1)
        dist.barrier()  # no rank tears gloo down while another still talks to it (else: abort at exit)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
