"""A mixture-of-experts layer for validate.gpt's model, with expert parallelism over
torch.distributed, as Megatron-Core runs it (MoELayer with the alltoall or allgather token
dispatcher and TEGroupedMLP / SequentialMLP experts). validate.expert_parallel builds the
training step of plans with experts.

One layer, on the T = b s tokens of this rank's micro-batch:

| step | here | Megatron-Core |
|---|---|---|
| router | `router`: a linear layer hidden -> experts, no bias: the logits [T, E] | TopKRouter.gating |
| top-k | the k experts of each token (`routing`, below), their logits' softmax (fp32, cast back) | topk_softmax_with_capacity, pre-softmax off (the default) |
| permutation | the (token, slot) pairs sorted by expert, stable (a token's copies in token order within each expert): index_select of the tokens and of the probabilities | moe_utils.permute (routing map, index_select) |
| dispatch | alltoall: all_to_all_single of the permuted tokens and probabilities over the EP group with per-rank split sizes, then the received chunks regrouped from [source rank][local expert] to [local expert][source rank]; allgather: all-gather of every EP rank's tokens and probabilities, each rank taking its local experts' rows | MoEAlltoAllTokenDispatcher (all_to_all, sort_chunks_by_idxs) / MoEAllGatherTokenDispatcher |
| expert TP | with etp > 1: the received copies and probabilities all-gathered over the ETP group, each member computing its FC1 columns and FC2 rows of every member's copies, the partial outputs reduce-scattered back | the dispatcher's gather and reduce-scatter over the expert-tensor-parallel group |
| experts | E / ep local experts, each FC1 -> activation x probability -> FC2, one GEMM pair per expert on its rows (a loop: SequentialMLP's GEMMs, the grouped GEMM's FLOPs) | TEGroupedMLP: the probability applied after the activation (weighted_bias_swiglu) |
| combine | the reverse: regroup, all_to_all_single back (alltoall) / reduce-scatter (allgather) | token_combine |
| unpermutation | the expert outputs added into their tokens' rows (index_add) | moe_utils.unpermute (scatter_add) |
| shared expert | an MLP of shared_expert_ffn columns on every token, added | SharedExpertMLP (no gate) |

The all-to-all is an autograd Function (`all_to_all`) whose backward is the reverse all-to-all
(the split sizes swapped), as Megatron-Core's _AllToAll; the all-gather's backward is a
reduce-scatter and the reduce-scatter's an all-gather. Every tensor is made on the tokens' device,
so the layer runs on gloo, NCCL and XCCL alike (validate.device_consistency checks it on a CPU).

Routing (`GPTConfig.routing`):
- "balanced" (the default): Megatron-Core's benchmark mode (moe_router_force_load_balancing),
  made exact: token t's slot j goes to expert (t k + j) mod E, so every expert gets T k / E of a
  micro-batch's tokens (when E divides T k) and every EP rank as many, whatever the weights.
  Megatron-Core draws random logits for it, balanced only on average; the exact balance is what
  lets the counted FLOPs and all-to-all bytes equal perfsim's at moe.imbalance = 1. The
  probabilities are still the softmax of the router's logits at the chosen experts, so the router
  trains as under top-k routing.
- "topk": the k largest logits, as a model routes in training; the split sizes then differ from
  rank to rank and step to step (the counts are exchanged in an all-gather of E integers a rank,
  metadata perfsim does not price). The exactness tests use it to check uneven splits.

What each piece keeps for backward, per routed token copy (T k of them in all, over the EP ranks;
per expert its own rows): the expert's FC1 input (hidden, the received tokens), the SwiGLU's input
(2 expert_ffn) and the token's probability, FC2's input (expert_ffn); the router keeps its input
(the pre-MLP norm's output, shared with the permutation, which keeps only indices) and the
top-k softmax's fp32 output [T, k]; the all-to-alls, regrouping and unpermutation keep nothing
but integer indices. Capacity factors (dropped tokens) are not run: the harness is dropless.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from validate import llama

ROUTING = ("balanced", "topk")
DISPATCHERS = ("alltoall", "allgather")


def _all_to_all(x, group, output_splits, input_splits):
    import torch.distributed as dist

    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single with per-rank split sizes (rows of dimension 0); backward sends each
    gradient row back to the rank its row came from: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


def all_to_all(x, group, output_splits, input_splits):
    """Rows input_splits[r] of `x` to rank r of `group`, rows output_splits[r] from it (autograd)."""
    return AllToAll.apply(x, group, list(output_splits), list(input_splits))


def _all_gather(x, group):
    import torch.distributed as dist

    out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group):
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherScatter(torch.autograd.Function):
    """All-gather along dimension 0 (equal parts) whose backward is the reduce-scatter of the
    gradient (`gather`), or the reduce-scatter (sum) whose backward is the all-gather."""

    @staticmethod
    def forward(ctx, x, group, gather: bool):
        ctx.group, ctx.gather = group, gather
        return (_all_gather if gather else _reduce_scatter)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter if ctx.gather else _all_gather)(grad, ctx.group), None, None


class _Unpermute(torch.autograd.Function):
    """Rows of `x` added into rows `index` of a [tokens, hidden] zero tensor (scatter_add, as
    Megatron-Core's unpermute); backward reads the gradient's rows back (index_select), keeping
    the index alone (torch's index_add keeps its source too)."""

    @staticmethod
    def forward(ctx, x, index, tokens):
        ctx.save_for_backward(index)
        return x.new_zeros((tokens,) + tuple(x.shape[1:])).index_add_(0, index, x)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def unpermute(x, index, tokens: int):
    return _Unpermute.apply(x, index, tokens)


class _WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * probability of FC1's interleaved output (validate.llama's layout), keeping
    that input and the probabilities alone (Megatron-Core's weighted_bias_swiglu)."""

    @staticmethod
    def forward(ctx, x, probs):
        ctx.save_for_backward(x, probs)
        return (llama.swiglu(x) * probs.unsqueeze(-1)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, probs = ctx.saved_tensors
        with torch.enable_grad():
            xd, pd = x.detach().requires_grad_(), probs.detach().requires_grad_()
            y = llama.swiglu(xd) * pd.unsqueeze(-1)
        dx, dp = torch.autograd.grad(y, (xd, pd), grad)
        return dx, dp


def _weighted(activation: str, h, probs):
    """The expert's activation times each row's probability."""
    if activation == "swiglu":
        return _WeightedSwiGLU.apply(h, probs)
    return llama.ACTIVATIONS.get(activation, F.gelu)(h) * probs.unsqueeze(-1)


def balanced_counts(tokens: int, topk: int, experts: int) -> list:
    """Token copies each expert gets from `tokens` tokens under balanced routing: the n in
    [0, tokens topk) with n mod experts = e."""
    n = tokens * topk
    return [(n - e + experts - 1) // experts for e in range(experts)]


class MoE(nn.Module):
    """The mixture-of-experts FFN of one layer (module doc), under the MLP's name in a Block.
    `make_mlp(ffn)` builds an MLP of `ffn` columns (validate.gpt.MLP): each expert and the shared
    expert. Built with every expert; `shard` keeps this rank's."""

    def __init__(self, cfg, make_mlp):
        super().__init__()
        if cfg.routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {cfg.routing!r}")
        if cfg.bias:
            raise ValueError("the harness's experts have no biases (bias = false)")
        self.experts_total, self.topk, self.routing = cfg.experts, cfg.topk, cfg.routing
        self.activation = cfg.activation
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(make_mlp(cfg.expert_ffn) for _ in range(cfg.experts))
        self.shared = make_mlp(cfg.shared_expert_ffn) if cfg.shared_expert_ffn else None
        self.group, self.ep, self.ep_rank, self.dispatcher = None, 1, 0, "alltoall"
        self.etp_group, self.etp = None, 1

    @property
    def local_experts(self) -> int:
        return self.experts_total // self.ep

    def shard(self, group, dispatcher: str = "alltoall", etp_group=None) -> None:
        """Keep the experts of this rank of the expert-parallel `group` (rank r: experts
        r E/ep ... (r+1) E/ep - 1, Megatron-Core's), dispatching with `dispatcher`; with an
        expert-tensor-parallel `etp_group`, member j keeps columns j/etp of each expert's FC1
        (whole gate and up pairs) and the matching rows of its FC2 input, as Megatron-Core's
        column- and row-parallel expert GEMMs."""
        import torch.distributed as dist

        if dispatcher not in DISPATCHERS:
            raise ValueError(f"moe_dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.experts_total % ep:
            raise ValueError(f"experts ({self.experts_total}) must divide by ep={ep}")
        self.group, self.ep, self.ep_rank, self.dispatcher = group, ep, rank, dispatcher
        mine = self.experts_total // ep
        self.experts = nn.ModuleList(list(self.experts)[rank * mine:(rank + 1) * mine])
        etp = dist.get_world_size(etp_group) if etp_group is not None else 1
        if etp > 1:
            if dispatcher != "alltoall" or self.routing != "balanced":
                raise ValueError("the harness's tensor-parallel experts take the alltoall dispatcher and balanced "
                                 "routing (equal rows on every expert-tensor-parallel rank)")
            j = dist.get_rank(etp_group)
            for expert in self.experts:
                rows, cols = expert.fc1.weight.shape[0] // etp, expert.fc2.weight.shape[1] // etp
                expert.fc1.weight = nn.Parameter(expert.fc1.weight.detach()[j * rows:(j + 1) * rows].clone())
                expert.fc2.weight = nn.Parameter(expert.fc2.weight.detach()[:, j * cols:(j + 1) * cols].clone())
            self.etp_group, self.etp = etp_group, etp

    def route(self, logits):
        """(experts [T, k], probabilities [T, k]) of each token's k slots (module doc)."""
        t, k, e = logits.shape[0], self.topk, self.experts_total
        if self.routing == "balanced":
            slots = torch.arange(t * k, device=logits.device).view(t, k)
            chosen = slots % e
        else:
            chosen = logits.topk(k, dim=-1).indices
        # the chosen logits by index_select (keeps the indices; gather would keep the logits, as
        # torch.topk's values do not)
        rows = torch.arange(t, device=logits.device).unsqueeze(1) * e
        picked = logits.reshape(-1).index_select(0, (rows + chosen).reshape(-1)).view(t, k)
        probs = torch.softmax(picked, dim=-1, dtype=torch.float32).type_as(logits)
        return chosen, probs

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        t, k, e = tokens.shape[0], self.topk, self.experts_total
        chosen, probs = self.route(self.router(tokens))
        if self.ep > 1 and self.dispatcher == "allgather":  # permuted after the gather (_allgather)
            return self._shared(self._allgather(tokens, chosen, probs), x)
        flat = chosen.reshape(-1)  # token-major: pair n is token n // k, slot n % k
        order = torch.argsort(flat, stable=True)  # expert-major, tokens in order within an expert
        token_of = order // k
        permuted = tokens.index_select(0, token_of)
        permuted_probs = probs.reshape(-1).index_select(0, order)
        if self.routing == "balanced":
            counts = balanced_counts(t, k, e)
        else:
            counts = torch.bincount(flat, minlength=e).tolist()
        if self.ep == 1 and self.etp == 1:
            out = self._experts(permuted, permuted_probs, counts)
        else:
            out = self._alltoall(permuted, permuted_probs, counts)
        combined = unpermute(out, token_of, t)
        return self._shared(combined, x)

    def _shared(self, routed, x):
        out = routed.view(x.shape)
        return out + self.shared(x) if self.shared is not None else out

    def _experts(self, rows, probs, per_expert):
        """Each local expert on its rows (`per_expert` rows each, in expert order)."""
        outs = []
        for expert, x, p in zip(self.experts, rows.split(per_expert), probs.split(per_expert)):
            hidden = _weighted(self.activation, F.linear(x, expert.fc1.weight), p)
            outs.append(F.linear(hidden, expert.fc2.weight))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _exchange_counts(self, counts: list) -> list:
        """Every EP rank's counts per expert ([ep][E]): known in advance under balanced routing
        (every rank routes alike), else all-gathered."""
        import torch.distributed as dist

        if self.routing == "balanced":
            return [counts] * self.ep
        mine = torch.tensor(counts, dtype=torch.int64).to(self.router.weight.device)
        every = mine.new_empty(self.ep * len(counts))
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every.view(self.ep, len(counts)).tolist()

    def _alltoall(self, permuted, permuted_probs, counts):
        """MoEAlltoAllTokenDispatcher: the copies to their EP rank (all_to_all), with tensor-parallel
        experts all-gathered over the ETP group (every member computes its columns of every
        member's copies), regrouped by local expert; after the experts the reverse (regroup,
        reduce-scatter over ETP, all_to_all back)."""
        local, me = self.local_experts, self.ep_rank
        every = self._exchange_counts(counts)
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(self.ep)]
        received = [every[src][me * local:(me + 1) * local] for src in range(self.ep)]  # [src][local expert]
        recv = [sum(c) for c in received]
        rows, probs = permuted, permuted_probs
        if self.ep > 1:
            rows = all_to_all(permuted, self.group, recv, send)
            probs = all_to_all(permuted_probs, self.group, recv, send)
        if self.etp > 1:  # balanced routing: every ETP member received alike
            rows, probs = (_GatherScatter.apply(x, self.etp_group, True) for x in (rows, probs))
            received = received * self.etp  # [member, src][local expert]
        chunks = len(received)
        by_source = [c for src in range(chunks) for c in received[src]]
        by_expert = [received[src][j] for j in range(local) for src in range(chunks)]
        if local > 1 and chunks > 1:  # [source][expert] -> [expert][source] (sort_chunks_by_idxs)
            rows, probs = (_regroup(x, by_source, chunks, local) for x in (rows, probs))
        out = self._experts(rows, probs, [sum(received[src][j] for src in range(chunks)) for j in range(local)])
        if local > 1 and chunks > 1:
            out = _regroup(out, by_expert, local, chunks)
        if self.etp > 1:  # each member's copies, its partial sums added over the members' columns
            out = _GatherScatter.apply(out, self.etp_group, False)
        return all_to_all(out, self.group, send, recv) if self.ep > 1 else out

    def _allgather(self, tokens, chosen, probs):
        """MoEAllGatherTokenDispatcher: every EP rank's tokens, slots and probabilities gathered;
        this rank runs its local experts on every gathered token routed to them, the partial
        outputs [ep T, hidden] reduce-scattered back to each rank's T tokens."""
        local, me, k = self.local_experts, self.ep_rank, self.topk
        every_tokens = _GatherScatter.apply(tokens, self.group, True)
        every_probs = _GatherScatter.apply(probs, self.group, True)
        every_chosen = _all_gather(chosen, self.group)
        flat = every_chosen.reshape(-1)
        lo = me * local
        mine = ((flat >= lo) & (flat < lo + local)).nonzero().squeeze(1)
        order = mine.index_select(0, torch.argsort(flat.index_select(0, mine), stable=True))
        token_of = order // k
        rows = every_tokens.index_select(0, token_of)
        row_probs = every_probs.reshape(-1).index_select(0, order)
        counts = torch.bincount(flat.index_select(0, order) - lo, minlength=local).tolist()
        out = self._experts(rows, row_probs, counts)
        partial = unpermute(out, token_of, every_tokens.shape[0])
        return _GatherScatter.apply(partial, self.group, False)


def _regroup(x, sizes: list, outer: int, inner: int):
    """Chunks of `sizes` laid out [outer][inner], returned laid out [inner][outer]."""
    chunks = x.split(sizes)
    return torch.cat([chunks[o * inner + i] for i in range(inner) for o in range(outer)])


def moe_layers(gpt):
    """The MoE modules of a validate.gpt GPT, in layer order."""
    return [b.mlp for b in gpt.blocks if isinstance(b.mlp, MoE)]


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight (sharded over EP; reduced over expert-DP), by its module path."""
    return ".mlp.experts." in f".{name}"

