"""Correctness and exactness of real 2d / 2.5d / 3d tensor-parallel steps (validate.multidim), per rank.

Run as ranks (`python -m validate.multidim_check OUT.json --cases 3d-none,...`, launched by
validate.campaign.launch_ranks). For every case (mode x recompute) each rank builds the seeded
single-process GPT (validate.gpt.GPT) as the reference, keeps its own shards of it in a
MultiDimGPT, runs one forward and backward on the same batch and records:

- loss against the reference, and every gradient: each rank sends (the index map of its shard,
  its gradient) to rank 0, which assembles the full tensors (every element must be covered) and
  compares them with the reference's;
- matrix FLOPs (validate.instrument.LocalFlopCounter) against perfsim's layer_gemms / head_gemm x 3
  plus recomputation;
- bytes sent per (grid axis, collective kind), counted at dispatch (AxisCollectiveCounter: the
  CollectiveCounter plus the process group and the program's tag of each collective), against
  perfsim's layer_collectives (x layers, forward repeated under full recomputation) and
  head_collectives. Activations and weights are re-priced at 2 bytes an element (perfsim's bf16);
  the LayerNorm and loss statistics stay fp32 as perfsim prices them. The embedding's
  collectives, the final norm's statistics and the parameter-vector gathers are recorded apart
  and compared with perfsim in docs/real-steps-multidim.md;
- parameter elements against perfsim.cost.memory.stage_params;
- bytes each layer saves for backward (torch.autograd.graph.saved_tensors_hooks, each distinct
  storage once, parameters excluded, floating tensors re-priced at 2 bytes an element) against
  perfsim.cost.memory.layout_activation_bytes.

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.counts import ATTENTION_CORE
from perfsim.cost.layer import BF16, FP32
from perfsim.cost.memory import layout_activation_bytes, stage_params
from perfsim.spec.model import load_model
from perfsim.spec.plan import RECOMPUTE, Plan

MODEL = "layers=2,hidden=64,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false"
MODES_AT = {4: [("2d", 1)], 8: [("2.5d", 2), ("3d", 1)]}  # world -> (mode, depth)
GROUP_ARG = {"allreduce_": 1, "_allgather_base_": 2, "broadcast_": 1, "reduce_": 1, "_reduce_scatter_base_": 2}


def case_names(world: int) -> list[str]:
    return [f"{mode}-{rc}" for mode, _ in MODES_AT[world] for rc in RECOMPUTE] + \
        (["3d-regather-none"] if world == 8 else [])


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
    layer_colls = fwd + bwd + (fwd if plan.recompute == "full" else [])
    h_fwd, h_bwd = tpc.head_collectives(layout, model, b, vocab)
    e_fwd, e_bwd = tpc.embedding_collectives(layout, model, b)

    def by_axis(colls, times=1):
        out = defaultdict(float)
        for x in colls:
            out[f"{x.axis}/{x.kind}"] += times * float(x.count * tpc.sent_bytes(x.kind, x.nbytes, layout.axes[x.axis][0]))
        return out

    stats = fwd[-1]  # the two layer norms' statistics; the final norm issues one more, both ways
    final_norm = tpc.Collective(stats.kind, stats.nbytes, 1, stats.axis)
    sent = by_axis(layer_colls, model.layers)
    for k, v in by_axis(h_fwd + h_bwd).items():
        sent[k] += v
    return {"flops": float(flops), "sent_bytes": {k: v for k, v in sent.items() if v},
            "embedding_sent_bytes": {k: v for k, v in by_axis(e_fwd + e_bwd).items() if v},
            "final_norm_sent_bytes": dict(by_axis([final_norm, final_norm])),
            "reference_embedding_sent_bytes": reference_embedding_bytes(layout, model, b, vocab),
            "params": float(stage_params(model, c, "first")),
            "activation_bytes_per_layer": float(layout_activation_bytes(model, layout, b, c.recompute)),
            "axes": {a: [int(s), int(st)] for a, (s, st) in layout.axes.items()}}


def reference_embedding_bytes(layout, model, b, vocab) -> dict:
    """What the reference's vocabulary-parallel embedding sends per rank (bf16), by axis/kind
    (docs/real-steps-multidim.md): 2d/2.5d reduce-scatter the partial lookups [T/d, h/q] over `col`
    and all-gather their gradient back, 2.5d all-reduces the [V/q, h/q] weight gradient over
    `depth`; 3d all-gathers the weight [V/q, h/q] over `weight`, reduce-scatters [T/q, h/q] over
    `input`, and backward all-gathers the gradient over `input` and reduce-scatters the weight's
    over `weight`."""
    q, d = float(layout.q), float(layout.depth)
    tokens, h = b * model.seq, model.hidden
    ring = (q - 1) / q
    if layout.mode == "3d":
        x, w = BF16 * tokens / q * h / q, BF16 * vocab / q * h / q
        return {"weight/all_gather": ring * w, "input/reduce_scatter": ring * x, "input/all_gather": ring * x,
                "weight/reduce_scatter": ring * w}
    x = BF16 * tokens / d * h / q
    out = {"col/reduce_scatter": ring * x, "col/all_gather": ring * x}
    if d > 1:
        out["depth/all_reduce"] = 2 * (d - 1) / d * BF16 * vocab / q * h / q
    return out


def axis_counter_class():
    from validate.instrument import CollectiveCounter

    class AxisCollectiveCounter(CollectiveCounter):
        """CollectiveCounter that also keeps, for each record, the process group's name and the
        tag (validate.multidim.tag) the program issued it under (records[i] <-> groups[i], tags[i])."""

        def __init__(self):
            super().__init__()
            self.groups, self.tags = [], []
            self._current = (None, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed import ProcessGroup

            from validate.multidim import current_tag

            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d" and name in GROUP_ARG:
                pg = args[GROUP_ARG[name]]
                pg = pg if isinstance(pg, ProcessGroup) else ProcessGroup.unbox(pg)
                self._current = (pg.group_name, current_tag())
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _add(self, kind, tensors, group_size, full_factor):
            before = len(self.records)
            super()._add(kind, tensors, group_size, full_factor)
            for _ in range(len(self.records) - before):
                self.groups.append(self._current[0])
                self.tags.append(self._current[1])

    return AxisCollectiveCounter


def classify(counter, grid) -> dict:
    """Sent bytes by tag, then "axis/kind", at perfsim's prices (see module doc)."""
    from validate.instrument import Record

    names = {g.group_name: key for key, g in grid.groups.items()}
    out = defaultdict(lambda: defaultdict(float))
    for r, group, tag in zip(counter.records, counter.groups, counter.tags):
        size = FP32 if tag in ("stats", "final_norm") else BF16
        priced = Record(r.kind, r.elements, size, r.group_size).sent_bytes()
        out[str(tag)][f"{names.get(group, group)}/{r.kind}"] += priced
    return {t: dict(v) for t, v in out.items()}


class SavedBytes:
    """Bytes each transformer layer saves for backward (use `layer` as MultiDimGPT.block_context)."""

    def __init__(self, torch, params):
        self.torch = torch
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.per_layer = []

    @contextlib.contextmanager
    def layer(self):
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.params and ptr not in seen:
                elements = storage.nbytes() // t.element_size()
                seen[ptr] = elements * BF16 if t.is_floating_point() else storage.nbytes()
            return t

        with self.torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_layer.append(sum(seen.values()))


def run_case(torch, grid, model, mode, depth, recompute, mbs, regather=False) -> dict:
    import torch.distributed as dist

    from validate.gpt import GPT, GPTConfig
    from validate.instrument import LocalFlopCounter
    from validate.multidim import MultiDimGPT, local_parameter_elements

    world = dist.get_world_size()
    plan = Plan(tp=world, tp_mode=mode, tp_depth=depth, mbs=mbs, gbs=mbs, recompute=recompute, tp_regather=regather)
    cfg = GPTConfig.from_spec(model, plan.tp, recompute)
    torch.manual_seed(0)
    reference = GPT(cfg)
    parallel = MultiDimGPT(grid, cfg, regather).load_from(reference)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)
    targets = torch.randint(0, model.vocab, (mbs, cfg.seq), generator=gen)

    ref_loss = reference.loss(tokens, targets)
    reference.backward(ref_loss)

    saved = SavedBytes(torch, parallel.parameters())
    parallel.block_context = saved.layer
    flops, collectives = LocalFlopCounter(), axis_counter_class()()
    with flops, collectives:
        share = parallel.loss(tokens, targets)
        share.backward()
    loss = parallel.global_loss(share)

    # gradients: every rank's piece with the index map of where it sits in the full tensor
    ref_params = dict(reference.named_parameters())
    pieces = {}
    for name, p in parallel.named_parameters():
        ref_name, piece = parallel.recipes[name]
        full = ref_params[ref_name]
        index = piece(torch.arange(full.numel()).view(full.shape))
        pieces[ref_name] = (index.reshape(-1).clone(), p.grad.detach().reshape(-1).clone())
    everyone = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(pieces, everyone, dst=0)
    grad_err = grad_scale = float("nan")
    uncovered = []
    if dist.get_rank() == 0:
        grad_err = grad_scale = 0.0
        for ref_name, full in ref_params.items():
            assembled = torch.full((full.numel(),), float("nan"))
            for rank_pieces in everyone:
                index, values = rank_pieces[ref_name]
                assembled[index] = values
            if torch.isnan(assembled).any():
                uncovered.append(ref_name)
            grad_err = max(grad_err, float((assembled.view(full.shape) - full.grad).abs().max()))
            grad_scale = max(grad_scale, float(full.grad.abs().max()))

    expected = perfsim_expected(model, plan)
    counted = classify(collectives, grid)
    modelled = defaultdict(float)
    for t in ("None", "stats"):
        for k, v in counted.get(t, {}).items():
            modelled[k] += v
    return {
        "loss": loss, "reference_loss": float(ref_loss.detach()), "grad_max_abs_error": grad_err,
        "grad_max_abs": grad_scale, "uncovered_grads": uncovered,
        "coords": grid.coord, "axes": {a: list(v) for a, v in grid.axes.items()}, "perfsim_axes": expected["axes"],
        "flops": {"counted": flops.total(), "perfsim": expected["flops"], "by_op": flops.by_op()},
        "sent_bytes": {"counted": dict(modelled), "perfsim": expected["sent_bytes"],
                       "embedding": counted.get("embedding", {}), "perfsim_embedding": expected["embedding_sent_bytes"],
                       "reference_embedding": expected["reference_embedding_sent_bytes"],
                       "final_norm": counted.get("final_norm", {}), "perfsim_final_norm": expected["final_norm_sent_bytes"],
                       "param": counted.get("param", {}),
                       "other": {t: v for t, v in counted.items()
                                 if t not in ("None", "stats", "embedding", "final_norm", "param")},
                       "as_asked_fp32": collectives.by_kind(), "gloo_wire_fp32": collectives.gloo_wire_by_kind()},
        "params": {"counted": local_parameter_elements(parallel), "perfsim": expected["params"],
                   "final_norm_whole": 2 * model.hidden, "final_norm_local": parallel.ln_f.weight.numel() * 2},
        "saved_bytes": {"per_layer": saved.per_layer, "perfsim_per_layer": expected["activation_bytes_per_layer"]},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validate.multidim_check")
    parser.add_argument("out")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--cases", default="all", help="comma list of 2d-none, 3d-full, 3d-regather-none ... or all")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks before this rank fails (a dead rank)")
    args = parser.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from validate.campaign import rank_environment
    from validate.multidim import grid_for

    ranks = rank_environment()
    if ranks.world not in MODES_AT:
        raise SystemExit(f"multidim_check runs at world 4 (2d) or 8 (2.5d, 3d), not {ranks.world}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=args.timeout))
    try:
        model = load_model(args.model)
        wanted = case_names(ranks.world) if args.cases == "all" else args.cases.split(",")
        results, grids = [], {}
        for name in case_names(ranks.world):
            if name not in wanted:
                continue
            mode, rest = name.split("-", 1)
            regather = rest.startswith("regather")
            rc = rest.split("-")[-1]
            depth = dict(MODES_AT[ranks.world])[mode]
            if (mode, regather) not in grids:  # the axis placement depends on the traffic, so on regather
                plan = Plan(tp=ranks.world, tp_mode=mode, tp_depth=depth, mbs=args.mbs, gbs=args.mbs, tp_regather=regather)
                grids[mode, regather] = grid_for(plan, model, ranks.rank)
            mine = run_case(torch, grids[mode, regather], model, mode, depth, rc, args.mbs, regather)
            everyone = [None] * ranks.world
            dist.all_gather_object(everyone, mine)
            results.append({"case": name, "mode": mode, "recompute": rc, "regather": regather, "ranks": everyone})
        if ranks.rank == 0:
            with open(args.out, "w") as fh:
                json.dump({"world": ranks.world, "model": args.model, "mbs": args.mbs, "cases": results}, fh, indent=1)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
