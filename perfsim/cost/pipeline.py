"""Where a plan's layers sit on its pipeline (docs/equations.md 9.4 and 7.3): the stages by
position, what each holds chunk by chunk, and the micro-batches each chunk keeps in flight.

Without a layout (plan field pp_layout) a pipeline has three positions whatever pp: "first",
"middle" (the pp - 2 stages between, alike) and "last"; with pp = 1 "first" is the one stage and
holds the loss too. Their layer counts (the plan's first_stage_layers, last_stage_layers) may be
numpy arrays, one entry per plan of a search. With v chunks an end stage's chunks hold
ceil(n / v) layers each but the one holding the embedding or the loss, which holds the rest
(spec.plan.edge_chunk_layers). With a layout (spec/layout.py) every stage is a position of its
own, "stage 0" to "stage pp - 1", holding what the layout gives it (one plan at a time).

An MTP layer (`m` of a layout) is priced as a decoder layer and a head of its own: perfsim has no
MTP module (docs/equations.md 9.4 says what that leaves out).
"""

from __future__ import annotations

import functools

import numpy as np

from perfsim.spec.plan import SCHEDULES, edge_chunk_layers, stage_layers

FAMILY = ("first", "middle", "last")
GPIPE, INTERLEAVED = SCHEDULES.index("gpipe"), SCHEDULES.index("interleaved")


def positions(c) -> tuple:
    """The plan's stage positions, the ends first (the order sums and ties take them in)."""
    if c.layout is None:
        return ("first", "last", "middle")
    p = c.layout.pp
    return tuple(f"stage {i}" for i in dict.fromkeys([0, p - 1, *range(1, p - 1)]))


def position_of(c, i: int) -> str:
    """The position of stage i (one plan)."""
    if c.layout is not None:
        return f"stage {i}"
    return "first" if i == 0 else "last" if i == int(c.pp) - 1 else "middle"


def _rank(pos: str) -> int:
    return int(pos.split()[1])


def stage_index(c, pos: str):
    """The stage a position stands for: 0 and pp - 1 for the ends, 1 for "middle" (the middle
    stage with the most micro-batches in flight), a layout's own index."""
    if c.layout is not None:
        return _rank(pos)
    return {"first": 0 * c.pp, "middle": 1 + 0 * c.pp, "last": c.pp - 1}[pos]


def stage_count(c, pos: str):
    """How many stages the position stands for: 1, pp - 2 for "middle", none for "last" with pp = 1."""
    if c.layout is not None:
        return 1
    return {"first": 1 + 0 * c.pp, "middle": np.maximum(c.pp - 2, 0), "last": np.where(c.pp > 1, 1, 0)}[pos]


def layer_count(model, c, pos: str):
    """Decoder layers on a device of the position (its MTP layers apart: `mtp_count`). Worked out
    once per batch of columns and layer count: a search asks for them dozens of times."""
    if c.layout is not None:
        return c.layout.rank_total(_rank(pos), "layers")
    counts = c.__dict__.setdefault("_stage_layers", {})  # Columns are not changed after they are made
    if model.layers not in counts:
        counts[model.layers] = stage_layers(model.layers, c.pp, c.first_layers, c.last_layers)
    return counts[model.layers][FAMILY.index(pos)]


def embedding_count(c, pos: str):
    """1 where the position's stage holds the embedding (the first; with pp = 1 the one stage)."""
    if c.layout is not None:
        return c.layout.rank_total(_rank(pos), "embedding")
    return {"first": 1 + 0 * c.pp, "middle": 0 * c.pp, "last": np.where(c.pp == 1, 1, 0)}[pos]


def loss_count(c, pos: str):
    """1 where the position's stage holds the final norm, the output layer and the loss."""
    if c.layout is not None:
        return c.layout.rank_total(_rank(pos), "loss")
    return {"first": np.where(c.pp == 1, 1, 0), "middle": 0 * c.pp, "last": 1 + 0 * c.pp}[pos]


def mtp_count(c, pos: str):
    """MTP layers on the position's stage (layouts only), each a decoder layer and a head."""
    return 0 if c.layout is None else c.layout.rank_total(_rank(pos), "mtp")


def head_count(c, pos: str):
    """Logits GEMMs and losses the position's stage runs per micro-batch: the loss's, and one per MTP layer."""
    return loss_count(c, pos) + mtp_count(c, pos)


def chunk_layers(model, c, pos: str) -> list:
    """Decoder layers of each chunk of the position's stage, chunk 0 first (one plan)."""
    if c.layout is not None:
        return [s.layers for s in c.layout.rank(_rank(pos))]
    v, n = int(c.vpp), int(layer_count(model, c, pos))
    if v == 1:
        return [n]
    q = -(-n // v)
    edge = int(edge_chunk_layers(n, v))
    return {"first": [edge] + [q] * (v - 1), "middle": [n // v] * v, "last": [q] * (v - 1) + [edge]}[pos]


def dense_count(model, c, pos: str):
    """Dense-FFN layers (a mixture of experts' first dense_layers) on a device of the position's
    stage; 0 for a model without them (docs/equations.md 12.6). The layers run in virtual-stage
    order, chunk 0 of every stage and then chunk 1 (Megatron-Core's), so the dense ones fill the
    first stage's chunk 0 first. "middle" stands for the last middle stage, the one with the
    fewest: the pp - 2 middle stages are priced alike, as the heavier (all-MoE) ones."""
    if not (model.moe and model.dense_layers):
        return 0
    return sum(_dense_by_chunk(model, c, pos))


def chunk_dense(model, c, pos: str) -> list:
    """Dense-FFN layers of each chunk of the position's stage, chunk 0 first (one plan)."""
    chunks = len(chunk_layers(model, c, pos))
    if not (model.moe and model.dense_layers):
        return [0] * chunks
    dense = [int(x) for x in _dense_by_chunk(model, c, pos)]
    return dense + [0] * (chunks - len(dense))


def _dense_by_chunk(model, c, pos: str) -> list:
    """The first model.dense_layers layers on each chunk of the position's stage, walking the
    virtual stages in order; numpy arrays over a search's plans without a layout, the chunks past
    the last dense layer of every plan left out (they hold none)."""
    d = model.dense_layers
    if c.layout is not None:
        p, i, start, out = c.layout.pp, _rank(pos), 0, []
        for k in range(p * c.layout.vpp):  # virtual stage k is chunk k // p of rank k % p
            n = c.layout.chunk(k % p, k // p).layers
            if k % p == i:
                out.append(min(max(d - start, 0), n))
            start += n
        return out
    first, mid, last = (layer_count(model, c, name) for name in FAMILY)
    p, v = c.pp, c.vpp
    q_first, q_last, chunk_mid = -(-first // v), -(-last // v), mid / v
    between = np.maximum(p - 2, 0)  # middle stages
    start, out = 0.0, []
    for r in range(int(np.max(v))):
        if r and np.all(start >= d):  # the dense layers all lie on earlier virtual stages
            break
        on = r < v
        f = np.where(r == 0, first - (v - 1) * q_first, q_first) * on  # the first stage's chunk r
        m = chunk_mid * on * (between > 0)
        last_r = np.where(r == v - 1, last - (v - 1) * q_last, q_last) * on
        at = {"first": (start, f), "middle": (start + f + np.maximum(between - 1, 0) * m, m),
              "last": (start + f + between * m, last_r)}[pos]
        out.append(np.clip(d - at[0], 0, at[1]))
        start = start + f + between * m + last_r
    if pos == "first":  # one stage holds every layer
        out[0] = np.where(p == 1, min(d, model.layers), out[0])
    return out


def chunk_edges(c, pos: str) -> list:
    """(embedding, loss, MTP layers) of each chunk of the position's stage (one plan): the
    embedding on chunk 0 of the first stage, the loss on the last chunk of the last."""
    if c.layout is not None:
        return [(s.embedding, s.loss, s.mtp) for s in c.layout.rank(_rank(pos))]
    v = int(c.vpp)
    out = [(0, 0, 0)] * v
    out[0] = (int(embedding_count(c, pos)), out[0][1], 0)
    out[-1] = (out[-1][0], int(loss_count(c, pos)), 0)
    return out


# ---------------------------------------------------------------------------------------------
# Micro-batches in flight, chunk by chunk (docs/equations.md 7.3)


def warmup_forwards(p, i, m, v):
    """Forward passes stage i runs before its first backward under Megatron-Core's interleaved
    schedule (schedules.py, forward_backward_pipelining_with_interleaving): (p - i - 1) x 2 +
    (v - 1) x p, all m v of them when m = p (or when that is more)."""
    warmup = (p - i - 1) * 2 + (v - 1) * p
    return np.where((m == p) | (warmup >= m * v), m * v, warmup)


def _chunk_forwards(k, p, v, chunk, reverse=False):
    """How many of the first k passes of one direction are for `chunk`: the passes go through the
    chunks in groups of p micro-batches (chunk 0 for p of them, then chunk 1, ...), backwards with
    the chunks reversed."""
    position = (v - 1 - chunk) if reverse else chunk
    return p * (k // (p * v)) + np.clip(k % (p * v) - position * p, 0, p)


@functools.lru_cache(maxsize=4096)
def chunk_states(p: int, v: int, m: int, i: int) -> np.ndarray:
    """Every (micro-batches in flight per chunk) stage i of an interleaved pipeline holds right after
    a forward pass, one row per state: the states its peak memory is among (a backward only frees).
    After the k-th forward, the first max(0, k - warm-up - 1) backwards have run; the steady states
    repeat every p v passes, so the first p v after the warm-up are all of them."""
    m_key = m if m <= 4 * p else 4 * p  # as many states as with any larger multiple of p
    warmup = int(warmup_forwards(p, i, m_key, v))
    total = m_key * v
    k = np.arange(1, min(total, warmup + 1 + p * v) + 1)
    backwards = np.maximum(k - warmup - 1, 0)
    return np.stack([_chunk_forwards(k, p, v, c) - _chunk_forwards(backwards, p, v, c, reverse=True)
                     for c in range(v)], axis=1)


def peak_state(c, i: int, weights) -> tuple:
    """(the most Σ n_c w_c stage i holds over its schedule, the in-flight micro-batches n_c per chunk
    where it does) for one plan and per-chunk weights (bytes of one micro-batch's chunk)."""
    m, p, v = int(c.microbatches), int(c.pp), int(c.vpp)
    if int(c.schedule) != INTERLEAVED:
        n = m if int(c.schedule) == GPIPE else min(m, p - i)
        return n * sum(weights), [n]
    states = chunk_states(p, v, m, i)
    loads = sum(states[:, c].reshape((-1,) + (1,) * np.ndim(w)) * np.asarray(w, dtype=float)
                for c, w in enumerate(weights))  # one row per state (a column per draw where weights are arrays)
    best = int(np.argmax(loads.reshape(len(states), -1)[:, 0]))
    return loads.max(axis=0), [int(x) for x in states[best]]


@functools.lru_cache(maxsize=4096)
def _edge_hull(p: int, v: int, m: int, i: int, edge: int) -> tuple:
    """The (micro-batches in flight, of them in chunk `edge`) pairs of stage i's states that can be
    the peak of q N + (e - q) n_edge for some q > 0 and e >= 0: the pairs' upper hull."""
    states = chunk_states(p, v, m, i)
    pairs = sorted(set(zip(states.sum(axis=1).tolist(), states[:, edge].tolist())))
    upper, lower = [], []
    for point in pairs:  # Andrew's monotone chain, the upper and the lower hull
        for chain, sign in ((upper, 1), (lower, -1)):
            while len(chain) >= 2 and sign * _cross(chain[-2], chain[-1], point) >= 0:
                chain.pop()
            chain.append(point)
    kept = sorted(set(upper) | set(lower))
    return np.array([n for n, _ in kept], dtype=float), np.array([e for _, e in kept], dtype=float)


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def edge_chunk_peak(p, v, m, i, q, edge_load, edge: int):
    """The most stage i of an interleaved pipeline (p stages, v chunks, m micro-batches) keeps over
    its schedule when each of its chunks holds a load of q per micro-batch but chunk `edge` (0, or
    -1 for the last), which holds `edge_load`: max over its states of q N + (edge_load - q) n_edge,
    for every plan of a batch (numbers or arrays; NaN where v or p is below 2)."""
    shape = np.broadcast(q, edge_load, p, v, m, i).shape
    p, v, m, i = (np.broadcast_to(x, shape).astype(int).ravel() for x in (p, v, m, i))
    flat_q, flat_e = (np.broadcast_to(np.asarray(x, dtype=float), shape).ravel() for x in (q, edge_load))
    flat_out = np.full(flat_q.shape, np.nan)
    m = np.minimum(m, 4 * p)  # as many states as any larger multiple of p (chunk_states)
    columns = np.stack([p, v, m, i], axis=1)
    radix = columns.max(axis=0, initial=0) + 1
    if np.prod(radix.astype(float)) < 2.0**62:  # each row's (p, v, m, i) as one whole number
        code = ((p * radix[1] + v) * radix[2] + m) * radix[3] + i
        keys, group = np.unique(code, return_inverse=True)
    else:
        keys, group = np.unique(columns, axis=0, return_inverse=True)
    for g in range(len(keys)):
        rows = np.flatnonzero(group == g)
        pk, vk, mk, ik = p[rows[0]], v[rows[0]], m[rows[0]], i[rows[0]]
        if vk < 2 or pk < 2:
            continue
        n, n_edge = _edge_hull(int(pk), int(vk), int(mk), int(ik), edge if edge >= 0 else int(vk) + edge)
        flat_out[rows] = (flat_q[rows, None] * n + (flat_e[rows, None] - flat_q[rows, None]) * n_edge).max(axis=1)
    return flat_out.reshape(shape)
