"""What FSDP2 costs per module beyond what perfsim prices: a diagnostic of the ZeRO-2/3 residual.

perfsim prices FSDP2's ZeRO-2 and ZeRO-3 as their collectives at the calibrated speed plus the
copies through its flat buffers (docs/equations.md 6.2). FSDP2 also does host work for every
module in every micro-batch (hooks, allocating and freeing unsharded parameters and gradients)
and overlaps its collectives with compute: its reduce-scatter and its prefetched gathers run
while the next module computes.

This module measures what that costs. `MODULES` GPT layers sharded by `fully_shard` are timed,
forward and backward, alternately against the same layers left whole. The whole layers have the
collectives and copies perfsim prices issued around each of them, serially, through an identity
autograd function before the layer and another after it:
- forward: the shard copied into the all-gather's buffer, the all-gather, and the gathered buffer
  copied out (the layer's parameters are the weights already);
- backward, before the layer's own backward, under ZeRO-3 only: the same gather again;
- backward, after the layer's own backward: the gradients copied into a flat buffer, the
  reduce-scatter, and its output added to the shard of the earlier micro-batch.
Both sides compute the same outputs and input gradients (`compare`; tests/test_validate_zero_overhead.py).
The difference per module and micro-batch is what FSDP2 adds. docs/real-steps-timing.md reports
it on the project's CPU VM: a median of 6 to 27 ms, but its rounds spread wider than the median
itself, because gloo's threads share each rank's one core with the compute they overlap. perfsim
has no per-module key for it until it can be measured as a stable number.

    python -m validate.zero_overhead OUT.json --shape 512,8,256,2 --repeats 12    (as 2 ranks)
"""

from __future__ import annotations

MODULES = 2  # sharded layers under one root, as in a model (the root's own work is shared out)
LAYOUTS = ("zero2", "zero3")  # reshard_after_forward False / True


def _identity_functions(torch):
    """Two identity autograd functions that run a layer's priced data-parallel work: `Before` (the
    forward gather; in backward, after the layer's, the reduce-scatter) and `After` (in backward,
    before the layer's, ZeRO-3's second gather)."""

    class Before(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, work):
            ctx.work = work
            work.gather()
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            ctx.work.scatter()
            return grad, None

    class After(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, work):
            ctx.work = work
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if ctx.work.regather:
                ctx.work.gather()
            return grad, None

    return Before, After


class PricedWork:
    """One layer's flat buffers and the collectives and copies perfsim prices for it
    (`gather`, `scatter`), over `group`."""

    def __init__(self, torch, layer, group, regather: bool):
        import torch.distributed as dist

        self.group, self.regather, self.layer = group, regather, layer
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        params = list(layer.parameters())
        n = -(-sum(p.numel() for p in params) // size) * size  # padded to the group, as FSDP2 pads
        dtype, device = params[0].dtype, params[0].device

        def flat(numel):
            return torch.zeros(numel, dtype=dtype, device=device)
        self.shard, self.gathered, self.unsharded = flat(n // size), flat(n), flat(n)
        self.grads, self.output, self.accumulated = flat(n), flat(n // size), flat(n // size)
        self.send = self.gathered.narrow(0, rank * (n // size), n // size)  # in place, as FSDP2's
        self.shard.fill_(rank + 1)  # so that a gather shows every rank's part
        self.gathers = self.scatters = 0

    def gather(self):
        for p in self.layer.parameters():  # the gradients come anew, as FSDP2's unsharded ones do
            p.grad = None
        self.send.copy_(self.shard)
        self.all_gather(self.gathered, self.send, group=self.group)
        self.unsharded.copy_(self.gathered)
        self.gathers += 1

    def scatter(self):
        self.grads.copy_(self.unsharded)
        self.reduce_scatter(self.output, self.grads, group=self.group)
        self.accumulated.add_(self.output)
        self.scatters += 1


def priced_layers(torch, layers, group, regather: bool):
    """`layers` (unsharded) as one module whose every layer runs inside its PricedWork."""
    Before, After = _identity_functions(torch)
    work = [PricedWork(torch, layer, group, regather) for layer in layers]

    class Priced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.work = layers, work

        def forward(self, x):
            for layer, w in zip(self.layers, work):
                x = After.apply(layer(Before.apply(x, w)), w)
            return x

    return Priced()


def layer_pair(torch, cfg, group, layout: str, dtype, device):
    """(FSDP2's sharded layers, the same layers whole with their priced work), seeded alike."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from validate.gpt import Block

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[Block(cfg) for _ in range(MODULES)]).to(device=device, dtype=dtype)
    sharded = copy.deepcopy(layers)
    mesh = DeviceMesh.from_group(group, device.type)
    for block in sharded:
        fully_shard(block, mesh=mesh, reshard_after_forward=layout == "zero3")
    fully_shard(sharded, mesh=mesh, reshard_after_forward=layout == "zero3")
    return sharded, priced_layers(torch, layers, group, regather=layout == "zero3")


def time_pair(torch, device, group, cfg, layout: str, mbs: int, dtype, repeats: int) -> dict:
    """Both sides timed alternately: their median forward + backward seconds, and FSDP2's extra
    seconds per module and micro-batch (the median of the rounds' differences, and every round's)."""
    import statistics

    from validate.tp_overhead import local_input, time_layers

    sharded, priced = layer_pair(torch, cfg, group, layout, dtype, device.torch_device)
    x = local_input(torch, cfg, mbs, group, False).to(device=device.torch_device, dtype=dtype)
    times = time_layers(torch, device, {"fsdp2": sharded, "priced": priced}, x, repeats)
    totals = {name: [f + b for f, b in zip(*times[name])] for name in times}
    extra = [(a - b) / MODULES for a, b in zip(totals["fsdp2"], totals["priced"])]
    return {"fsdp2_s": statistics.median(totals["fsdp2"]), "priced_s": statistics.median(totals["priced"]),
            "overhead_per_module_s": statistics.median(extra), "rounds_s": extra}


def compare(torch, group, cfg, layout: str, mbs: int) -> dict:
    """Both sides in fp32 on one input: the largest differences of their outputs and input
    gradients (they must compute the same thing for their time difference to be FSDP2's own)."""
    from validate.tp_overhead import local_input

    sharded, priced = layer_pair(torch, cfg, group, layout, torch.float32, torch.device("cpu"))
    out = {}
    for name, module in (("fsdp2", sharded), ("priced", priced)):
        x = local_input(torch, cfg, mbs, group, False).requires_grad_()
        y = module(x)
        y.backward(torch.ones_like(y))
        out[name] = (y.detach(), x.grad)
    work = priced.work[0]
    return {"output": float((out["fsdp2"][0] - out["priced"][0]).abs().max()),
            "input_grad": float((out["fsdp2"][1] - out["priced"][1]).abs().max()),
            "output_scale": float(out["priced"][0].abs().max()),
            "gathers": [w.gathers for w in priced.work], "scatters": [w.scatters for w in priced.work],
            "gathered_parts": sorted({float(v) for v in work.gathered.tolist()})}


def main(argv=None) -> int:
    """`python -m validate.zero_overhead OUT.json` as N ranks: per layout, the two sides compared
    in fp32 at a tiny shape and timed in bf16 at --shape, every rank's record."""
    from validate.ranks import check_parser, every_rank, gloo_ranks, write_on_rank0

    parser = check_parser("python -m validate.zero_overhead", "", "comma list of zero2, zero3 or all")
    parser.add_argument("--shape", default="64,4,16,2", help="HIDDEN,HEADS,SEQ,MBS of the timed layers")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    hidden, heads, seq, mbs = (int(v) for v in args.shape.split(","))
    with gloo_ranks(args.timeout) as ranks:
        import torch
        import torch.distributed as dist

        from validate.device import Device
        from validate.gpt import GPTConfig

        tiny, timed = GPTConfig(MODULES, 64, 4, 16, vocab=1), GPTConfig(MODULES, hidden, heads, seq, vocab=1)
        device = Device("cpu", ranks.local_rank, 1)
        cases = []
        for layout in LAYOUTS if args.cases == "all" else args.cases.split(","):
            same = compare(torch, dist.group.WORLD, tiny, layout, 2)
            timing = time_pair(torch, device, dist.group.WORLD, timed, layout, mbs, torch.bfloat16, args.repeats)
            cases.append({"case": layout, "ranks": every_rank({"same": same, "timing": timing})})
        write_on_rank0(ranks, args.out, cases=cases, shape=args.shape)
    return 0


if __name__ == "__main__":
    from validate.ranks import leave

    leave(main())
