"""What DTensor tensor parallelism adds to a transformer layer's time: the harness's layer
(validate.gpt.Block sharded by torch.distributed.tensor.parallel, as validate.gpt.parallelize
shards it) against the same layer written as Megatron-LM writes it, timed alternately on the same
ranks, shapes and group (docs/calibration.md, "Tensor-parallel overhead").

Megatron's layer runs the same local GEMMs and element-wise kernels and the same collectives, from
four autograd functions: f (identity forward, all-reduce of the input gradient backward) before
the column-parallel QKV and FC1, g (all-reduce forward) after the row-parallel projection and FC2;
with sequence parallelism, an all-gather of the sequence-split input (reduce-scatter backward) in
f's place and a reduce-scatter (all-gather backward) in g's. What the DTensor layer takes beyond
it is DTensor's own: the dispatch of every op on a DTensor, its redistributions, the wrapping and
waiting of its asynchronous collectives. perfsim prices that as framework.tp_layer_overhead_s
(1d) and framework.sp_layer_overhead_s (1d + SP) per layer and micro-batch: Megatron-LM has none
(0, the default), the CPU harness's profile the difference measured here.
"""

from __future__ import annotations

import statistics
import time

from validate.microbench import TP_OVERHEAD_LAYOUTS

# Alternating rounds; their per-round differences' median is the overhead. The fit pools three
# points' rounds: drawn 16 of 24 rounds a point from the transfer ledgers, the pooled median moved
# by 0.6-2.4 ms (sd) of its 12-30 ms. With 24 the suite took 94 s of mkl-compat r4's calibration;
# with 16, 87 s of r5's on a VM 1.3x slower.
REPEATS = 16


def _functions(torch, group):
    import torch.distributed as dist

    size = dist.get_world_size(group)

    def all_gather_seq(x):  # [b, s/P, h] -> [b, s, h]; the collective concatenates along dim 0
        xt = x.transpose(0, 1).contiguous()
        out = torch.empty((size * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, xt, group=group)
        return out.transpose(0, 1)

    def reduce_scatter_seq(x):  # [b, s, h] -> the sum's [b, s/P, h] slice of this rank
        xt = x.transpose(0, 1).contiguous()
        out = torch.empty((xt.shape[0] // size,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, xt, group=group)
        return out.transpose(0, 1).contiguous()

    def all_reduce(x):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    def conjugate(forward, backward):
        """An autograd op running `forward` on the input and `backward` on its gradient."""
        class Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return forward(x)

            @staticmethod
            def backward(ctx, grad):
                return backward(grad)
        return Op.apply

    def identity(x):
        return x

    # Megatron's f and g; with SP, f's all-gather and g's reduce-scatter along the sequence
    return (conjugate(identity, all_reduce), conjugate(all_reduce, identity),
            conjugate(all_gather_seq, reduce_scatter_seq), conjugate(reduce_scatter_seq, all_gather_seq))


def megatron_block(torch, dtensor_block, group, sp: bool):
    """Megatron-LM's layer holding the same local weights as `dtensor_block` (a validate.gpt.Block
    sharded over `group`): a module whose forward takes and returns this rank's [b, s, h] input
    ([b, s/P, h] with SP) and computes what the DTensor layer computes."""
    from torch import nn

    from validate.gpt import attention_core

    f, g, gather, scatter = _functions(torch, group)
    enter, leave = (gather, scatter) if sp else (f, g)

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    def copied(t):
        return nn.Parameter(local(t)) if t is not None else None

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            src = dtensor_block
            self.ln1, self.ln2 = (nn.LayerNorm(n.normalized_shape, device=n.weight.device, dtype=n.weight.dtype)
                                  for n in (src.ln1, src.ln2))
            with torch.no_grad():
                for mine, theirs in ((self.ln1, src.ln1), (self.ln2, src.ln2)):
                    mine.weight.copy_(local(theirs.weight))
                    mine.bias.copy_(local(theirs.bias))
            self.head_dim = src.attn.head_dim
            self.qkv_weight, self.qkv_bias = copied(src.attn.qkv.weight), copied(src.attn.qkv.bias)
            self.proj_weight, self.proj_bias = copied(src.attn.proj.weight), copied(src.attn.proj.bias)
            self.fc1_weight, self.fc1_bias = copied(src.mlp.fc1.weight), copied(src.mlp.fc1.bias)
            self.fc2_weight, self.fc2_bias = copied(src.mlp.fc2.weight), copied(src.mlp.fc2.bias)

        def forward(self, x):
            qkv = nn.functional.linear(enter(self.ln1(x)), self.qkv_weight, self.qkv_bias)
            b, s, width = qkv.shape
            heads = width // (3 * self.head_dim)
            q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
            context = attention_core(q, k, v).transpose(1, 2).reshape(b, s, heads * self.head_dim)
            # the row-parallel bias is added once, after the reduction, as Megatron adds it
            x = x + leave(nn.functional.linear(context, self.proj_weight)) + self.proj_bias
            hidden = nn.functional.gelu(nn.functional.linear(enter(self.ln2(x)), self.fc1_weight, self.fc1_bias))
            return x + leave(nn.functional.linear(hidden, self.fc2_weight)) + self.fc2_bias

    return Block()


def dtensor_block(torch, cfg, mesh, sp: bool, dtype, device):
    """validate.gpt's transformer layer, sharded over the 1-D `mesh` as validate.gpt.parallelize
    shards every layer of the GPT."""
    from validate.gpt import Block, layer_plan
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype)
    parallelize_module(block, mesh, layer_plan(sp))
    return block


# A point's timed rounds stop early once they have taken this long (at least MIN_ROUNDS of them):
# on a machine far slower than the suite was sized for (bf16 layers without bf16 instructions) 24
# rounds of a layer pair took minutes a point.
ROUNDS_BUDGET_S = 30.0
MIN_ROUNDS = 6


def time_layers(torch, device, blocks: dict, x, repeats: int, budget_s: float = ROUNDS_BUDGET_S) -> dict:
    """Forward and backward seconds of each of `blocks` (name -> module) on input `x`, the blocks
    run alternately `repeats` times after one untimed round, fewer (MIN_ROUNDS at least) where the
    timed rounds pass `budget_s`; each time is the slowest rank's (every rank returns the same, so
    every rank stops after the same round)."""
    import torch.distributed as dist

    times = {name: ([], []) for name in blocks}
    for i in range(repeats + 1):
        spent = sum(sum(f) + sum(b) for f, b in times.values())
        if i > MIN_ROUNDS and spent > budget_s:
            break
        for name, block in blocks.items():
            inp = x.detach().requires_grad_()
            dist.barrier()
            device.sync()
            start = time.perf_counter()
            out = block(inp)
            device.sync()
            mid = time.perf_counter()
            out.backward(torch.ones_like(out))
            device.sync()
            end = time.perf_counter()
            # on the device: NCCL and XCCL take no CPU tensor (validate.steps' job_wide does the same)
            pair = torch.tensor([mid - start, end - mid], dtype=torch.float64, device=device.torch_device)
            dist.all_reduce(pair, op=dist.ReduceOp.MAX)
            if i:
                times[name][0].append(float(pair[0]))
                times[name][1].append(float(pair[1]))
    return times


def overhead(times: dict) -> dict:
    """The DTensor layer's extra forward and backward seconds: medians of the per-round differences
    (rounds alternate the two, so a drift of the machine weighs on both alike)."""
    def diff(j):
        return statistics.median(a - b for a, b in zip(times["dtensor"][j], times["megatron"][j]))
    return {"forward_s": diff(0), "backward_s": diff(1)}


def local_input(torch, cfg, mbs: int, group, sp: bool):
    """This rank's share of a seeded fp32 [mbs, seq, hidden] layer input: all of it, or with SP
    its sequence slice."""
    import torch.distributed as dist

    x = torch.randn(mbs, cfg.seq, cfg.hidden, generator=torch.Generator().manual_seed(1))
    if not sp:
        return x
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x[:, rank * cfg.seq // size:(rank + 1) * cfg.seq // size]


def measure_layer(torch, device, group, cfg, sp: bool, mbs: int, dtype, repeats: int) -> dict:
    """Time the DTensor layer and Megatron's on this rank's share of a [mbs, seq, hidden] input
    (sequence-split with SP); the record's fields."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device.torch_device.type)
    dt = dtensor_block(torch, cfg, mesh, sp, dtype, device.torch_device)
    mg = megatron_block(torch, dt, group, sp)
    x = local_input(torch, cfg, mbs, group, sp).to(device=device.torch_device, dtype=dtype)
    times = time_layers(torch, device, {"dtensor": dt, "megatron": mg}, x, repeats)
    med = {name: [statistics.median(v) for v in pair] for name, pair in times.items()}
    return {"times_s": times, "dtensor_s": med["dtensor"], "megatron_s": med["megatron"], **overhead(times)}


def measure_point(torch, device, comm, point, repeats: int = REPEATS) -> dict:
    """The campaign's record of one tp_overhead point (validate.campaign.measure): `stats` over the
    DTensor layer's forward + backward times (what the ledger checks), `reference_stats` over
    Megatron's, `overhead_s` the per-round differences, and their forward/backward medians."""
    import torch.distributed as dist

    from validate.gpt import GPTConfig
    from validate.microbench import Stats, torch_dtype

    d = point.dims
    group = comm.groups[point.group][0] or dist.group.WORLD
    cfg = GPTConfig(1, d["hidden"], d["heads"], d["seq"], vocab=point.group[0])
    rec = measure_layer(torch, device, group, cfg, point.op == "1d_sp", d["mbs"], torch_dtype(torch, point.dtype),
                        repeats)
    totals = {name: [f + b for f, b in zip(*rec["times_s"][name])] for name in ("dtensor", "megatron")}
    return {"stats": Stats(totals["dtensor"]).as_dict(1), "reference_stats": Stats(totals["megatron"]).as_dict(1),
            "overhead_s": [a - b for a, b in zip(totals["dtensor"], totals["megatron"])],
            "forward_overhead_s": rec["forward_s"], "backward_overhead_s": rec["backward_s"]}


def checkpoint_overhead(torch, device, group, cfg, sp: bool, mbs: int, dtype, repeats: int) -> dict:
    """What torch's checkpoint adds to the DTensor layer under full recomputation beyond the one
    forward it recomputes (docs/real-steps-timing.md, "Where the predictions still fall short"):
    the layer with and without checkpoint, same weights, timed alternately. Per round, the extra
    of the checkpointed forward, and of its backward beyond the plain backward plus one plain
    forward (what perfsim prices a recomputation as); medians, and every round's sum."""
    import dataclasses

    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device.torch_device.type)
    blocks = {rc: dtensor_block(torch, dataclasses.replace(cfg, recompute=rc), mesh, sp, dtype, device.torch_device)
              for rc in ("none", "full")}
    x = local_input(torch, cfg, mbs, group, sp).to(device=device.torch_device, dtype=dtype)
    times = time_layers(torch, device, blocks, x, repeats)
    (fn, bn), (ff, bf) = times["none"], times["full"]
    forward = [b - a for a, b in zip(fn, ff)]
    backward = [(b2 - b1) - f1 for f1, b1, b2 in zip(fn, bn, bf)]
    return {"forward_s": statistics.median(forward), "backward_beyond_forward_s": statistics.median(backward),
            "rounds_s": [a + b for a, b in zip(forward, backward)]}


def compare_layers(torch, group, cfg, sp: bool, mbs: int) -> dict:
    """Both layers in fp32 on one input: the largest differences of their outputs, input
    gradients and local weight gradients (the two must compute the same thing for their time
    difference to be DTensor's alone)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, "cpu")
    dt = dtensor_block(torch, cfg, mesh, sp, torch.float32, "cpu")
    mg = megatron_block(torch, dt, group, sp)
    x = local_input(torch, cfg, mbs, group, sp)
    outs, grads = [], []
    for block in (dt, mg):
        inp = x.clone().requires_grad_()
        out = block(inp)
        out = out.to_local() if hasattr(out, "to_local") else out
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append(inp.grad)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    weights = [(local(dt.attn.qkv.weight.grad), mg.qkv_weight.grad), (local(dt.mlp.fc2.weight.grad), mg.fc2_weight.grad)]
    return {"output": float((outs[0] - outs[1]).abs().max()), "input_grad": float((grads[0] - grads[1]).abs().max()),
            "weight_grad": max(float((a - b).abs().max()) for a, b in weights),
            "output_max": float(outs[0].abs().max())}


def main(argv=None) -> int:
    """`python -m validate.tp_overhead OUT.json` as N ranks: per layout, the two layers compared
    in fp32 and a short bf16 timing record, every rank's (tests/test_validate_tp_overhead.py)."""
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.tp_overhead", "", "comma list of 1d, 1d_sp or all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint-shape", default=None, metavar="HIDDEN,HEADS,SEQ,MBS",
                        help="also time what torch's checkpoint adds to the DTensor layer at this shape (bf16)")
    args = parser.parse_args(argv)
    with gloo_ranks(args.timeout) as ranks:
        import torch
        import torch.distributed as dist

        from validate.device import Device
        from validate.gpt import GPTConfig

        cfg = GPTConfig(1, 64, 4, 16, 64)
        device = Device("cpu", ranks.local_rank, 1)
        cases = []
        for layout in TP_OVERHEAD_LAYOUTS if args.cases == "all" else args.cases.split(","):
            sp = layout == "1d_sp"
            same = compare_layers(torch, dist.group.WORLD, cfg, sp, 2)
            record = measure_layer(torch, device, dist.group.WORLD, cfg, sp, 2, torch.bfloat16, args.repeats)
            case = {"same": same, "record": record}
            if args.checkpoint_shape:
                hidden, heads, seq, mbs = (int(v) for v in args.checkpoint_shape.split(","))
                case["checkpoint"] = checkpoint_overhead(torch, device, dist.group.WORLD,
                                                         GPTConfig(1, hidden, heads, seq, 64), sp, mbs,
                                                         torch.bfloat16, args.repeats)
            cases.append({"case": layout, "ranks": every_rank(case)})
        write_on_rank0(ranks, args.out, cases=cases)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
