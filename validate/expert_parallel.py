"""The training step of plans with experts (validate.moe's layers): the attention over tp x dp ranks
(data parallel, or 1d + SP tensor parallel), the routed experts folded over ETP x EP x expert-DP of
the same ranks as Megatron-Core folds them (pp = cp = 1 here)."""

from __future__ import annotations

import copy


def plan_ep(plan) -> int:
    return getattr(plan, "ep", 1) or 1


def plan_etp(plan) -> int:
    """Tensor parallelism inside the experts: etp, or the attention's tp where etp is 0."""
    return getattr(plan, "etp", 0) or plan.tp


def expert_groups(ep: int, etp: int = 1):
    """(this rank's EP group, its expert-DP group, its ETP group) of the world's ranks, laid out
    tp-ep-dp as Megatron-Core's expert ranks: ETP groups of etp consecutive ranks, EP groups of ep
    ranks etp apart, an expert-DP group of the ranks at one place in their ETP x EP blocks. Every
    rank makes every group, in one order (torch.distributed.new_group's rule)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    block = ep * etp
    layouts = {"etp": [list(range(start, start + etp)) for start in range(0, world, etp)],
               "ep": [[b + j + i * etp for i in range(ep)] for b in range(0, world, block) for j in range(etp)],
               "edp": [list(range(place, world, block)) for place in range(block)]}
    mine = {}
    for name, groups in layouts.items():
        for members in groups:
            g = dist.new_group(members)
            if rank in members:
                mine[name] = g
    return mine["ep"], mine["edp"], mine["etp"]


def step_problems(plan, model) -> list:
    """What of a plan with experts (or ep > 1) ExpertParallelStep does not run."""
    problems = []
    ep = plan_ep(plan)
    if plan.pp > 1 or getattr(plan, "cp", 1) > 1:
        problems.append("the harness runs experts without pipeline or context parallelism (pp = cp = 1)")
    if plan.tp > 1 and (not plan.sp or plan.dp > 1 or plan.tp_mode != "1d"):
        problems.append("the harness runs experts beside tensor parallelism with 1d + SP and dp = 1 (tp x ep folding)")
    if plan.tp == 1 and plan.sp:
        problems.append("sequence parallelism needs tp > 1")
    if plan.zero:
        problems.append("the harness's expert-parallel step reduces whole gradients (zero = 0)")
    etp = plan_etp(plan)
    if etp not in (1, plan.tp):
        problems.append("the harness's experts are tensor-parallel over the attention's tp ranks or not at all "
                        "(etp = tp or 1)")
    if etp > 1 and getattr(plan, "moe_dispatcher", "alltoall") != "alltoall":
        problems.append("the harness's tensor-parallel experts take the alltoall dispatcher")
    if (plan.tp * plan.dp) % (ep * etp):
        problems.append(f"ep x etp ({ep} x {etp}) must divide the ranks tp x dp ({plan.tp * plan.dp})")
    if model is not None and ep > 1 and (not getattr(model, "experts", 0) or model.experts % ep):
        problems.append(f"ep ({ep}) must divide the model's experts ({getattr(model, 'experts', 0)})")
    return problems


class ExpertParallelStep:
    """One optimizer step of a GPT with experts over tp x dp ranks, the routed experts folded over
    them as EP x expert-DP (`expert_groups`: EP groups of consecutive ranks, tp innermost).

    dp > 1 (tp = 1): each rank its own rows (micro-batch rows r x rows ... of the global batch), the
    attention and the other dense parameters replicated. Gradients live in one flat buffer per
    reduction group (dense: every rank; experts: the expert-DP group), as Megatron-Core's gradient
    buffers, scaled by 1 / dp and all-reduced after the last micro-batch (Megatron-Core's DDP
    without overlap: the dense gradients' mean over the data-parallel ranks, the experts' sum over
    their expert-DP ranks over dp, since each expert saw tokens of all its EP group's ranks).

    tp > 1 (1d + SP, dp = 1): Megatron-Core's folding of the attention's tensor-parallel ranks
    into expert-tensor- and expert-parallel ones (etp = tp, Megatron-Core's default, with ep 1;
    or etp 1): validate.gpt.parallelize shards the attention (and the shared expert) as for a
    dense model, each rank's MoE routes its sequence shard's tokens (validate.gpt.layer_plan);
    the dense gradients are finished as a tensor-parallel model's (validate.gpt.GPT.finish_gradients:
    the sequence-parallel ones and the routers summed), the experts' summed over their expert-DP
    group (tp / (ep etp) ranks)."""

    def __init__(self, plan, model, device, dtype, reference=None):
        import torch
        import torch.distributed as dist

        from validate.gpt import GPT, GPTConfig, parallelize
        from validate.moe import moe_layers
        from validate.optim import MasterAdam
        from validate.training import synthetic_batches

        problems = step_problems(plan, model)
        if problems:
            raise ValueError("; ".join(problems))
        if dist.get_world_size() != plan.tp * plan.dp:
            raise ValueError(f"the plan runs on {plan.tp * plan.dp} ranks, the job has {dist.get_world_size()}")
        self.ep, self.dp, self.tp, self.etp = plan_ep(plan), plan.dp, plan.tp, plan_etp(plan)
        if reference is None:
            torch.manual_seed(0)
            reference = GPT(GPTConfig.from_spec(model, plan.tp, plan.recompute, plan.attention))
        net = copy.deepcopy(reference).to(device=device, dtype=dtype)
        if self.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            parallelize(net, init_device_mesh(device.type, (self.tp,)), plan.sp)
        self.ep_group, self.edp_group, etp_group = expert_groups(self.ep, self.etp)
        if self.ep > 1 or self.etp > 1:
            for layer in moe_layers(net):
                layer.shard(self.ep_group, getattr(plan, "moe_dispatcher", "alltoall") or "alltoall", etp_group)
        self.module = net
        self._buffers = self._gradient_buffers()
        self.optimizer = MasterAdam(self.module.parameters())
        self.optimizer.init_states()
        rows = plan.microbatches * plan.mbs
        tokens, targets = synthetic_batches(plan.dp * rows, model.seq, model.vocab)
        member = dist.get_rank() // self.tp  # data-parallel member (tp innermost)
        mine = slice(member * rows, (member + 1) * rows)
        self.batches = list(zip(tokens[mine].to(device).split(plan.mbs), targets[mine].to(device).split(plan.mbs)))

    def _gradient_buffers(self) -> list:
        """[(flat buffer, group or None, scale)]: the dense gradients' (dp > 1) and the experts',
        each parameter's .grad a view into its buffer (backward accumulates in place). Under
        tensor parallelism the dense gradients are DTensors, finished by the model."""
        import torch.distributed as dist

        from validate.moe import is_expert_parameter

        dense = [p for n, p in self.module.named_parameters() if not is_expert_parameter(n)]
        experts = [p for n, p in self.module.named_parameters() if is_expert_parameter(n)]
        groups = [(experts, self.edp_group, self.tp * self.dp // (self.ep * self.etp))]
        if self.tp == 1:
            groups.insert(0, (dense, dist.group.WORLD, self.dp))
        out = []
        for params, group, size in groups:
            if not params:
                continue
            flat = params[0].new_zeros(sum(p.numel() for p in params))
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            out.append((flat, group if size > 1 else None, 1.0 / self.dp))
        return out

    def forward_backward(self) -> float:
        total = 0.0
        for tokens, targets in self.batches:
            loss = self.module.loss(tokens, targets) / len(self.batches)
            loss.backward()
            total += float(loss.detach())
        return total

    def finish_gradients(self) -> None:
        import torch.distributed as dist

        if self.tp > 1:
            self.module.finish_gradients()
        for flat, group, scale in self._buffers:
            flat.mul_(scale)
            if group is not None:
                dist.all_reduce(flat, group=group)

    def run(self) -> float:
        loss = self.forward_backward()
        self.finish_gradients()
        self.optimizer.step()
        for flat, _, _ in self._buffers:
            flat.zero_()
        if self.tp > 1:  # the DTensor gradients, as a tensor-parallel step drops them
            from validate.moe import is_expert_parameter

            for n, p in self.module.named_parameters():
                if not is_expert_parameter(n):
                    p.grad = None
        return loss


def build_step(plan, model, device, dtype) -> ExpertParallelStep:
    """The expert-parallel (or data-parallel MoE) training step of `plan` on this rank (validate.steps)."""
    return ExpertParallelStep(plan, model, device, dtype)
