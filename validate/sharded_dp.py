"""Data parallelism of validate.gpt's GPT by ZeRO stage, with torch's own implementations.

| perfsim zero | here | per step, per data-parallel member |
|---|---|---|
| 0 | DistributedDataParallel (`gradient_as_bucket_view`: the gradients live in the buckets), `no_sync` on all but the last micro-batch | one all-reduce of the gradients (DDP's buckets) |
| 1 | DDP + torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=MasterAdam, parameters_as_bucket_view=True) | DDP's all-reduce, then one broadcast per rank of the parameters it updated (a flat bucket) |
| 2 | FSDP2 `fully_shard(reshard_after_forward=False)` per block, on the word embedding, on the head and at the root; unsharded parameters kept from the first forward to the last backward (`set_reshard_after_backward` off until the last micro-batch) | one all-gather of the parameters, one reduce-scatter of the gradients per micro-batch |
| 3 | FSDP2 `fully_shard(reshard_after_forward=True)`, the same units | per micro-batch: all-gather per unit for forward and again for backward, one reduce-scatter |

torch's ZeRO-1 differs from DeepSpeed's (perfsim's): it all-reduces the whole gradient (DDP)
where DeepSpeed reduce-scatters it, and broadcasts each owner's updated parameters where
DeepSpeed all-gathers the shards; the broadcasts move as many bytes as the all-gather, the
all-reduce twice the reduce-scatter. ZeroRedundancyOptimizer partitions whole parameters
greedily by size, so a rank's optimizer state is close to, not exactly, 1/D of the total.

Gradients are averaged over the data-parallel group (DDP and FSDP2 divide by its size) and each
micro-batch's loss is divided by the micro-batch count, so the step's gradient is that of the
mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
import copy

from validate.gpt import GPT
from validate.pipeline import token_loss
from validate.training import seeded_gpt, synthetic_batches

ZERO = (0, 1, 2, 3)


class DataParallel:
    """One data-parallel replica (or shard) of a GPT and its optimizer, for ZeRO stage `zero`."""

    def __init__(self, gpt: GPT, zero: int, group=None, lr: float = 1e-3, eps: float = 1e-8):
        import torch.distributed as dist

        from validate.optim import MasterAdam

        if zero not in ZERO:
            raise ValueError(f"zero must be one of {ZERO}, got {zero!r}")
        self.zero, self.group = zero, group
        module = copy.deepcopy(gpt)
        if zero <= 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # gradients are views into DDP's communication buckets, as Megatron's gradients live in
            # its contiguous gradient buffer: no second copy of them (perfsim counts one)
            self.module = DDP(module, process_group=group, gradient_as_bucket_view=True)
            self.gpt = self.module.module
            if zero == 0:
                self.optimizer = self.adam = MasterAdam(self.gpt.parameters(), lr=lr, eps=eps)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                # parameters_as_bucket_view: the updated parameters go out in one broadcast per
                # owner (a flat bucket), as DeepSpeed's one all-gather, not one call per parameter
                self.optimizer = ZeroRedundancyOptimizer(self.gpt.parameters(), optimizer_class=MasterAdam,
                                                         process_group=group, parameters_as_bucket_view=True,
                                                         lr=lr, eps=eps)
                self.adam = self.optimizer.optim  # the local MasterAdam over this rank's partition
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            group = group or dist.group.WORLD
            mesh = DeviceMesh.from_group(group, module.embed.weight.device.type)
            # a unit per block, and the word embedding and the head apart from the root: in the root
            # they would stay gathered from the head's backward to the embedding's, through every
            # block's (DeepSpeed's ZeRO-3, and perfsim, gather one module at a time)
            for unit in (*module.blocks, module.embed, module.head):
                fully_shard(unit, mesh=mesh, reshard_after_forward=zero == 3)
            fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3)
            self.module = self.gpt = module
            self.optimizer = self.adam = MasterAdam(module.parameters(), lr=lr, eps=eps)
        self.adam.init_states()
        self.on_forward = None  # test hook: called after each micro-batch's forward, before its backward

    def named_parameters(self):
        return self.gpt.named_parameters()

    def forward_backward(self, tokens, targets, microbatches: int) -> float:
        """Forward and backward of this rank's batch in `microbatches` micro-batches with
        gradient accumulation; the rank's mean loss."""
        total = 0.0
        chunks = list(zip(tokens.chunk(microbatches), targets.chunk(microbatches)))
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            sync = contextlib.nullcontext() if self.zero >= 2 or last else self.module.no_sync()
            if self.zero == 2:  # keep the gathered parameters until the last backward (ZeRO-2)
                self.module.set_reshard_after_backward(last)
            with sync:
                loss = token_loss(self.module(x), y) / len(chunks)
                if self.on_forward is not None:
                    self.on_forward(i)
                loss.backward()
            total += float(loss.detach())
        return total

    def step(self):
        self.optimizer.step()
        # DDP's gradients stay views into its buckets, zeroed in place (as Megatron zeroes its
        # gradient buffer): set to None, the next micro-batch under no_sync would allocate them anew
        self.optimizer.zero_grad(set_to_none=self.zero >= 2)


class DataParallelStep:
    """build_step's TrainingStep for plans with dp > 1 (tp = pp = 1)."""

    def __init__(self, plan, model, device, dtype):
        import torch.distributed as dist

        gpt = seeded_gpt(plan, model, "dp", "validate.sharded_dp", "data-parallel").to(device=device, dtype=dtype)
        self.dp = DataParallel(gpt, plan.zero)
        self.module, self.optimizer = self.dp.module, self.dp.optimizer
        self.microbatches = plan.microbatches
        rows = plan.microbatches * plan.mbs
        tokens, targets = synthetic_batches(plan.dp * rows, model.seq, model.vocab)
        mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)  # moved alone: no other rank's rows
        self.tokens, self.targets = tokens[mine].to(device), targets[mine].to(device)

    def run(self) -> float:
        loss = self.dp.forward_backward(self.tokens, self.targets, self.microbatches)
        self.dp.step()
        return loss


def build_step(plan, model, device, dtype) -> DataParallelStep:
    """The data-parallel training step of `plan` on this rank (see validate.steps)."""
    return DataParallelStep(plan, model, device, dtype)
