"""Context parallelism of validate.gpt's GPT: ring attention over the sequence, causal load balancing.

cp ranks share each sequence. It is cut into 2 cp chunks of c = s / (2 cp) tokens and rank i holds
chunks i and 2cp-1-i (`local_positions`), so every rank has s/cp tokens and, with the causal mask,
the same attention work. Everything but the attention core runs on the rank's tokens alone; the
core (`ring_attention`, an autograd Function written here on torch.distributed point-to-point
calls, device-generic: gloo, nccl, xccl) passes the key/value blocks around the ring of the cp group:

- forward: cp steps; at step t the rank holds the keys and values of rank i - t and, while it
  computes its queries' attention against them, sends them on to rank i + 1 and receives the next
  block from rank i - 1 (cp - 1 sends of one block: K and V of s/cp tokens, kv_heads/tp, head_dim;
  with grouped-query attention the fused kernel reads each key/value head for its query group, the
  explicit math expands them per block and sums their gradients back).
  Each (query chunk, key chunk) pair is a block: below the diagonal in full, on it with the causal
  mask, above it skipped. A block runs in the device's fused flash kernel, which returns its
  log-sum-exp (`fused_block_kernels`: the very kernel scaled_dot_product_attention runs on the
  device, CPU, CUDA or XPU, as production ring attention calls flash-attention per block), else
  as explicit math (scores, softmax, two products). The blocks merge with the online softmax: a
  running output and log-sum-exp per query row (`_merge`), so the result is exactly
  softmax(QK^T/sqrt(d)) V.
- backward (Transformer Engine's schedule, AttnFuncWithCPAndKVP2P): the blocks go around the
  other way, starting from the one the forward held last (saved for it), so that a rank's own
  block comes last. Each rank recomputes its blocks' scores from Q, K and the saved log-sum-exp
  (no s x s tensor is kept, as in a flash kernel; the fused kernel's backward given the merged
  output and log-sum-exp). The dK, dV of a block accumulate on the ranks it visits and travel one
  step behind it: at step t a rank sends on the block it holds (t < cp - 1) and the accumulator of
  the block it held at t - 1 (t >= 1), and receives the next block and the accumulator of the
  block it holds now, to which it adds its share once its blocks are done. Every transfer runs
  beside a step's blocks, none after the last: cp transfers, of K and V (the first), K, V and a
  partial dK, dV (the middle ones), dK and dV (the last), 2 (cp - 1) blocks in all, twice the
  forward's bytes (what perfsim prices, perfsim.cost.context_parallel). The one extra tensor it
  keeps is the forward's last block, saved per layer, as Transformer Engine saves it.

Why not torch.distributed.tensor.experimental.context_parallel (present in torch 2.13): it is
experimental, works on DTensors over a DeviceMesh by patching scaled_dot_product_attention's
dispatch, and its kernels are the device's private SDPA ops, so what it sends and computes is
hidden behind torch's internals; a ring of a hundred lines is what the checks can count and reason
about, on every backend.

FLOPs: the blocks' products run as batched matmuls, which validate.instrument counts as they run
(forward 2, backward 5 products a block: the scores recomputed, dP, dV, dQ, dK). The skipped
blocks above the diagonal are what perfsim's convention counts and the kernel does not run
(docs/equations.md 2.1: the full square); `skipped_blocks` tallies them, so a step's count is
comparable with perfsim's.

The gradient of every parameter is partial per cp rank (each saw its own tokens): the training step
all-reduces it over the data- and context-parallel ranks together (Megatron's dp-cp group).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from validate.gpt import causal_bias
from validate.llama import expand_kv
from validate.training import TensorParallelStep, initialise, synthetic_batches

KV_TAG, DKV_TAG = 1, 2  # two messages may go to the same peer in one step (cp = 2): told apart by tag
FORWARD_PRODUCTS, BACKWARD_PRODUCTS = 2, 5  # matrix products a block runs each way


def load_balanced_chunks(cp: int, rank: int) -> tuple:
    """The two of the 2 cp sequence chunks context-parallel rank `rank` holds: i and 2cp-1-i."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq: int, cp: int, rank: int):
    """Positions in the sequence of the s/cp tokens rank `rank` of `cp` holds, in order."""
    if seq % (2 * cp):
        raise ValueError(f"context parallelism of {cp} needs the sequence ({seq}) divisible by 2 x cp = {2 * cp}")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in load_balanced_chunks(cp, rank)])


_tallies = []


@contextlib.contextmanager
def skipped_blocks():
    """Tally of the block products the ring skips (above the causal diagonal) while inside, as
    FLOPs at perfsim's count: {"forward": ..., "backward": ...}. The counted FLOPs of a step plus
    these are the full square perfsim counts."""
    tally = {"forward": 0, "backward": 0}
    _tallies.append(tally)
    try:
        yield tally
    finally:
        _tallies.remove(tally)


def _note_skipped(which: str, q_chunk, k_chunk, products: int) -> None:
    b, heads, c, d = q_chunk.shape
    for tally in _tallies:
        tally[which] += products * 2 * b * heads * c * k_chunk.shape[-2] * d


def _block_scores(q, k, causal: bool):
    """Q K^T / sqrt(d) of one block, [b, heads, c, c], the causal mask added on the diagonal."""
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(1 / math.sqrt(q.shape[-1]))
    if causal:
        scores += causal_bias(q.shape[-2], scores.dtype, scores.device)
    return scores


def fused_block_kernels(q, k=None, ops=None):
    """(forward, backward) of the device's fused causal attention kernel that returns its
    log-sum-exp, for ring blocks of `q`'s device and dtype, or None: the explicit block math then
    runs (_block_scores, softmax, two products).

    - CPU (fp32, bf16): aten._scaled_dot_product_flash_attention_for_cpu and its backward, the
      kernel scaled_dot_product_attention itself runs on a CPU, with the log-sum-exp it keeps for
      backward.
    - CUDA and XPU: the kernel scaled_dot_product_attention picks for the blocks, asked as for a
      training step (torch._fused_sdp_choice, inputs that require grad), through its aten op and
      that op's backward: flash attention (CUDA; XPU where torch has it), memory-efficient attention
      (CUDA, with compute_log_sumexp) or the XPU oneDNN kernel (`overrideable`).
    The explicit math runs elsewhere: other CPU dtypes; a GPU whose choice is the math or cuDNN
    backend (SDPA's switches or priorities changed, shapes no fused kernel takes) or whose torch has
    no kernel of these ops for it; other devices.

    Each forward returns the block's output and its log-sum-exp as _merge takes it, fp32 [b, heads,
    c]; the backward takes the merged ones and gives the merged log-sum-exp to the kernel in the
    layout the kernel's forward returned (memory-efficient attention pads the rows to a multiple of
    32 on CUDA; the XPU kernel adds a trailing dimension of 1), with the forward's random-number
    state (unused: no dropout). `k`: keys of the blocks, fewer heads than `q`'s under grouped-query
    attention (a kernel that takes them as they are is chosen); `ops`: the aten namespace (tests
    substitute stand-ins)."""
    ops = torch.ops.aten if ops is None else ops
    if q.device.type == "cpu":
        if q.dtype not in (torch.float32, torch.bfloat16) or not hasattr(
                ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            return None

        def forward(q, k, v, causal):
            return ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)

        def backward(grad_out, q, k, v, out, lse, causal):
            return ops._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)

        return forward, backward
    backend = sdpa_backend(q, k)
    if backend not in GPU_BLOCK_OPS or not all(_has_kernel(name, DISPATCH_KEYS[q.device.type])
                                               for name in GPU_BLOCK_OPS[backend]):
        return None
    return _gpu_block_kernels(ops, backend)


# scaled_dot_product_attention's backends (torch.nn.attention.SDPBackend's values) a ring block
# runs in on a GPU, with the aten ops (forward, backward) that call the backend's kernel
FLASH, EFFICIENT, OVERRIDEABLE = 1, 2, 4
GPU_BLOCK_OPS = {FLASH: ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
                 EFFICIENT: ("_scaled_dot_product_efficient_attention",
                             "_scaled_dot_product_efficient_attention_backward"),
                 OVERRIDEABLE: ("_scaled_dot_product_fused_attention_overrideable",
                                "_scaled_dot_product_fused_attention_overrideable_backward")}
DISPATCH_KEYS = {"cuda": "CUDA", "xpu": "XPU"}
_QKV_GRADS = [True, True, True, False]  # the gradients a backward returns: dQ, dK, dV, no attention bias's


def _has_kernel(name: str, key: str) -> bool:
    """Whether this torch has aten op `name` with a kernel of its own for dispatch key `key`."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)
    except RuntimeError:  # no such op in this torch
        return False


def sdpa_backend(q, k=None) -> int | None:
    """The backend scaled_dot_product_attention runs causal attention of `q`'s ring blocks (against
    `k`'s, its heads by default) in on its GPU, asked with inputs that require grad (a kernel without
    a backward for the shape is not chosen); None without a choice to ask (no kernels for the
    device, every backend switched off)."""
    key = DISPATCH_KEYS.get(q.device.type)
    if key is None or not _has_kernel("_fused_sdp_choice", key):
        return None
    q_block = _halves(q)[0].detach().requires_grad_()
    k_block = q_block if k is None else _halves(k)[0].detach().requires_grad_()
    grouped = {"enable_gqa": True} if k_block.shape[1] != q_block.shape[1] else {}
    try:
        with torch.enable_grad():
            return int(torch.ops.aten._fused_sdp_choice(q_block, k_block, k_block, None, 0.0, True, **grouped))
    except RuntimeError:
        return None


def _gpu_block_kernels(ops, backend: int):
    """fused_block_kernels' (forward, backward) through the ops of GPU_BLOCK_OPS[backend]."""
    kept = {}  # from the forward, for the backward: the kernel's random-number state and log-sum-exp shape

    def forward(q, k, v, causal):
        if backend == FLASH:
            result = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
            out, lse, rng = result[0], result[1], result[6:8]
        elif backend == EFFICIENT:
            out, lse, *rng = ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        else:
            # the oneDNN kernel computes its log-sum-exp only with grad mode on and an input that
            # requires grad (torch's Attention.cpp); the ring's autograd Function runs with it off
            with torch.enable_grad():
                result = ops._scaled_dot_product_fused_attention_overrideable(
                    *(x.detach().requires_grad_() for x in (q, k, v)), None, 0.0, causal)
            out, lse, rng = result[0].detach(), result[1].detach(), result[6:8]
        kept.update(rng=tuple(rng), lse_shape=tuple(lse.shape))
        return out, lse.flatten(2)[..., :q.shape[-2]]

    def backward(grad_out, q, k, v, out, lse, causal):
        shape = kept["lse_shape"]
        if shape[2] != lse.shape[-1]:  # rows padded: the padding as the kernel leaves it
            lse = torch.cat([lse, lse.new_full((*lse.shape[:-1], shape[2] - lse.shape[-1]), float("inf"))], -1)
        lse = lse.reshape(shape)
        c, ck, rng = q.shape[-2], k.shape[-2], kept["rng"]
        if backend == FLASH:
            return ops._scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, None, None, c, ck,
                                                                    0.0, causal, *rng)
        if backend == EFFICIENT:
            return ops._scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, None, out, lse, *rng, 0.0,
                                                                        _QKV_GRADS, causal)[:3]
        return ops._scaled_dot_product_fused_attention_overrideable_backward(
            grad_out, q, k, v, None, _QKV_GRADS, out, lse, None, None, c, ck, 0.0, causal, *rng)[:3]

    return forward, backward


def _merge(out, lse, block_out, block_lse):
    """The online softmax: a running fp32 output and log-sum-exp per query row merged with one
    block's, as if their keys had been one softmax."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged


class _Ring:
    """This rank's place in the cp group: its index, the group, the ranks it sends to and receives
    from (group indices), its chunks' indices."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def start(self, messages, backward: bool = False) -> list:
        """Send each (tensor, receive buffer, tag) of `messages` on around the ring and receive its
        buffer from the other side, without waiting: forward to the next rank, from the previous
        one; `backward` the other way. One batch: NCCL would deadlock on a send and a receive issued
        apart between two ranks that both send first (cp = 2)."""
        to, source = (self.prev, self.next) if backward else (self.next, self.prev)
        ops = []
        for send, receive, tag in messages:
            ops += [dist.P2POp(dist.isend, send, group=self.group, group_peer=to, tag=tag),
                    dist.P2POp(dist.irecv, receive, group=self.group, group_peer=source, tag=tag)]
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for r in requests:
        r.wait()


def _pairs(ring, owner):
    """(query chunk slot, key chunk slot, causal) of the blocks computed against the key/value
    block of rank `owner`, and the skipped (query slot, key slot) pairs: slot 0 and 1 are a rank's
    first and second chunk."""
    mine, held = load_balanced_chunks(ring.size, ring.rank), load_balanced_chunks(ring.size, owner)
    run, skip = [], []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(held):
            if kc <= qc:
                run.append((qi, ki, kc == qc))
            else:
                skip.append((qi, ki))
    return run, skip


def _halves(x):
    return x.chunk(2, dim=-2)


def _fold_heads(grad, kv_heads: int):
    """A key or value gradient over the query heads summed onto the kv_heads they were expanded from."""
    heads = grad.shape[1]
    return grad if heads == kv_heads else grad.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys and values, [b, heads,
    s/cp, d] each, over the cp group `group` (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, group, fused=True):
        ring = _Ring(group)
        kernels = fused_block_kernels(q, k) if fused else None
        kv = torch.stack([k, v])  # one message a step: keys and values of this rank's s/cp tokens
        q_chunks = _halves(q)
        out = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_chunks]
        lse = [torch.full(c.shape[:-1], float("-inf"), device=q.device) for c in q_chunks]
        for step in range(ring.size):
            last = step == ring.size - 1
            incoming = torch.empty_like(kv) if not last else None
            pending = ring.start([(kv, incoming, KV_TAG)] if not last else [])
            k_chunks, v_chunks = _halves(kv[0]), _halves(kv[1])
            run, skip = _pairs(ring, (ring.rank - step) % ring.size)
            for qi, ki, causal in run:
                if kernels:
                    block_out, block_lse = kernels[0](q_chunks[qi], k_chunks[ki], v_chunks[ki], causal)
                else:  # grouped-query attention: the block's K and V expanded to the query heads
                    k_block, v_block = expand_kv(k_chunks[ki], v_chunks[ki], q.shape[1])
                    scores = _block_scores(q_chunks[qi], k_block, causal)
                    block_lse = torch.logsumexp(scores.float(), dim=-1)
                    probs = torch.exp(scores.float() - block_lse.unsqueeze(-1)).to(v.dtype)
                    block_out = torch.matmul(probs, v_block)
                out[qi], lse[qi] = _merge(out[qi], lse[qi], block_out, block_lse)
            for qi, ki in skip:
                _note_skipped("forward", q_chunks[qi], k_chunks[ki], FORWARD_PRODUCTS)
            _wait(pending)
            if last:
                held_last = kv  # rank i + 1's block: where the backward's ring starts
            kv = incoming
        # laid out [b, s, heads, d] in memory, as a fused kernel's output: the projection's input
        # [b, s, heads x d] is then a view of it, not a copy
        context = torch.cat(out, dim=-2).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, held_last, context, lse)
        ctx.group, ctx.kernels = group, kernels
        return context

    @staticmethod
    def backward(ctx, grad_context):
        q, kv, context, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        grad_context = grad_context.contiguous()
        # D = rowsum(dO * O): the softmax backward's correction term, per query row
        delta = (grad_context.float() * context.float()).sum(-1)
        q_chunks, do_chunks = _halves(q), _halves(grad_context)
        lse_chunks, delta_chunks = _halves(lse.unsqueeze(-1)), _halves(delta.unsqueeze(-1))
        out_chunks, lse_rows = _halves(context), [x.contiguous() for x in lse.chunk(2, dim=-1)]
        dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_chunks]
        scale = 1 / math.sqrt(q.shape[-1])
        done = None  # dK, dV of the block held at the previous step, accumulated so far
        for step in range(ring.size):
            last = step == ring.size - 1
            incoming = torch.empty_like(kv) if not last else None
            arriving = torch.empty_like(kv) if step > 0 else None  # the held block's dK, dV so far
            messages = ([(kv, incoming, KV_TAG)] if not last else []) + (
                [(done.to(kv.dtype), arriving, DKV_TAG)] if step > 0 else [])
            pending = ring.start(messages, backward=True)
            k_chunks, v_chunks = _halves(kv[0]), _halves(kv[1])
            grads = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            dk_chunks, dv_chunks = _halves(grads[0]), _halves(grads[1])
            run, skip = _pairs(ring, (ring.rank + 1 + step) % ring.size)
            for qi, ki, causal in run:
                if ctx.kernels:  # the block's share of the gradients, from the merged output and log-sum-exp
                    dq_b, dk_b, dv_b = ctx.kernels[1](do_chunks[qi], q_chunks[qi], k_chunks[ki], v_chunks[ki],
                                                      out_chunks[qi], lse_rows[qi], causal)
                    dq[qi] += dq_b.float()
                    dk_chunks[ki].add_(dk_b.float())
                    dv_chunks[ki].add_(dv_b.float())
                    continue
                kv_heads = k_chunks[ki].shape[1]
                k_block, v_block = expand_kv(k_chunks[ki], v_chunks[ki], q.shape[1])
                scores = _block_scores(q_chunks[qi], k_block, causal)
                probs = torch.exp(scores.float() - lse_chunks[qi])
                dv = torch.matmul(probs.to(q.dtype).transpose(-2, -1), do_chunks[qi]).float()
                dv_chunks[ki].add_(_fold_heads(dv, kv_heads))
                dprobs = torch.matmul(do_chunks[qi], v_block.transpose(-2, -1))
                dscores = (probs * (dprobs.float() - delta_chunks[qi])).to(q.dtype)
                dq[qi] += torch.matmul(dscores, k_block).float() * scale
                dk = torch.matmul(dscores.transpose(-2, -1), q_chunks[qi]).float()
                dk_chunks[ki].add_(_fold_heads(dk, kv_heads), alpha=scale)
            for qi, ki in skip:
                _note_skipped("backward", q_chunks[qi], k_chunks[ki], BACKWARD_PRODUCTS)
            _wait(pending)
            done = grads if step == 0 else grads.add_(arriving.float())
            kv = incoming
        dkv = done.to(q.dtype)  # after the last step: this rank's own block, every rank's share in it
        return torch.cat(dq, dim=-2).to(q.dtype), dkv[0], dkv[1], None, None


def ring_attention(q, k, v, group, fused=True):
    """validate.gpt's attention core under context parallelism (see RingAttention); `fused`: each
    block in the device's fused kernel where fused_block_kernels has one."""
    return RingAttention.apply(q, k, v, group, fused)


def context_parallelize(gpt, group, fused=True):
    """Make `gpt` (validate.gpt.GPT, flash attention, tensor-parallel or not, without SP) one rank of
    the context-parallel `group`: it takes this rank's s/cp tokens (`local_positions`), adds their
    positions (learned, or rotary: each rank rotates Q and K by its own tokens' places), and runs
    its attention as `ring_attention` over the group (`fused`: its blocks in the device's fused
    kernel where there is one, else the explicit block math)."""
    if gpt.cfg.attention != "flash":
        raise ValueError("context parallelism runs ring attention, a fused kernel: it needs attention = flash")
    if gpt.sp:
        raise ValueError("the harness runs context parallelism without sequence parallelism")
    gpt.set_positions(local_positions(gpt.cfg.seq, dist.get_world_size(group), dist.get_rank(group)))
    for block in gpt.blocks:
        block.attn.core = functools.partial(ring_attention, group=group, fused=fused)
    return gpt


def data_context_groups(device_type: str, tp: int, cp: int, dp: int):
    """(mesh, cp group, dp-cp group) of this rank in Megatron's order, tensor innermost, then
    context, then data (rank = t + tp (c + cp d)). The mesh's "tp" dimension shards the layers; the
    dp-cp group (the ranks with this rank's tensor-parallel index) sums the gradients. Every rank
    calls this (group creation is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    joint = [dist.new_group([t + tp * j for j in range(cp * dp)]) for t in range(tp)]
    return mesh, mesh["cp"].get_group(), joint[dist.get_rank() % tp]


def all_reduce_gradients(module, group, members: int) -> None:
    """Sum every parameter's (local) gradient over `group` in one call and divide by `members`:
    the gradient of the mean loss over the dp x cp ranks' tokens (each rank's loss is its mean).
    A gradient DTensor placed otherwise than its parameter is first brought to the parameter's
    placement (no communication): the vocabulary-parallel embedding's comes out of backward
    Replicate, the whole table on every tensor-parallel rank, and summing that would send tp
    times the bytes of the rank's shard."""
    for p in module.parameters():
        if hasattr(p.grad, "placements") and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()
             if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= members
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class ContextParallelStep(TensorParallelStep):
    """build_step's training step for plans with cp > 1: validate.gpt's GPT with flash attention,
    1d tensor parallelism (no SP) over tp, ring attention over cp, the gradients summed over the
    dp x cp ranks (plain data parallelism, ZeRO 0), pp = 1; it runs as TensorParallelStep does."""

    def __init__(self, plan, model, device, dtype):
        from validate.gpt import GPT, GPTConfig, parallelize
        from validate.optim import MasterAdam
        from validate.timing import context_parallel_problems

        reasons = context_parallel_problems(plan)
        if reasons:
            raise ValueError("; ".join(reasons))
        cfg = GPTConfig.from_spec(model, plan.tp, plan.recompute, plan.attention)
        mesh, cp_group, self.grad_group = data_context_groups(torch.device(device).type, plan.tp, plan.cp, plan.dp)
        with torch.device("meta"):  # sharded before it gets memory, as validate.training.TensorParallelStep
            net = GPT(cfg).to(dtype=dtype)
        if plan.tp > 1:
            parallelize(net, mesh["tp"], False)
        net.to_empty(device=device)
        initialise(net, seed=0)
        self.module = context_parallelize(net, cp_group)
        self.members = plan.dp * plan.cp
        self.optimizer = MasterAdam(net.parameters())
        self.optimizer.init_states()
        rows = plan.microbatches * plan.mbs
        tokens, targets = synthetic_batches(plan.dp * rows, cfg.seq, cfg.vocab)
        mine = slice(mesh.get_local_rank("dp") * rows, (mesh.get_local_rank("dp") + 1) * rows)
        columns = net.positions
        tokens, targets = tokens[mine][:, columns].to(device), targets[mine][:, columns].to(device)
        self.batches = list(zip(tokens.split(plan.mbs), targets.split(plan.mbs)))

    def finish_gradients(self) -> None:
        all_reduce_gradients(self.module, self.grad_group, self.members)


def build_step(plan, model, device, dtype) -> ContextParallelStep:
    """The context-parallel training step of `plan` on this rank (see validate.steps)."""
    return ContextParallelStep(plan, model, device, dtype)
