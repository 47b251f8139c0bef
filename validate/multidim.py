"""A small GPT whose layers run real 2D (SUMMA, Optimus), 2.5D (Tesseract) and 3D (Bian et al.,
as in Colossal-AI) tensor parallelism, written as torch.autograd.Functions over process groups,
laid out as perfsim's cost model lays them out (perfsim/cost/tensor_parallel.py,
docs/equations.md section 4; docs/real-steps-multidim.md states every convention).

The grid comes from perfsim: `layout_of(model, columns_of(plan)).axes` gives each axis's size and
its stride inside the tensor-parallel group; a rank's coordinate on an axis is
(rank // stride) % size, and one process group is built for every line of the grid along each
axis (plus, in 3d, the two planes that share a hidden block).

2d / 2.5d, device (r, c, k): r = its coordinate on the `col` axis (the group of one grid column,
whose members differ in the row index), c = its coordinate on `row`, k on `depth`. Activations
[T/(dq), h/q]: token rows block k q + r (whole sequences), hidden block c. Weight blocks
W(r, c) = [h_in/q, h_out/q], replicated over depth. Linears run SUMMA (forward: q broadcasts of
X along `row` and of W along `col`; backward: broadcast W / reduce dX, broadcast X / reduce dW;
2.5d all-reduces dW over `depth`).

3d, device (a, w, o) on the `input`, `weight`, `output` axes. A linear has an `into` and an
`out` axis ((input, output) for QKV, FC1 and the head, swapped for the attention output and FC2).
X block [T/q^2, h_in/q]: rows super-block w, sub-block coord(into); hidden block coord(out).
W block [h_in/q^2, h_out/q]: h_in block coord(out), sub-chunk w; h_out block coord(into).
Forward all-gathers X over `into` and W over `weight`, reduce-scatters Y over `out`; backward
all-gathers dY over `out`, reduce-scatters dX over `into` and dW over `weight`, using the gathered
X and W kept from the forward (or gathering them again with `regather`, perfsim's tp_regather).

A Llama-shaped config (validate.llama) lays QKV's columns out by query group and FC1's gate and
up columns in pairs, so every column block holds whole groups and whole pairs (kv_heads divisible
by q); its RMSNorm all-reduces one per-token statistic each way, the sum of squares forward.

Vectors (biases, LayerNorm gamma/beta, position embedding) are split w ways like everything else
(perfsim.cost.memory.stage_params) and all-gathered over the devices that share the hidden block
they multiply (`col` in 2d/2.5d, a plane in 3d); their gradients are reduce-scattered back (and
all-reduced over `depth` in 2.5d). LayerNorm all-reduces the per-token sum and sum of squares
(fp32, one all-reduce of [tokens, 2]) over the axis that splits the hidden dimension, and in
backward the two per-token sums of its gradient. The attention core is local (whole sequences,
heads/q heads). The word embedding is vocabulary-parallel (2d/2.5d: vocabulary split over `col`,
partial lookups reduce-scattered over `col`; 3d: as the reference, weight all-gathered over
`weight`, output reduce-scattered over `input`), the LM head is a linear h -> V followed by a
vocabulary-parallel cross-entropy (max, target logit and sum of exponentials all-reduced over
the axis that splits the vocabulary).

Every collective runs inside `tag(...)`: None for what perfsim's layer and head collectives
model (priced in bf16), "stats" for the fp32 statistics, "param" for the vector gathers and
their gradients, "embedding" for the embedding's collectives; validate/multidim_check.py
classifies what it counts by these tags.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from validate.gpt import ATTENTION_CORES, GPT, GROUPED_CORES, RECOMPUTE, GPTConfig, mlp_activation
from validate.llama import NORM_EPS, Rotary, grouped_qkv
from validate.loss import cross_entropy

MODES = ("2d", "2.5d", "3d")
PLANES = {"3d": (("input", "weight"), ("weight", "output"))}
_TAG = contextvars.ContextVar("multidim_collective_tag", default=None)


@contextlib.contextmanager
def tag(name):
    """What the collectives issued inside are, for the counter (see module doc)."""
    token = _TAG.set(name)
    try:
        yield
    finally:
        _TAG.reset(token)


def current_tag():
    return _TAG.get()


# ----------------------------------------------------------------------------------------------
# The grid


class Grid:
    """This rank's coordinates on the mode's grid and the process groups of its axes and planes."""

    def __init__(self, mode: str, q: int, depth: int, axes: dict, rank: int):
        self.mode, self.q, self.depth = mode, q, depth
        self.axes = {a: (int(s), int(st)) for a, (s, st) in axes.items()}
        self.size = math.prod(s for s, _ in self.axes.values())
        self.rank = rank
        self.coord = {a: (rank // st) % s for a, (s, st) in self.axes.items()}
        self.groups, self.ranks = {}, {}
        families = [((a,), self.axes) for a in self.axes] + [(p, self.axes) for p in PLANES.get(mode, ())]
        for names, _ in families:  # every rank creates every group, in the same order
            key = "+".join(names)
            for members in self._lines(names):
                group = dist.new_group(members)
                if rank in members:
                    self.groups[key], self.ranks[key] = group, members

    def _lines(self, names):
        """Rank lists of the lines (one axis) or planes (two) of the grid, in increasing rank (for
        one axis that is increasing coordinate, the position the SUMMA steps name)."""
        others = [a for a in self.axes if a not in names]
        out = []
        for base_coords in _product([range(self.axes[a][0]) for a in others]):
            base = sum(c * self.axes[a][1] for a, c in zip(others, base_coords))
            # sorted: a process group numbers its members by global rank, and collectives
            # (all-gather order, chunk positions) follow that numbering
            out.append(sorted(base + sum(c * self.axes[a][1] for a, c in zip(names, cs))
                              for cs in _product([range(self.axes[a][0]) for a in names])))
        return out

    def position(self, key: str) -> int:
        return self.ranks[key].index(self.rank)

    def group_size(self, key: str) -> int:
        return len(self.ranks[key])

    # collectives on a named axis or plane, each counted under the current tag
    def broadcast(self, t, key, src_position):
        dist.broadcast(t, src=self.ranks[key][src_position], group=self.groups[key])
        return t

    def reduce(self, t, key, dst_position):
        dist.reduce(t, dst=self.ranks[key][dst_position], group=self.groups[key])
        return t

    def all_reduce(self, t, key, op=dist.ReduceOp.SUM):
        if self.group_size(key) > 1:
            dist.all_reduce(t, op=op, group=self.groups[key])
        return t

    def all_gather(self, t, key):
        """Concatenate the members' tensors along dim 0 (in the group's order)."""
        g = self.group_size(key)
        if g == 1:
            return t
        out = torch.empty((g * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.groups[key])
        return out

    def reduce_scatter(self, t, key):
        """Sum over the members and keep this member's chunk of dim 0."""
        g = self.group_size(key)
        if g == 1:
            return t
        out = torch.empty((t.shape[0] // g,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t.contiguous(), group=self.groups[key])
        return out


def _product(ranges):
    out = [()]
    for r in ranges:
        out = [prefix + (x,) for prefix in out for x in r]
    return out


def grid_for(plan, model, rank: int) -> Grid:
    """The grid perfsim lays out for `plan` (axes and strides from perfsim's layout)."""
    from perfsim.cost.columns import columns_of
    from perfsim.cost.tensor_parallel import layout_of

    layout = layout_of(model, columns_of(plan))
    return Grid(plan.tp_mode, int(layout.q), int(layout.depth), layout.axes, rank)


# ----------------------------------------------------------------------------------------------
# Autograd functions


class _Summa(torch.autograd.Function):
    """Y(r, c) = sum_t X(r, t) W(t, c) on a q x q grid (one depth slice), 2.5d's dW summed over depth."""

    @staticmethod
    def forward(ctx, x, w, grid):
        q, r, c = grid.q, grid.coord["col"], grid.coord["row"]
        y = x.new_zeros(x.shape[0], w.shape[1])
        for t in range(q):
            xt = x.contiguous() if c == t else x.new_empty(x.shape)
            wt = w.detach().contiguous() if r == t else w.new_empty(w.shape)
            with tag(None):
                grid.broadcast(xt, "row", t)
                grid.broadcast(wt, "col", t)
            y += xt @ wt
        ctx.grid = grid
        ctx.save_for_backward(x, w)
        return y

    @staticmethod
    def backward(ctx, dy):
        grid = ctx.grid
        x, w = ctx.saved_tensors
        q, r, c = grid.q, grid.coord["col"], grid.coord["row"]
        dy = dy.contiguous()
        dx = dw = None
        with tag(None):
            for t in range(q):  # dX(r, t) = sum_c dY(r, c) W(t, c)^T
                wt = w.detach().contiguous() if r == t else w.new_empty(w.shape)
                grid.broadcast(wt, "col", t)
                part = dy @ wt.t()
                grid.reduce(part, "row", t)
                if c == t:
                    dx = part
            for t in range(q):  # dW(t, c) = sum_r X(r, t)^T dY(r, c)
                xt = x.contiguous() if c == t else x.new_empty(x.shape)
                grid.broadcast(xt, "row", t)
                part = xt.t() @ dy
                grid.reduce(part, "col", t)
                if r == t:
                    dw = part
            if grid.depth > 1:
                grid.all_reduce(dw, "depth")
        return dx, dw, None


class _Cube(torch.autograd.Function):
    """3d linear: all-gather X (into) and W (weight), GEMM, reduce-scatter Y (out)."""

    @staticmethod
    def forward(ctx, x, w, grid, into, out, regather):
        with tag(None):
            xg = grid.all_gather(x, into)
            wg = grid.all_gather(w.detach(), "weight")
            y = grid.reduce_scatter(xg @ wg, out)
        ctx.grid, ctx.into, ctx.out, ctx.regather = grid, into, out, regather
        ctx.save_for_backward(*((x, w) if regather else (xg, wg)))
        return y

    @staticmethod
    def backward(ctx, dy):
        grid, into, out = ctx.grid, ctx.into, ctx.out
        a, b = ctx.saved_tensors
        with tag(None):
            dyg = grid.all_gather(dy, out)
            if ctx.regather:
                xg, wg = grid.all_gather(a, into), grid.all_gather(b.detach(), "weight")
            else:
                xg, wg = a, b
            dx = grid.reduce_scatter(dyg @ wg.t(), into)
            dw = grid.reduce_scatter(xg.t() @ dyg, "weight")
        return dx, dw, None, None, None, None


class _GatherParam(torch.autograd.Function):
    """A vector (or matrix along `dim`) split over `key`: all-gather forward, reduce-scatter of
    the gradient backward, then all-reduce over `replicas` (2.5d's depth)."""

    @staticmethod
    def forward(ctx, p, grid, key, dim, replicas):
        ctx.grid, ctx.key, ctx.dim, ctx.replicas = grid, key, dim, replicas
        with tag("param"):
            g = grid.all_gather(p.detach().movedim(dim, 0), key)
        return g.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        grid = ctx.grid
        with tag("param"):
            part = grid.reduce_scatter(grad.movedim(ctx.dim, 0), ctx.key).movedim(0, ctx.dim).contiguous()
            if ctx.replicas:
                grid.all_reduce(part, ctx.replicas)
        return part, None, None, None, None


class _LayerNorm(torch.autograd.Function):
    """LayerNorm over a hidden dimension split over `key`: per-token sum and sum of squares
    all-reduced (fp32), and in backward the two per-token sums of the gradient."""

    @staticmethod
    def forward(ctx, x, gamma, beta, grid, key, hidden, eps):
        xf = x.float()
        stats = torch.stack((xf.sum(-1), (xf * xf).sum(-1)), -1)
        with tag("stats"):
            grid.all_reduce(stats, key)
        mean = stats[..., 0:1] / hidden
        var = stats[..., 1:2] / hidden - mean * mean
        rstd = torch.rsqrt(var + eps)
        xhat = (xf - mean) * rstd
        ctx.grid, ctx.key, ctx.hidden = grid, key, hidden
        ctx.save_for_backward(xhat, rstd, gamma)
        return (xhat * gamma.float() + beta.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, gamma = ctx.saved_tensors
        dyf = dy.float()
        g = dyf * gamma.float()
        sums = torch.stack((g.sum(-1), (g * xhat).sum(-1)), -1)
        with tag("stats"):
            ctx.grid.all_reduce(sums, ctx.key)
        dx = rstd * (g - sums[..., 0:1] / ctx.hidden - xhat * sums[..., 1:2] / ctx.hidden)
        dgamma = (dyf * xhat).flatten(0, -2).sum(0).to(gamma.dtype)
        dbeta = dyf.flatten(0, -2).sum(0).to(gamma.dtype)
        return dx.to(dy.dtype), dgamma, dbeta, None, None, None, None


class _VocabEmbedding(torch.autograd.Function):
    """Partial lookups of this device's vocabulary rows for `ids`, reduce-scattered over `key`
    (the axis that splits the vocabulary); backward all-gathers the gradient and scatters it into
    the rows (2.5d then all-reduces it over depth)."""

    @staticmethod
    def forward(ctx, weight, ids, start, grid, key, replicas):
        rows = weight.shape[0]
        mine = (ids >= start) & (ids < start + rows)
        local = (ids - start).clamp(0, rows - 1)
        partial = F.embedding(local, weight.detach()) * mine.unsqueeze(-1).to(weight.dtype)
        with tag("embedding"):
            out = grid.reduce_scatter(partial, key)
        ctx.grid, ctx.key, ctx.replicas, ctx.rows = grid, key, replicas, rows
        ctx.save_for_backward(local, mine)
        return out

    @staticmethod
    def backward(ctx, grad):
        local, mine = ctx.saved_tensors
        with tag("embedding"):
            full = ctx.grid.all_gather(grad, ctx.key) * mine.unsqueeze(-1).to(grad.dtype)
            dweight = grad.new_zeros(ctx.rows, grad.shape[-1]).index_add_(0, local, full)
            if ctx.replicas:
                ctx.grid.all_reduce(dweight, ctx.replicas)
        return dweight, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Modules: parameters are this rank's shards; `shard` maps each to a function of the full tensor


class _Sharder:
    """Where this rank's pieces of each full tensor are (the same maps shard the reference's
    weights and gather the gradients back for the check)."""

    def __init__(self, grid: Grid):
        self.g = grid

    def block(self, full, rows, cols):
        """full[rows block, cols block] where rows/cols are (index, count) pairs (or None: all)."""
        out = full
        if rows is not None:
            out = out.reshape(rows[1], -1, *out.shape[1:])[rows[0]]
        if cols is not None:
            out = out.reshape(out.shape[0], cols[1], -1)[:, cols[0]]
        return out

    def vector(self, full, block, key, dim=-1):
        """Hidden block `block` = (index, count) of the last dim, split over the members of `key`
        (this rank keeps its position's chunk)."""
        g = self.g
        x = full.movedim(dim, 0)
        x = x.reshape(block[1], -1, *x.shape[1:])[block[0]]
        x = x.reshape(g.group_size(key), -1, *x.shape[1:])[g.position(key)]
        return x.movedim(0, dim)


class Linear(nn.Module):
    """Y = X W (+ b) in the grid's layout; `index` is the linear's place in the layer (3d axes)."""

    def __init__(self, grid: Grid, h_in, h_out, bias: bool, index: int, regather=False, dtype=None):
        super().__init__()
        g, q = grid, grid.q
        self.grid, self.regather = grid, regather
        self.into, self.out = ("input", "output") if index % 2 == 0 else ("output", "input")
        if grid.mode == "3d":
            w_shape = (h_in // q**2, h_out // q)
            self.bias_key = "+".join(a for a in ("input", "weight", "output") if a != self.into)
        else:
            w_shape = (h_in // q, h_out // q)
            self.bias_key = "col"
        self.weight = nn.Parameter(torch.empty(w_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(h_out // g.size * (g.depth if g.mode == "2.5d" else 1), dtype=dtype)) \
            if bias else None

    def shard_weight(self, full):
        """full: [h_in, h_out] (the transpose of nn.Linear's weight)."""
        g, q = self.grid, self.grid.q
        if g.mode == "3d":
            co, ci, cw = g.coord[self.out], g.coord[self.into], g.coord["weight"]
            rows = full.reshape(q, -1, full.shape[1])[co].reshape(q, -1, full.shape[1])[cw]
            return _Sharder(g).block(rows, None, (ci, q))
        return _Sharder(g).block(full, (g.coord["col"], q), (g.coord["row"], q))

    def shard_bias(self, full):
        g = self.grid
        block = g.coord[self.into] if g.mode == "3d" else g.coord["row"]
        return _Sharder(g).vector(full, (block, g.q), self.bias_key)

    def forward(self, x):
        g = self.grid
        if g.mode == "3d":
            y = _Cube.apply(x, self.weight, g, self.into, self.out, self.regather)
        else:
            y = _Summa.apply(x, self.weight, g)
        if self.bias is not None:
            replicas = "depth" if g.mode == "2.5d" and g.depth > 1 else None
            y = y + _GatherParam.apply(self.bias, g, self.bias_key, 0, replicas)
        return y


def _norm_keys(grid: Grid):
    """(axis splitting the hidden dimension of the norm region, group sharing a hidden block)."""
    return ("output", "input+weight") if grid.mode == "3d" else ("row", "col")


class _SplitNorm(nn.Module):
    """A norm over a hidden dimension split over the grid: its vectors' shards and their gathers."""

    def __init__(self, grid: Grid, hidden, eps, dtype, bias: bool):
        super().__init__()
        self.grid, self.hidden, self.eps = grid, hidden, eps
        self.stat_key, self.param_key = _norm_keys(grid)
        n = hidden // grid.q // grid.group_size(self.param_key)
        self.weight = nn.Parameter(torch.empty(n, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(n, dtype=dtype))

    def shard(self, full):
        g = self.grid
        return _Sharder(g).vector(full, (g.coord[self.stat_key], g.q), self.param_key)

    def gathered(self, vector):
        g = self.grid
        replicas = "depth" if g.mode == "2.5d" and g.depth > 1 else None
        return _GatherParam.apply(vector, g, self.param_key, 0, replicas)


class LayerNorm(_SplitNorm):
    def __init__(self, grid: Grid, hidden, eps=1e-5, dtype=None):
        super().__init__(grid, hidden, eps, dtype, bias=True)

    def forward(self, x):
        gamma, beta = self.gathered(self.weight), self.gathered(self.bias)
        return _LayerNorm.apply(x, gamma, beta, self.grid, self.stat_key, self.hidden, self.eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm over a hidden dimension split over `key`: the per-token sum of squares all-reduced
    (fp32), and in backward the per-token sum of the gradient times the normalised input. It
    keeps its input and 1/rms, as validate.llama.RMSNorm."""

    @staticmethod
    def forward(ctx, x, gamma, grid, key, hidden, eps):
        xf = x.float()
        squares = (xf * xf).sum(-1, keepdim=True)
        with tag("stats"):
            grid.all_reduce(squares, key)
        rstd = torch.rsqrt(squares / hidden + eps)
        ctx.grid, ctx.key, ctx.hidden = grid, key, hidden
        ctx.save_for_backward(x, rstd, gamma)
        return (xf * rstd * gamma.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, gamma = ctx.saved_tensors
        xhat = x.float() * rstd
        g = dy.float() * gamma.float()
        dot = (g * xhat).sum(-1, keepdim=True)
        with tag("stats"):
            ctx.grid.all_reduce(dot, ctx.key)
        dx = rstd * (g - xhat * dot / ctx.hidden)
        dgamma = (dy.float() * xhat).flatten(0, -2).sum(0).to(gamma.dtype)
        return dx.to(dy.dtype), dgamma, None, None, None, None


class RMSNorm(_SplitNorm):
    def __init__(self, grid: Grid, hidden, eps=NORM_EPS, dtype=None):
        super().__init__(grid, hidden, eps, dtype, bias=False)

    def forward(self, x):
        return _RMSNorm.apply(x, self.gathered(self.weight), self.grid, self.stat_key, self.hidden, self.eps)


def norm_layer(grid: Grid, cfg: GPTConfig, dtype=None) -> nn.Module:
    return (LayerNorm if cfg.norm == "layernorm" else RMSNorm)(grid, cfg.hidden, dtype=dtype)


def _checkpointed(fn, *args):
    with set_checkpoint_early_stop(False):  # re-run the whole region, as Megatron and perfsim do
        return checkpoint(fn, *args, use_reentrant=False)


class Block(nn.Module):
    def __init__(self, grid: Grid, cfg: GPTConfig, regather=False, dtype=None):
        super().__init__()
        h, f = cfg.hidden, cfg.ffn
        self.grid, self.cfg = grid, cfg
        self.head_dim = h // cfg.heads
        self.group = cfg.heads // cfg.kv_heads  # query heads per key/value head
        self.rotary = Rotary(self.head_dim) if cfg.rotary else None
        self.activation = mlp_activation(cfg.activation)
        self.ln1 = norm_layer(grid, cfg, dtype)
        self.qkv = Linear(grid, h, h + 2 * cfg.kv_heads * self.head_dim, cfg.bias, 0, regather, dtype)
        self.proj = Linear(grid, h, h, cfg.bias, 1, regather, dtype)
        self.ln2 = norm_layer(grid, cfg, dtype)
        self.fc1 = Linear(grid, h, 2 * f if cfg.activation == "swiglu" else f, cfg.bias, 2, regather, dtype)
        self.fc2 = Linear(grid, f, h, cfg.bias, 3, regather, dtype)

    def _attention(self, x):
        s = self.cfg.seq
        qkv = self.qkv(x)  # [tokens, (h + 2 kv) / q]: whole heads, or whole query groups (validate.llama)
        t, width = qkv.shape
        if self.cfg.gpt_attention:
            heads = width // (3 * self.head_dim)
            q, k, v = qkv.view(t // s, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
            core = ATTENTION_CORES[self.cfg.attention]
        else:
            q, k, v = grouped_qkv(qkv.view(t // s, s, width), self.group, self.head_dim, self.rotary)
            heads, core = q.shape[1], GROUPED_CORES[self.cfg.attention]
        if self.cfg.recompute == "selective":
            context = _checkpointed(core, q, k, v)
        else:
            context = core(q, k, v)
        return self.proj(context.transpose(1, 2).reshape(t, heads * self.head_dim))

    def _forward(self, x):
        x = x + self._attention(self.ln1(x))
        return x + self.fc2(self.activation(self.fc1(self.ln2(x))))

    def forward(self, x):
        if self.cfg.recompute == "full":
            return _checkpointed(self._forward, x)
        return self._forward(x)


class MultiDimGPT(nn.Module):
    """validate.gpt.GPT's model (learned positions, LayerNorm, GeLU MLP, untied head, no
    dropout; or the Llama-shaped layers its config asks for: RMSNorm, rotary positions, grouped
    query heads, SwiGLU or squared ReLU, no biases) with this rank's shards of every parameter.
    Activations are [tokens, hidden block] (token rows are whole sequences)."""

    def __init__(self, grid: Grid, cfg: GPTConfig, regather=False, dtype=None):
        if cfg.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {cfg.recompute!r}")
        super().__init__()
        g, q = grid, grid.q
        self.grid, self.cfg = grid, cfg
        self.pos_key = _norm_keys(grid)[1]
        self.vocab_key = "input" if g.mode == "3d" else "col"  # the axis the embedding's rows split over
        rows = cfg.vocab // q // (q if g.mode == "3d" else 1)
        self.embed = nn.Parameter(torch.empty(rows, cfg.hidden // q, dtype=dtype))
        if cfg.rotary:  # positions enter the attention (validate.llama.Rotary)
            self.register_parameter("pos", None)
        else:
            self.pos = nn.Parameter(torch.empty(cfg.seq, cfg.hidden // q // g.group_size(self.pos_key), dtype=dtype))
        self.blocks = nn.ModuleList(Block(grid, cfg, regather, dtype) for _ in range(cfg.layers))
        self.ln_f = norm_layer(grid, cfg, dtype)
        self.head = Linear(grid, cfg.hidden, cfg.vocab, False, 0, regather, dtype)
        self.block_context = contextlib.nullcontext  # the check counts each layer's saved tensors
        self.recipes = self._recipes()

    # --- where each local parameter comes from in the single-process GPT (validate.gpt.GPT)
    def _recipes(self) -> dict:
        """local name -> (reference name, full reference tensor -> this rank's piece)."""
        g, q, sh = self.grid, self.grid.q, _Sharder(self.grid)
        hidden_block = g.coord["output"] if g.mode == "3d" else g.coord["row"]
        out = {}
        if g.mode == "3d":
            a, w, o = g.coord["input"], g.coord["weight"], g.coord["output"]
            out["embed"] = ("embed.weight", lambda e: sh.block(sh.block(e, (a, q), None), (w, q), (o, q)))
        else:
            out["embed"] = ("embed.weight", lambda e: sh.block(e, (g.coord["col"], q), (g.coord["row"], q)))
        if self.pos is not None:
            out["pos"] = ("pos", lambda p: sh.vector(p, (hidden_block, q), self.pos_key))

        def linear(local, ref, mod):
            out[f"{local}.weight"] = (f"{ref}.weight", lambda t, m=mod: m.shard_weight(t.t()))
            if mod.bias is not None:
                out[f"{local}.bias"] = (f"{ref}.bias", lambda t, m=mod: m.shard_bias(t))

        def norm(local, ref, mod):
            for p, _ in mod.named_parameters():  # weight, and bias for a LayerNorm
                out[f"{local}.{p}"] = (f"{ref}.{p}", lambda t, m=mod: m.shard(t))

        for i, blk in enumerate(self.blocks):
            norm(f"blocks.{i}.ln1", f"blocks.{i}.ln1", blk.ln1)
            norm(f"blocks.{i}.ln2", f"blocks.{i}.ln2", blk.ln2)
            linear(f"blocks.{i}.qkv", f"blocks.{i}.attn.qkv", blk.qkv)
            linear(f"blocks.{i}.proj", f"blocks.{i}.attn.proj", blk.proj)
            linear(f"blocks.{i}.fc1", f"blocks.{i}.mlp.fc1", blk.fc1)
            linear(f"blocks.{i}.fc2", f"blocks.{i}.mlp.fc2", blk.fc2)
        norm("ln_f", "ln_f", self.ln_f)
        linear("head", "head", self.head)
        return out

    @torch.no_grad()
    def load_from(self, reference: GPT):
        ref = dict(reference.named_parameters())
        for name, p in self.named_parameters():
            ref_name, piece = self.recipes[name]
            p.copy_(piece(ref[ref_name].detach()))
        return self

    # --- which rows of the batch this rank holds
    def _rows(self, b: int, after_linear0: bool):
        """Slice of the b sequences whose tokens this rank's activation (or logits) rows hold."""
        g, q = self.grid, self.grid.q
        if g.mode == "3d":
            n = b // q**2
            sub = g.coord["output"] if after_linear0 else g.coord["input"]
            start = (g.coord["weight"] * q + sub) * n
        else:
            n = b // (g.depth * q)
            start = (g.coord.get("depth", 0) * q + g.coord["col"]) * n
        return slice(start, start + n)

    def _embedding_ids(self, tokens):
        g, q, b = self.grid, self.grid.q, tokens.shape[0]
        if g.mode == "3d":
            n = b // q
            return tokens[g.coord["weight"] * n:(g.coord["weight"] + 1) * n]
        n = b // g.depth
        k = g.coord.get("depth", 0)
        return tokens[k * n:(k + 1) * n]

    def forward(self, tokens):
        """Logits of this rank's block: [its tokens, V/q]."""
        g, s = self.grid, self.cfg.seq
        replicas = "depth" if g.mode == "2.5d" and g.depth > 1 else None
        ids = self._embedding_ids(tokens).reshape(-1)
        if g.mode == "3d":
            weight = _GatherWeight.apply(self.embed, g)
            start = g.coord["input"] * weight.shape[0]
        else:
            weight, start = self.embed, g.coord["col"] * self.embed.shape[0]
        x = _VocabEmbedding.apply(weight, ids, start, g, self.vocab_key, replicas)
        if self.pos is not None:
            pos = _GatherParam.apply(self.pos, g, self.pos_key, 1, replicas)
            x = (x.view(-1, s, x.shape[-1]) + pos).view(-1, x.shape[-1])
        for block in self.blocks:
            with self.block_context():
                x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens, targets):
        """This rank's share of the mean cross-entropy (its tokens' sum / all tokens); the ranks
        that hold the same tokens hold the same value. `global_loss` sums the shares."""
        g = self.grid
        logits = self(tokens)
        rows = self._rows(tokens.shape[0], after_linear0=True)
        start = (g.coord["input"] if g.mode == "3d" else g.coord["row"]) * logits.shape[-1]
        key = "input" if g.mode == "3d" else "row"
        def reduce(tensor, op):
            return g.all_reduce(tensor, key, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        with tag("stats"):
            return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1), start, reduce,
                                 1.0 / targets.numel())

    def global_loss(self, share) -> float:
        """The batch's mean loss from every rank's share (the vocabulary axis holds q copies)."""
        t = share.detach().clone().float()
        dist.all_reduce(t)
        return float(t) / self.grid.q


class _GatherWeight(torch.autograd.Function):
    """3d embedding weight: all-gather over `weight` forward, reduce-scatter of its gradient."""

    @staticmethod
    def forward(ctx, w, grid):
        ctx.grid = grid
        with tag("embedding"):
            return grid.all_gather(w.detach(), "weight")

    @staticmethod
    def backward(ctx, grad):
        with tag("embedding"):
            return ctx.grid.reduce_scatter(grad, "weight"), None


def local_parameter_elements(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def problems(model, plan) -> list[str]:
    """Why this module cannot run `plan` (empty if it can)."""
    out = []
    if plan.tp_mode not in MODES:
        out.append(f"validate.multidim runs tp_mode 2d, 2.5d or 3d, not {plan.tp_mode!r}")
    if plan.pp != 1 or plan.dp != 1:
        out.append("validate.multidim runs pp=1, dp=1 only")
    if plan.sp:
        out.append("sequence parallelism is a 1d option")
    if out:
        return out
    from perfsim.spec.plan import plan_problems

    return plan_problems(plan, model, plan.devices)


# ----------------------------------------------------------------------------------------------
# Timing-run interface (validate/steps.py)


class TrainingStep:
    def __init__(self, module, optimizer, batches):
        self.module, self.optimizer, self.batches = module, optimizer, batches

    def run(self) -> float:
        """One optimizer step over the plan's micro-batches; the batch's mean loss."""
        total = 0.0
        m = len(self.batches)
        for tokens, targets in self.batches:
            share = self.module.loss(tokens, targets) / m
            share.backward()
            total += self.module.global_loss(share)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def build_step(plan, model, device, dtype) -> TrainingStep:
    """A 2d / 2.5d / 3d training step of `model` under `plan` on this rank (see validate/steps.py)."""
    from validate.optim import MasterAdam

    reasons = problems(model, plan)
    if reasons:
        raise ValueError("; ".join(reasons))
    if dist.get_world_size() != plan.devices:
        raise ValueError(f"world size {dist.get_world_size()} is not the plan's {plan.devices} devices")
    cfg = GPTConfig.from_spec(model, plan.tp, plan.recompute, plan.attention)
    grid = grid_for(plan, model, dist.get_rank())
    torch.manual_seed(0)
    reference = GPT(cfg)  # every rank builds the same full model and keeps its shards
    module = MultiDimGPT(grid, cfg, plan.tp_regather, dtype).load_from(reference).to(device)
    del reference
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(plan.microbatches):
        tokens = torch.randint(0, model.vocab, (plan.mbs, cfg.seq), generator=gen).to(device)
        targets = torch.randint(0, model.vocab, (plan.mbs, cfg.seq), generator=gen).to(device)
        batches.append((tokens, targets))
    optimizer = MasterAdam(module.parameters(), lr=1e-3)
    optimizer.init_states()
    return TrainingStep(module, optimizer, batches)
