"""What every training step of the harness is built from: the seeded GPT of a plan parallel along
one axis, synthetic batches every step and check draw alike, in-place initialisation of a model
materialised from the meta device, and the 1d tensor-parallel step the others extend
(validate.steps dispatches a plan to its step; validate.pipeline, validate.sharded_dp and
validate.context_parallel build theirs from these pieces).
"""

from __future__ import annotations


class TensorParallelStep:
    """One optimizer step of validate.gpt's GPT under 1d tensor parallelism (optionally with SP),
    or unsharded on a single rank (`alone`: on each rank of a larger job, every rank its own copy;
    validate.steps)."""

    def __init__(self, plan, model, device, dtype, alone: bool = False):
        import torch
        import torch.distributed as dist

        from validate.gpt import GPT, GPTConfig, parallelize
        from validate.optim import MasterAdam

        if plan.pp != 1 or plan.dp != 1 or plan.tp_mode != "1d":
            raise ValueError("TensorParallelStep runs 1d tensor parallelism only (pp = dp = 1)")
        cfg = GPTConfig.from_spec(model, plan.tp, plan.recompute, plan.attention)
        if plan.tp == 1 and not alone and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("a plan on one device needs --nproc 1")
        # Built without storage and sharded first, so a rank never holds the whole model
        # (Megatron builds only its shard); then given memory and initialised in place.
        with torch.device("meta"):
            net = GPT(cfg).to(dtype=dtype)
        if plan.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            parallelize(net, init_device_mesh(device.type, (plan.tp,)), plan.sp)
        net.to_empty(device=device)
        initialise(net, seed=0)
        self.module = net
        self.optimizer = MasterAdam(net.parameters())
        self.optimizer.init_states()
        tokens, targets = synthetic_batches(plan.microbatches * plan.mbs, cfg.seq, cfg.vocab, device)
        self.batches = list(zip(tokens.split(plan.mbs), targets.split(plan.mbs)))

    def run(self) -> float:
        total = 0.0
        for tokens, targets in self.batches:
            loss = self.module.loss(tokens, targets) / len(self.batches)
            self.module.backward(loss)
            total += float(loss.detach())
        self.finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def finish_gradients(self) -> None:
        """What the gradients need after the last backward, before the optimizer step."""
        self.module.finish_gradients()


def initialise(module, seed: int) -> None:
    """GPT-style initial values for a model materialised from the meta device: weights N(0, 0.02),
    biases 0, LayerNorm weights 1 (each rank draws its own shard: values differ from an unsharded
    model's, which the timing run does not need)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("bias"):
                local.zero_()
            elif ".ln" in name or name.startswith("ln"):
                local.fill_(1.0)
            else:
                local.copy_(torch.randn(local.shape, generator=g) * 0.02)


def synthetic_batches(rows: int, seq: int, vocab: int, device=None, seed: int = 1):
    """(tokens, next tokens), [rows, seq] each, from a seeded generator: the same on every rank
    that passes the same seed. Every step and check draws its batch here, so all of them see the
    same data however they split it: micro-batch i is rows i mbs ... (i + 1) mbs, and
    data-parallel member r of D takes its block r of D x rows drawn rows. On `device`, or left
    on the host where they are drawn (None) for the caller to take its part and move it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(vocab, (rows, seq + 1), generator=g)
    if device is None:
        return data[:, :-1], data[:, 1:]
    return data[:, :-1].to(device), data[:, 1:].to(device)


def seeded_gpt(plan, model, axis: str, where: str, kind: str):
    """The seed-0 single-process GPT (tp = 1) of a plan parallel along `axis` ("pp" or "dp") alone,
    which validate.pipeline splits into stages and validate.sharded_dp replicates or shards
    (`where` runs `kind`-only plans); ValueError for any other plan."""
    import torch

    from validate.gpt import GPT, GPTConfig

    others = [a for a in ("tp", "pp", "dp") if a != axis]
    if any(getattr(plan, a) != 1 for a in others):
        raise ValueError(f"{where} runs {kind}-only plans ({', '.join(f'{a} = 1' for a in others)})")
    if plan.sp:
        raise ValueError(f"sequence parallelism needs tp > 1; {where} runs tp = 1")
    torch.manual_seed(0)
    return GPT(GPTConfig.from_spec(model, 1, plan.recompute, plan.attention))
