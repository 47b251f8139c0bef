"""Every plan kind the harness runs, built and stepped under validate.device_consistency, as ranks.

Run as ranks (`python -m validate.device_check OUT [--model gpt,llama]`, launched by
validate.launcher.launch_ranks; tests/test_validate_device_consistency.py). Each rank builds every
plan of its world size (`plans_at`) for each model (MODELS) with validate.steps.build_step, the
builder `perfsim validate` uses, and runs its optimizer steps (`steps_of`), all inside
DeviceConsistency: an op that would meet tensors of two devices on a GPU raises MixedDevices,
naming the model and plan, and the rank fails. Rank 0 writes {"world": P, "models": names,
"plans": [labels run]}.
"""

from __future__ import annotations

# the models every plan runs with (their layers: model_of): the GPT and a Llama-shaped one (grouped
# queries, rotary positions, RMSNorm, SwiGLU, no biases)
MODELS = {"gpt": "hidden=64,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false",
          "llama": "hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
                   "learned_positions=false,seq=16,vocab=512,tied_embeddings=false,dropout=false"}
# a model with experts (validate.moe): its default plans at 1, 2 and 4 ranks (validate.timing.expert_plans)
MOE = ("hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,learned_positions=false,"
       "seq=16,vocab=512,tied_embeddings=false,dropout=false,experts=4,topk=2,expert_ffn=32,shared_expert_ffn=64")


def model_of(plan, spec: str):
    """The model a plan runs here: the fewest layers it takes, one per pipeline stage (a layer
    shows every op a layer runs; the CI machine's few cores run every rank)."""
    from perfsim.spec.model import load_model

    return load_model(f"layers={plan.pp * plan.vpp},{spec}")


def plans_at(world: int, spec: str) -> list:
    """The plans run at `world` ranks: perfsim validate's default plans at 1 and 2 devices (1d
    tensor parallelism with and without SP under every recompute mode, unfused and flash
    attention, the three pipeline schedules, ZeRO 0-3, context parallelism); at 4 its 2d plan and
    context parallelism beside tensor and data parallelism; at 8 its 2.5d and 3d plans (the grids
    split the micro-batch 4 ways: mbs 4 there)."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from validate.timing import default_plans

    model = load_model(f"layers=4,{spec}")  # enough for every default plan's stages
    if world <= 2:
        return default_plans(world, model, mbs=2)
    if world == 4:
        return [p for p in default_plans(4, model, mbs=4) if p.tp_mode == "2d"] + [
            Plan(tp=2, cp=2, attention="flash", mbs=2, gbs=4), Plan(cp=2, dp=2, attention="flash", mbs=2, gbs=8)]
    if world == 8:
        return [p for p in default_plans(8, model, mbs=4) if p.tp_mode in ("2.5d", "3d")]
    raise ValueError(f"no plans at {world} ranks: run 1, 2, 4 or 8")


def steps_of(plan) -> int:
    """Two steps where torch sets up at the first what the second runs (DDP rebuilds its buckets,
    FSDP2 and ZeroRedundancyOptimizer initialise lazily, a pipeline stage's first step exchanges
    its warm-up vote); one elsewhere (everything is built before it: MasterAdam.init_states)."""
    return 2 if plan.dp > 1 or plan.pp > 1 else 1


def label_of(plan) -> str:
    """validate.timing's label, which leaves the attention kernel out, with it."""
    from validate.timing import plan_label

    return plan_label(plan) + (" flash" if plan.attention == "flash" else "")


def cases_at(world: int, models=tuple(MODELS)) -> list:
    """(label, run) of every plan at `world` ranks with each of `models`, a model with experts'
    default plans at 1, 2 and 4 ranks, and at 2 ranks the
    calibration's tensor-parallel overhead layers (validate.tp_overhead, DTensor's and Megatron's
    layer timed in turn) and its collectives; run(device, dtype) builds and steps it."""
    import functools

    cases = [(f"{name} {label_of(plan)}", functools.partial(_steps, plan, MODELS[name]))
             for name in models for plan in plans_at(world, MODELS[name])]
    if world <= 4:
        from perfsim.spec.model import load_model
        from validate.timing import default_plans

        cases += [(f"moe {label_of(plan)}", functools.partial(_steps, plan, MOE))
                  for plan in default_plans(world, load_model(f"layers=1,{MOE}"), mbs=2)]
    if world == 2:
        from validate.microbench import TP_OVERHEAD_LAYOUTS

        cases += [(f"tp_overhead {layout}", functools.partial(_tp_overhead, layout))
                  for layout in TP_OVERHEAD_LAYOUTS] + [("collectives", _collectives)]
    return cases


def _steps(plan, spec: str, device, dtype) -> None:
    from validate.steps import build_step

    step = build_step(plan, model_of(plan, spec), device, dtype)
    for _ in range(steps_of(plan)):
        step.run()


def _tp_overhead(layout: str, device, dtype) -> None:
    import torch
    import torch.distributed as dist

    from validate.device import Device
    from validate.gpt import GPTConfig
    from validate.tp_overhead import measure_layer

    measure_layer(torch, Device(device.type), dist.group.WORLD, GPTConfig(1, 64, 4, 16, 64), layout == "1d_sp", 2,
                  dtype, repeats=1)


def _collectives(device, dtype) -> None:
    """Each of the calibration's collectives once as a step issues it, and those it times beside
    compute once that way (validate.microbench.Communicator)."""
    import torch
    import torch.distributed as dist

    from validate.device import Device
    from validate.microbench import COLLECTIVES, CONCURRENT_OPS, EXPERT_COLLECTIVES, Communicator, Point, point_shape

    comm = Communicator(torch, Device(device.type), dist.get_rank(), dist.get_world_size(), [(2, 1)])
    for op in COLLECTIVES + EXPERT_COLLECTIVES:
        point = Point("collective", op, "bf16", point_shape(nbytes=4096), group=(2, 1))
        comm.make(point)()
        if op in CONCURRENT_OPS:
            comm.time_concurrent(point, rounds=1, warmup=1)


def run_cases(cases, device="cpu", dtype_name: str = "bf16") -> list:
    """Run each case on this rank under DeviceConsistency; the labels of those run."""
    import torch

    from validate.device_consistency import DeviceConsistency, MixedDevices
    from validate.steps import DTYPES

    dtype = getattr(torch, DTYPES[dtype_name])
    for label, run in cases:
        try:
            with DeviceConsistency():
                run(torch.device(device), dtype)
        except MixedDevices as e:
            raise MixedDevices(f"{label}: {e}") from None
    return [label for label, _ in cases]


def main(argv=None) -> int:
    from validate.ranks import check_parser, gloo_ranks, write_on_rank0

    args = check_parser("python -m validate.device_check", ",".join(MODELS),
                        "'all' (every plan of the world size) or a comma list of their labels").parse_args(argv)
    with gloo_ranks(args.timeout) as ranks:
        chosen = args.cases.split(",")
        cases = [c for c in cases_at(ranks.world, args.model.split(",")) if args.cases == "all" or c[0] in chosen]
        write_on_rank0(ranks, args.out, models=args.model, plans=run_cases(cases))
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
