"""Correctness and exactness of real 2d / 2.5d / 3d tensor-parallel steps (validate.multidim), per rank.

Run as ranks (`python -m validate.multidim_check OUT.json --cases 3d-none,...`, launched by
validate.launcher.launch_ranks). For every case (mode x recompute) each rank builds the seeded
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
  head_collectives (final norm, logits, loss), and the embedding's against
  embedding_collectives. Activations, weights and weight gradients are re-priced at 2 bytes an
  element (perfsim's bf16); the LayerNorm and loss statistics stay fp32 as perfsim prices them.
  The parameter-vector gathers, which perfsim leaves out, are recorded apart
  (docs/real-steps-multidim.md);
- parameter elements against perfsim.cost.memory.stage_params;
- bytes each layer saves for backward (validate.instrument.SavedBytes around each layer's
  forward: each distinct storage once, parameters excluded, floating tensors re-priced at 2 bytes
  an element, boolean masks at 1) against perfsim.cost.memory.layout_activation_bytes.

Rank 0 writes one JSON object: {"world": P, "cases": [{case..., "ranks": [per-rank dicts]}]}.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.layer import BF16, FP32
from perfsim.cost.memory import layout_activation_bytes
from perfsim.spec.model import load_model
from perfsim.spec.plan import RECOMPUTE, Plan
from validate.tp_check import perfsim_step

MODEL = "layers=2,hidden=64,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false"
MODES_AT = {4: [("2d", 1)], 8: [("2.5d", 2), ("3d", 1)]}  # world -> (mode, depth)
GROUP_ARG = {"allreduce_": 1, "_allgather_base_": 2, "broadcast_": 1, "reduce_": 1, "_reduce_scatter_base_": 2}


def case_names(world: int) -> list[str]:
    return [f"{mode}-{rc}" for mode, _ in MODES_AT[world] for rc in RECOMPUTE] + \
        (["3d-regather-none"] if world == 8 else [])


def perfsim_expected(model, plan: Plan) -> dict:
    """What perfsim says one rank does in one forward + backward of one micro-batch, with the
    bytes sent per "axis/kind"."""
    step = perfsim_step(model, plan)
    layout = step.layout

    def by_axis(colls, times=1):
        out = defaultdict(float)
        for x in colls:
            out[f"{x.axis}/{x.kind}"] += times * float(x.count * tpc.sent_bytes(x.kind, x.nbytes, layout.axes[x.axis][0]))
        return {k: v for k, v in out.items() if v}

    sent = defaultdict(float, by_axis(step.layer, model.layers))
    for k, v in by_axis(step.head).items():
        sent[k] += v
    return {"flops": step.flops, "sent_bytes": dict(sent), "embedding_sent_bytes": by_axis(step.embedding),
            "params": step.params,
            "activation_bytes_per_layer": float(layout_activation_bytes(model, layout, plan.mbs, step.columns.recompute)),
            "axes": {a: [int(s), int(st)] for a, (s, st) in layout.axes.items()}}


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
        size = FP32 if tag == "stats" else BF16
        priced = Record(r.kind, r.elements, size, r.group_size).sent_bytes()
        out[str(tag)][f"{names.get(group, group)}/{r.kind}"] += priced
    return {t: dict(v) for t, v in out.items()}


@contextlib.contextmanager
def saved_by_layer(params, per_layer: list):
    """Bytes one transformer layer saves for backward (MultiDimGPT.block_context), appended to
    `per_layer`: validate.instrument.SavedBytes around the layer's forward alone. Nothing saved
    in a forward is freed before its backward, so the meter's live peak over the layer is the
    layer's total; its booleans (if any), kept apart there, are added back here at their
    own size (docs/real-steps-multidim.md)."""
    from validate.instrument import SavedBytes

    meter = SavedBytes(params, element_bytes=BF16)
    with meter.hooks():
        yield
    per_layer.append(meter.peak + meter.peak_other)


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

    saved_per_layer = []
    parallel.block_context = functools.partial(saved_by_layer, list(parallel.parameters()), saved_per_layer)
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
    modelled = defaultdict(float)  # layers, final norm and head
    for t in ("None", "stats"):
        for k, v in counted.get(t, {}).items():
            modelled[k] += v
    kept = ("None", "stats", "embedding", "param")
    return {
        "loss": loss, "reference_loss": float(ref_loss.detach()), "grad_max_abs_error": grad_err,
        "grad_max_abs": grad_scale, "uncovered_grads": uncovered,
        "coords": grid.coord, "axes": {a: list(v) for a, v in grid.axes.items()}, "perfsim_axes": expected["axes"],
        "flops": {"counted": flops.total(), "perfsim": expected["flops"], "by_op": flops.by_op()},
        "sent_bytes": {"counted": dict(modelled), "perfsim": expected["sent_bytes"],
                       "embedding": counted.get("embedding", {}), "perfsim_embedding": expected["embedding_sent_bytes"],
                       "param": counted.get("param", {}),
                       "other": {t: v for t, v in counted.items() if t not in kept},
                       "as_asked_fp32": collectives.by_kind(), "gloo_wire_fp32": collectives.gloo_wire_by_kind()},
        "params": {"counted": local_parameter_elements(parallel), "perfsim": expected["params"]},
        "saved_bytes": {"per_layer": saved_per_layer, "perfsim_per_layer": expected["activation_bytes_per_layer"]},
    }


def main(argv=None) -> int:
    from validate.ranks import rank_environment
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.multidim_check", MODEL,
                          "comma list of 2d-none, 3d-full, 3d-regather-none ... or all")
    parser.add_argument("--mbs", type=int, default=4)
    args = parser.parse_args(argv)
    world = rank_environment().world
    if world not in MODES_AT:  # before gloo starts: a wrong launch fails at once
        raise SystemExit(f"multidim_check runs at world 4 (2d) or 8 (2.5d, 3d), not {world}")

    import torch

    from validate.multidim import grid_for

    with gloo_ranks(args.timeout) as ranks:
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
            everyone = every_rank(run_case(torch, grids[mode, regather], model, mode, depth, rc, args.mbs, regather))
            results.append({"case": name, "mode": mode, "recompute": rc, "regather": regather, "ranks": everyone})
        write_on_rank0(ranks, args.out, model=args.model, mbs=args.mbs, cases=results)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
