"""Pipeline parallelism of validate.gpt's GPT with torch.distributed.pipelining.

The layers split evenly over the p v stages (v = vpp chunks per rank), as perfsim assumes
(perfsim.cost.memory.stage_params: L/(p v) layers a stage; the embedding and the position
embedding on the first stage, the final norm and the head on the last; the loss is the
schedule's loss_fn, run on the last stage). Stage s lives on pipeline rank s mod p, so a rank
holds chunks r, r + p, ... (Megatron's interleaving); with v = 1 stage s is rank s.

Schedules: "gpipe" -> ScheduleGPipe, "1f1b" -> Schedule1F1B, "interleaved" ->
ScheduleInterleaved1F1B. The schedule splits the rank's batch into `microbatches` chunks along
the batch dimension; each micro-batch's loss is the mean cross-entropy over its tokens and
`scale_grads=True` divides the accumulated gradients by the micro-batch count, so the step's
gradient is that of the mean loss over the batch, as gradient accumulation in one process gives.

Stages are built from one seeded single-process GPT (its modules are deep-copied into the
stages), so every rank holds exactly the reference's parameters for its layers. Each stage is
given example input and output tensors, so the library infers no shapes at run time (no
metadata messages); its first step still exchanges a one-element "vote" per neighbour
(PipelineStage's warm-up), which the checks count apart from the activations.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from validate.gpt import GPT
from validate.loss import cross_entropy
from validate.training import seeded_gpt, synthetic_batches

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stage_layers(layers: int, stages: int, index: int) -> range:
    """The layers of pipeline stage `index` of `stages` (an even split, as perfsim's L / p)."""
    if layers % stages:
        raise ValueError(f"{layers} layers do not split evenly over {stages} pipeline stages")
    per = layers // stages
    return range(index * per, (index + 1) * per)


class StageModule(nn.Module):
    """One pipeline stage of a GPT: its layers, plus the embeddings on the first stage and the
    final norm and head on the last. Parameter names are the GPT's (`names` maps them)."""

    def __init__(self, gpt: GPT, index: int, stages: int):
        super().__init__()
        self.index, self.stages = index, stages
        self.first, self.last = index == 0, index == stages - 1
        self.layer_ids = list(stage_layers(gpt.cfg.layers, stages, index))
        self.blocks = nn.ModuleList(copy.deepcopy(gpt.blocks[i]) for i in self.layer_ids)
        if self.first:
            self.embed = copy.deepcopy(gpt.embed)
            self.pos = None if gpt.pos is None else nn.Parameter(gpt.pos.detach().clone())  # None: rotary
        if self.last:
            self.ln_f = copy.deepcopy(gpt.ln_f)
            self.head = copy.deepcopy(gpt.head)

    def reference_name(self, name: str) -> str:
        """The GPT parameter name of this stage's parameter `name`."""
        if name.startswith("blocks."):
            _, local, rest = name.split(".", 2)
            return f"blocks.{self.layer_ids[int(local)]}.{rest}"
        return name

    def forward(self, x):
        if self.first:
            x = self.embed(x)
            if self.pos is not None:
                x = x + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.last:
            return self.head(self.ln_f(x))
        return x


def token_loss(logits, targets):
    """Mean next-token cross-entropy of one micro-batch (validate.gpt.GPT.loss's reduction), on
    fp32 logits as Megatron computes the loss (a no-op in an fp32 run)."""
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


class Pipeline:
    """This rank's stages and their schedule for one pipeline of `pp` ranks with `vpp` chunks."""

    def __init__(self, gpt: GPT, pp: int, vpp: int, schedule: str, microbatches: int, mbs: int,
                 rank: int, group=None, device=torch.device("cpu"), dtype=torch.float32,
                 wrap=None, loss_fn=token_loss):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if (schedule == "interleaved") != (vpp > 1):
            raise ValueError("vpp > 1 goes with the interleaved schedule, and only with it")
        if microbatches < pp:
            raise ValueError(f"{microbatches} micro-batches cannot fill {pp} pipeline stages")
        self.pp, self.vpp, self.rank, self.schedule_name = pp, vpp, rank, schedule
        self.microbatches, self.mbs = microbatches, mbs
        cfg = gpt.cfg
        stages = pp * vpp
        self.modules = [StageModule(gpt, c * pp + rank, stages).to(device=device, dtype=dtype) for c in range(vpp)]
        self.wrapped = [wrap(m) if wrap else m for m in self.modules]
        # requires_grad on the examples: the library derives which gradients travel back from it
        activation = torch.zeros(mbs, cfg.seq, cfg.hidden, device=device, dtype=dtype, requires_grad=True)
        tokens = torch.zeros(mbs, cfg.seq, dtype=torch.long, device=device)
        logits = torch.zeros(mbs, cfg.seq, cfg.vocab, device=device, dtype=dtype, requires_grad=True)
        self.stages = [PipelineStage(w, m.index, stages, device,
                                     input_args=tokens if m.first else activation,
                                     output_args=logits if m.last else activation, group=group)
                       for m, w in zip(self.modules, self.wrapped)]
        self.has_first = any(m.first for m in self.modules)
        self.has_last = any(m.last for m in self.modules)
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(self.stages, microbatches, loss_fn=loss_fn, scale_grads=True)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = kind(self.stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)

    def named_parameters(self):
        """(GPT name, parameter) of every parameter this rank holds."""
        for m in self.modules:
            for name, p in m.named_parameters():
                yield m.reference_name(name), p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def step(self, tokens, targets) -> float:
        """Forward and backward of the rank's batch ([microbatches x mbs, seq]); the mean loss on
        the rank holding the last stage, nan elsewhere."""
        losses = [] if self.has_last else None
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        # the losses are all this step needs; kept outputs would hold every micro-batch's logits
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return float("nan")
        return float(torch.stack([x.detach().float() for x in losses]).mean())


class PipelineStep:
    """build_step's TrainingStep for plans with pp > 1 (tp = dp = 1)."""

    def __init__(self, plan, model, device, dtype):
        import torch.distributed as dist

        from validate.optim import MasterAdam

        gpt = seeded_gpt(plan, model, "pp", "validate.pipeline", "pipeline")
        if plan.pp * plan.vpp > model.layers or model.layers % (plan.pp * plan.vpp):
            raise ValueError(f"{model.layers} layers do not split evenly over pp x vpp = {plan.pp * plan.vpp} stages")
        rank = dist.get_rank()
        self.pipeline = Pipeline(gpt, plan.pp, plan.vpp, plan.schedule, plan.microbatches, plan.mbs, rank,
                                 device=device, dtype=dtype)
        self.module = nn.ModuleList(self.pipeline.modules)
        self.optimizer = MasterAdam(self.pipeline.parameters(), lr=1e-3)
        self.optimizer.init_states()
        self.tokens, self.targets = synthetic_batches(plan.microbatches * plan.mbs, model.seq, model.vocab, device)

    def run(self) -> float:
        loss = self.pipeline.step(self.tokens, self.targets)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def build_step(plan, model, device, dtype) -> PipelineStep:
    """The pipeline-parallel training step of `plan` on this rank (see validate.steps)."""
    return PipelineStep(plan, model, device, dtype)

