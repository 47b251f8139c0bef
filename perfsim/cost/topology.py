"""The machine as a graph, and what a group of ranks really gets on it (docs/topology.md).

`build_graph(system, nodes)` gives the machine as a networkx graph: one vertex per device, links
between the devices of one card, between cards of one node (a switch vertex, or direct links), one
vertex per NIC, and the fat tree as one core switch. Every edge carries `bandwidth` (bytes/s, one
direction; links are full duplex), `latency` (s), `kind` (card, node, network, host) and `node`
(the node whose link it is).

`TopologyCommModel(system)` answers the questions `collectives.CommModel` answers, with the same
interface (`link`, `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `reduce`, `send`,
numpy arrays welcome), by routing every ring (or tree) edge of every group of a parallel dimension
over the graph at once, counting the flows on each directed link, and choosing per collective and
size the fastest of a flat ring, NCCL-style multi-channel rings, an NCCL-style double binary tree
(all-reduce, broadcast, reduce) and hierarchical algorithms, or the one the profile fixes
(`collectives.algorithm`: auto, ring, tree, hierarchical). A profile may scale each operation on
top of that (`collectives.operation_efficiency` and `operation_latency_factor`): the operation's
whole time, bandwidth and latency parts apart, whatever algorithm it takes; and add to each call a
fixed wait it pays inside a training step (`operation_step_overhead_s`).

A parallel dimension is (g, s): groups of g ranks s apart, ranks placed on devices in order
(rank r on node r // devices_per_node, device r % devices_per_node). The fat tree's core is
non-blocking, so a link's load depends only on the node it belongs to: the model studies one
node at a time (every distinct node pattern of the dimension, at most one period of it) on a
two-node graph, and no cost grows with the number of nodes of the machine.

networkx is imported only by `build_graph`; the model routes on the same edges with its own small
shortest-path search (tests check that both give the same routes), so `perfsim predict` does not
pay networkx's import time.
"""

from __future__ import annotations

import heapq
import weakref
import math
from dataclasses import dataclass

import numpy as np

from perfsim.cost import measured
from perfsim.spec.system import ALGORITHMS, OPERATIONS, System

CARD, NODE, NETWORK, HOST = "card", "node", "network", "host"
LINK_KINDS = (CARD, NODE, NETWORK, HOST)
SWITCH, ALL_TO_ALL = "switch", "all-to-all"
AUTO, RING, TREE, HIERARCHICAL = ALGORITHMS
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE, SEND = (
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send")
ALL_TO_ALL_OP = "all_to_all"  # expert parallelism's dispatch and combine (all_to_all_line)
# The algorithms each operation's time comes from: an all-gather runs the reduce-scatter's
# algorithms the other way, a reduce the broadcast's, reversed (links are full duplex).
_ALGORITHMS_OF = {ALL_REDUCE: ALL_REDUCE, ALL_GATHER: REDUCE_SCATTER, REDUCE_SCATTER: REDUCE_SCATTER,
                  BROADCAST: BROADCAST, REDUCE: BROADCAST, SEND: SEND, ALL_TO_ALL_OP: ALL_TO_ALL_OP}
DIRECT = "direct"  # the all-to-all's one algorithm: every member posts its size - 1 sends at once

# Routing cost added per device<->NIC hop, in seconds of path cost: large enough that a NIC is never
# a shortcut between two devices of one node, and equal on every inter-node route (each has two).
HOST_ROUTE_PENALTY_S = 1.0
INF = math.inf

# Per-process caches shared by every model of the same machine (a prediction builds several models):
# routes per (node, network, card topology, router); ring shapes per (machine, efficiencies, shape).
_ROUTES: dict = {}
_PYTHON_PATTERN_LIMIT = 1024  # node_patterns: device slots below which plain Python beats numpy
_SHAPES: dict = {}
_LINES: dict = {}


def clear_caches():
    """Forget every cached route, shape and time line (benchmarks use it to time a cold start)."""
    _ROUTES.clear()
    _SHAPES.clear()
    _LINES.clear()


def _distinct_pairs(g: np.ndarray, s: np.ndarray):
    """The distinct (g, s) rows and each row's index among them. Group sizes and strides are small
    integers, so a dense table finds them in linear time (a search passes millions of rows);
    np.unique's sort is the fallback for huge machines."""
    span = int(s.max()) + 1
    key = g * span + s
    if int(key.max()) < 1 << 24:
        counts = np.bincount(key)
        present = np.flatnonzero(counts)
        lookup = np.zeros(len(counts), dtype=np.int64)
        lookup[present] = np.arange(len(present))
        return np.stack([present // span, present % span], axis=1), lookup[key]
    pairs, inverse = np.unique(np.stack([g, s], axis=1), axis=0, return_inverse=True)
    return pairs, inverse.reshape(-1)


def _lower_envelope(lines) -> np.ndarray:
    """The lines (a, b) that are the minimum somewhere on n >= 0, as an array; the others can
    never be the fastest and are dropped so that evaluating the minimum stays cheap."""
    rows = sorted(set((float(a), float(b)) for a, b in lines), key=lambda ab: (ab[1], ab[0]))
    kept = []
    for a, b in rows:  # by rising offset: a line survives only if it is steeper-no-more than all kept
        if all(a < ka for ka, _ in kept):
            kept.append((a, b))
    return np.array(kept)


def default_card_topology(system: System) -> str:
    """How the cards of a node are wired when the profile does not say: a switch (NVSwitch, shared
    memory) for one device per card, direct device-to-device links (Xe Link all-to-all among the
    4 GPUs of an SMNG-P2 node, as shared/reference/hardware.md assumes; the X-Bus path of an
    AC922) otherwise. Ring-based algorithms give the same numbers either way (every device sends one
    flow to one other device per step); tests check that."""
    return SWITCH if system.node.devices_per_card == 1 else ALL_TO_ALL


def nic_of(system: System, device: int) -> int:
    """NIC serving a device: NIC k serves devices [k D / N, (k+1) D / N) (one NIC per socket on
    SMNG-P2: tiles 0-3 and 4-7; one per GPU on a DGX)."""
    return device * system.network.nics_per_node // system.node.devices_per_node


def device(node: int, index: int):
    return ("device", node, index)


def _edges(system: System, nodes: int, card_topology: str | None = None):
    """Every link of the machine as (u, v, attributes); the one source of build_graph and the model."""
    nd, net = system.node, system.network
    D, C = nd.devices_per_node, nd.devices_per_card
    topology = card_topology or default_card_topology(system)
    if topology not in (SWITCH, ALL_TO_ALL):
        raise ValueError(f"card topology must be {SWITCH!r} or {ALL_TO_ALL!r}, got {topology!r}")

    def link(kind, bandwidth, latency, owner, penalty=0.0):
        return {"kind": kind, "bandwidth": bandwidth, "latency": latency, "node": owner,
                "cost": latency + penalty}

    core = ("core",)
    for n in range(nodes):
        for d in range(D):
            card = d // C
            for e in range(d + 1, (card + 1) * C):  # the other devices of the same card (MDFI)
                yield device(n, d), device(n, e), link(CARD, nd.card_link_bandwidth_Bps, nd.card_link_latency_s, n)
            if topology == SWITCH:  # one port per device into the node's switch (NVSwitch)
                yield device(n, d), ("switch", n), link(NODE, nd.node_link_bandwidth_Bps, nd.node_link_latency_s / 2, n)
            else:  # a direct link to every device on another card of the node (Xe Link)
                for e in range((card + 1) * C, D):
                    yield device(n, d), device(n, e), link(NODE, nd.node_link_bandwidth_Bps, nd.node_link_latency_s, n)
            # device to its NIC (PCIe through the host): never the bottleneck, no latency of its own
            yield device(n, d), ("nic", n, nic_of(system, d)), link(HOST, INF, 0.0, n, HOST_ROUTE_PENALTY_S)
        for k in range(net.nics_per_node):  # the NIC's uplink into a non-blocking core, / oversubscription
            yield ("nic", n, k), core, link(NETWORK, net.nic_bandwidth_Bps / net.oversubscription, net.latency_s / 2, n)


def build_graph(system: System, nodes: int, card_topology: str | None = None):
    """The machine of `nodes` nodes as an undirected networkx graph (links are full duplex: each
    direction has `bandwidth`). Vertices: ("device", node, index), ("switch", node),
    ("nic", node, k), ("core",); device vertices carry `card`."""
    import networkx as nx  # lazy: 0.25 s of import time that `perfsim predict` does not need

    graph = nx.Graph(name=system.name)
    C = system.node.devices_per_card
    for n in range(nodes):
        for d in range(system.node.devices_per_node):
            graph.add_node(device(n, d), node=n, card=d // C)
    for u, v, attrs in _edges(system, nodes, card_topology):
        graph.add_edge(u, v, **attrs)
    return graph


@dataclass(frozen=True)
class RingShape:
    """What each group of a dimension (g, s) gets when all its groups run a ring at once."""
    size: int
    stride: int
    bandwidth_Bps: float      # per-flow bandwidth of the slowest ring edge, collective efficiency applied
    raw_bandwidth_Bps: float  # the same from link bandwidths alone (bandwidth / flows on the bottleneck)
    latency_s: float          # the longest path of any ring edge
    bottleneck: str           # link kind that limits bandwidth_Bps
    flows: int                # flows sharing that bottleneck link (one direction)


def all_to_all_line(system: System, size: int, stride: float) -> tuple:
    """(seconds per byte, seconds) of one all-to-all in which each of `size` ranks `stride` apart
    sends n bytes in all (n / size to each member, itself included), every group of the dimension
    at once: time(n) = a n + b (docs/equations.md 12.3). A member's copies to members in its node
    cross NVLink (node_link_bandwidth x node_efficiency), those to other nodes its share of the
    node's NICs (nics x nic bandwidth / oversubscription x network_efficiency / devices per node,
    every device sending at once); the two run at once, so the slower sets a, and b is one link
    latency (NCCL posts the size - 1 sends and receives together). The profile's all_to_all
    factors scale it as any operation's (TopologyCommModel._op_lines)."""
    node, net, eff = system.node, system.network, system.collectives
    stride = max(float(stride), 1.0)
    per_node = min(max(math.floor(node.devices_per_node / stride), 1), size)  # members in one node
    nvlink = node.node_link_bandwidth_Bps * eff.node_efficiency
    nic = net.nics_per_node * net.nic_bandwidth_Bps / net.oversubscription * eff.network_efficiency \
        / node.devices_per_node
    slope = max((per_node - 1) / size / nvlink, (size - per_node) / size / nic)
    return slope, (net.latency_s if size > per_node else node.node_link_latency_s)


def node_patterns(devices_per_node: int, size: int, stride: int, wrap: bool = True):
    """The distinct ways one node takes part in dimension (size, stride): for every local device,
    where its ring edge goes (a local device index, -1 for another node, -2 for no edge) and
    whether an edge arrives from another node. Rings are ordered by rank (member k -> k+1, and the
    last back to the first when `wrap`; a pipeline chain has no wrap). The pattern of node n depends
    on n D mod (g s) only, so one period of at most g s / gcd(g s, D) nodes covers every node."""
    D, g, s = devices_per_node, size, stride
    block = g * s
    if block % D == 0 and (D % s == 0 or s % D == 0):
        # Regular placement: a node's pattern depends only on whether it holds the first members,
        # middle ones or the last ones of its groups; the nodes at these offsets show every case.
        starts = np.array(sorted({0, D % block, block - D} | ({s % block} if s % D == 0 else set())))
    else:
        starts = (np.arange(block // math.gcd(block, D)) * D) % block
    if len(starts) * D <= _PYTHON_PATTERN_LIMIT:  # small: plain Python is faster than numpy here
        rows = set()
        for a in starts.tolist():
            out, arrive = [], []
            for d in range(D):
                k = ((a + d) % block) // s
                dest = d + (-(g - 1) * s if k == g - 1 else s)
                src = d + ((g - 1) * s if k == 0 else -s)
                out.append(-2 if (not wrap and k == g - 1) else (dest if 0 <= dest < D else -1))
                arrive.append((src < 0 or src >= D) and (wrap or k != 0))
            rows.add((tuple(out), tuple(arrive)))
        return sorted(rows)
    d = np.arange(D)
    pos = (starts[:, None] + d[None, :]) % block
    k = pos // s
    last, first = k == g - 1, k == 0
    out_local = d + np.where(last, -(g - 1) * s, s)
    src_local = d + np.where(first, (g - 1) * s, -s)
    out = np.where((out_local >= 0) & (out_local < D), out_local, -1)
    arrive = (src_local < 0) | (src_local >= D)
    if not wrap:
        out = np.where(last, -2, out)
        arrive = arrive & ~first
    rows = np.unique(np.concatenate([out, arrive.astype(int)], axis=1), axis=0)
    return [(tuple(int(x) for x in r[:D]), tuple(bool(x) for x in r[D:])) for r in rows]


def binary_tree(size: int) -> np.ndarray:
    """Parent of every position 0..size-1 of an in-order binary tree rooted at 0 (parent -1).

    Position p > 0 with lowest set bit b hangs under p + b when bit 2b of p is clear and p + b < size,
    else under p - b; the root has one child, the largest power of two below size. Position p's
    subtree is p-b+1 .. p+b-1, odd positions are the leaves, the depth is ceil(log2 size)."""
    p = np.arange(size, dtype=np.int64)
    low = np.maximum(p & -p, 1)  # position 0 gets a placeholder: it is the root
    up = p + low
    parent = np.where(((p // (2 * low)) % 2 == 0) & (up < size), up, p - low)
    parent[0] = -1
    return parent


def double_binary_tree(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The two trees of an NCCL-style double binary tree over positions 0..size-1, as parent arrays.
    The second tree mirrors the first (position p plays size-1-p) when size is even, or shifts it by
    one (p plays p-1) when size is odd, so that the first tree's leaves (odd positions) are the
    second tree's inner members: every member is inner in at most one tree (even size)."""
    first = binary_tree(size)
    p = np.arange(size, dtype=np.int64)
    if size % 2 == 0:
        q = first[size - 1 - p]
        second = np.where(q >= 0, size - 1 - q, -1)
    else:
        q = first[(p - 1) % size]
        second = np.where(q >= 0, (q + 1) % size, -1)
    return first, second


def broadcast_trees(size: int) -> tuple[np.ndarray, np.ndarray]:
    """The double binary tree rooted at position 0 for a broadcast (or reduce) from member 0: the first
    tree as it is; the second with member 0 cut from its parent and hung above the second tree's
    root instead (member 0 sends that half to the root, which passes it on down)."""
    first, second = double_binary_tree(size)
    second = second.copy()
    if size > 1:
        root = int(np.flatnonzero(second < 0)[0])
        second[0], second[root] = -1, 0
    return first, second


def path_sums(parent: np.ndarray, edge: np.ndarray) -> np.ndarray:
    """For every position, the sum of `edge[..., q]` (the edge from q to its parent) over the
    positions q on its way up to the root (the root's own entry is ignored); pointer jumping,
    log2(depth) steps."""
    root = parent < 0
    above = np.where(root, np.arange(len(parent)), parent)
    total = np.where(root, 0.0, np.asarray(edge, dtype=float))  # edge may stack several rows: [..., size]
    for _ in range(len(parent).bit_length() + 1):  # a depth below len(parent) needs fewer doublings
        if root[above].all():
            return total
        total = total + total[..., above]
        above = above[above]
    raise ValueError("parent array is not a tree (a cycle, or no root)")


@dataclass(frozen=True)
class TreeShape:
    """What each group of a dimension (g, s) gets when all its groups run a pipelined double binary
    tree at once (`op` "all_reduce" or "broadcast"). Each tree carries half the message, every tree
    edge is one flow per direction it is used in, so the collective takes
    n / 2 / bandwidth_Bps + latency_s (docs/topology.md section 4)."""
    size: int
    stride: int
    op: str
    bandwidth_Bps: float      # per-flow bandwidth of the busiest link, collective efficiency applied
    raw_bandwidth_Bps: float  # the same from link bandwidths alone
    latency_s: float          # the first chunk's way: up and down the deeper tree (all-reduce), down (broadcast)
    depth: int                # levels of the deeper tree
    bottleneck: str           # link kind that limits bandwidth_Bps
    flows: int                # flows sharing that bottleneck (one direction)

    def time(self, nbytes):
        return 0.5 * nbytes / self.bandwidth_Bps + self.latency_s


class TopologyCommModel:
    """Collective times on the machine graph; the interface of collectives.CommModel.

    `router="graph"` (default) routes with this module's own shortest-path search; `"networkx"`
    routes with networkx on build_graph (slower; tests use it as the reference). `algorithm`
    overrides the profile's `collectives.algorithm` (auto, ring, tree, hierarchical)."""

    def __init__(self, system: System, router: str = "graph", card_topology: str | None = None,
                 algorithm: str | None = None):
        nd, eff = system.node, system.collectives
        self.algorithm_rule = algorithm or eff.algorithm
        if self.algorithm_rule not in ALGORITHMS:
            raise ValueError(f"collective algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm_rule!r}")
        self.system = system
        self.devices_per_node = nd.devices_per_node
        self.devices_per_card = nd.devices_per_card
        self.efficiency = {CARD: eff.card_efficiency, NODE: eff.node_efficiency,
                           NETWORK: eff.network_efficiency, HOST: 1.0}
        self.router, self.card_topology = router, card_topology
        machine = (nd, system.network, card_topology or default_card_topology(system), router)
        self._adjacency = None
        self._paths = _ROUTES.setdefault(machine, {})
        efficiencies = (eff.card_efficiency, eff.node_efficiency, eff.network_efficiency)
        self._shapes = _SHAPES.setdefault(machine + efficiencies, {})
        self._line_cache = _LINES.setdefault(machine + efficiencies + (self.algorithm_rule,), {})
        # The profile's per-operation factors (collectives.operation_efficiency, ..._latency_factor,
        # ..._step_overhead_s): only operations that differ from (1, 1, 0) are changed, so a profile
        # without them costs nothing.
        self.operation_factors = {op: f for op in OPERATIONS if (f := eff.operation_factors(op)) != (1.0, 1.0, 0.0)}
        factors = tuple(sorted(self.operation_factors.items()))
        self._op_line_cache = (_LINES.setdefault(machine + efficiencies + (self.algorithm_rule, factors), {})
                               if factors else None)
        self._groupings: dict = {}
        self._table_points: dict = {}  # (op, dtype) -> the model's seconds at a measured table's points

    # --- routing on the two-node graph: node 0 is studied, node 1 stands for "another node" ---
    def _graph(self):
        if self._adjacency is None:
            adjacency: dict = {}
            for u, v, attrs in _edges(self.system, 2, self.card_topology):
                adjacency.setdefault(u, []).append((v, attrs))
                adjacency.setdefault(v, []).append((u, attrs))
            self._adjacency = adjacency
        return self._adjacency

    def path(self, src, dst):
        """Links (u, v, attributes) of the cheapest route from src to dst, by summed latency."""
        key = (src, dst)
        if key not in self._paths:
            self._paths[key] = self._route_networkx(src, dst) if self.router == "networkx" else self._route(src, dst)
        return self._paths[key]

    def _route(self, src, dst):
        adjacency = self._graph()
        best, previous, heap, count = {src: 0.0}, {}, [(0.0, 0, src)], 1
        while heap:
            cost, _, u = heapq.heappop(heap)
            if u == dst:
                break
            if cost > best[u]:
                continue
            for v, attrs in adjacency[u]:
                c = cost + attrs["cost"]
                if c < best.get(v, INF):
                    best[v], previous[v] = c, (u, attrs)
                    heapq.heappush(heap, (c, count, v))
                    count += 1
        hops, v = [], dst
        while v != src:
            u, attrs = previous[v]
            hops.append((u, v, attrs))
            v = u
        return hops[::-1]

    def _route_networkx(self, src, dst):
        if not hasattr(self, "_nx_graph"):
            self._nx_graph = build_graph(self.system, 2, self.card_topology)
        import networkx as nx
        vertices = nx.shortest_path(self._nx_graph, src, dst, weight="cost")
        return [(u, v, self._nx_graph.edges[u, v]) for u, v in zip(vertices, vertices[1:])]

    # --- one dimension, all groups busy ---
    def ring(self, size: int, stride: int, wrap: bool = True) -> RingShape:
        """Per-flow bandwidth and latency of the ring (or, without wrap, chain) edges of dimension
        (size, stride), every group of the dimension sending at once."""
        size, stride = int(size), max(int(stride), 1)
        key = (size, stride, wrap)
        if key in self._shapes:
            return self._shapes[key]
        if size <= 1:
            shape = RingShape(size, stride, INF, INF, 0.0, "", 0)
        else:
            shape = self._ring(size, stride, wrap)
        self._shapes[key] = shape
        return shape

    def _ring(self, size, stride, wrap):
        D = self.devices_per_node
        best = (INF, INF, 0.0, "", 0)  # effective bw, raw bw, latency, kind, flows
        for out, arrive in node_patterns(D, size, stride, wrap):
            flows = []
            for d in range(D):
                if out[d] >= 0:
                    flows.append(self.path(device(0, d), device(0, out[d])))
                elif out[d] == -1:  # leaves the node: the remote device does not matter (non-blocking core)
                    flows.append(self.path(device(0, d), device(1, d)))
                if arrive[d]:
                    flows.append(self.path(device(1, d), device(0, d)))
            eff_bw, raw_bw, kind, nflows = self._bottleneck([(hops, 1) for hops in flows], best[:2] + best[3:])
            latency = max([best[2]] + [sum(attrs["latency"] for _, _, attrs in hops) for hops in flows])
            best = (eff_bw, raw_bw, latency, kind, nflows)
        return RingShape(size, stride, best[0], best[1], best[2], best[3], best[4])

    @staticmethod
    def _resources(hops):
        """The node-0 resources a route loads, each with its link's attributes. A card or node link
        loads the sending device's port and the receiving device's port of that kind: the profile's
        card/node bandwidths are per device (docs/profile-format.md), so on the all-to-all wiring the
        flows a device sends over all its Xe Links share one port, as on a switch (for rings, where a
        device sends one flow, this is the same as counting per link). A NIC's uplink and downlink are
        resources of their own; device-to-NIC (host) hops are never the bottleneck."""
        for u, v, attrs in hops:
            if attrs["node"] != 0 or attrs["kind"] == HOST:
                continue
            if attrs["kind"] == NETWORK:
                yield (u, v), attrs
                continue
            if u[0] == "device":
                yield (u, attrs["kind"], "out"), attrs
            if v[0] == "device":
                yield (v, attrs["kind"], "in"), attrs

    def _bottleneck(self, routes, best=(INF, INF, "", 0)):
        """(effective bandwidth, raw bandwidth, kind, flows) per flow on the busiest node-0 resource
        when the (hops, count) routes all run at once; `best` is the answer so far (kept if lower)."""
        load: dict = {}
        for hops, count in routes:
            for key, attrs in self._resources(hops):
                n, _ = load.get(key, (0, attrs))
                load[key] = (n + count, attrs)
        eff_bw, raw_bw, kind, nflows = best
        for n, attrs in load.values():
            raw_bw = min(raw_bw, attrs["bandwidth"] / n)
            e = attrs["bandwidth"] * self.efficiency[attrs["kind"]] / n
            if e < eff_bw:
                eff_bw, kind, nflows = e, attrs["kind"], n
        return eff_bw, raw_bw, kind, nflows

    def _latency(self, src, dst):
        return sum(attrs["latency"] for _, _, attrs in self.path(src, dst))

    def flows(self, size: int, stride: int, src, dst):
        """Every group of dimension (size, stride) sends, at once, one flow from its member at
        position src[i] to its member at dst[i], for every i (positions 0..size-1 in rank order).
        Returns (effective bandwidth, raw bandwidth, bottleneck kind, flows on it, latency of each
        flow i: its longest route over all groups). Like `ring`, it studies one node at a time on
        the two-node graph: the distinct nodes of one period g s / gcd(g s, D) of the placement."""
        D, g, s = self.devices_per_node, int(size), max(int(stride), 1)
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        E, block = len(src), g * s
        if s % D == 0:
            return self._flows_one_position(g, src, dst)
        starts = (np.arange(block // math.gcd(block, D), dtype=np.int64) * D) % block
        d = np.arange(D, dtype=np.int64)
        pos = ((starts[:, None] + d[None, :]) % block) // s  # position held by each device of each node

        def by_position(end):  # flow ids grouped by the position at one end, padded with -1: [g, M]
            order = np.argsort(end, kind="stable")
            counts = np.bincount(end, minlength=g)
            first = np.cumsum(counts) - counts
            table = np.full((g, max(int(counts.max()), 1)), -1, dtype=np.int64)
            table[end[order], np.arange(E) - first[end[order]]] = order
            return table

        out_ids, in_ids = by_position(src)[pos], by_position(dst)[pos]  # [nodes, D, M]
        here = d[None, :, None]
        sends = out_ids >= 0
        dest = here + (dst[out_ids] - pos[:, :, None]) * s  # local index of the receiving member
        local = sends & (dest >= 0) & (dest < D)
        code = np.where(sends, np.where(local, dest, -1), -2)  # local device, -1 another node, -2 none
        origin = here + (src[in_ids] - pos[:, :, None]) * s
        arrivals = ((in_ids >= 0) & ((origin < 0) | (origin >= D))).sum(axis=2)
        code.sort(axis=2)
        rows = {tuple(r) for r in np.concatenate([code.reshape(len(starts), -1), arrivals], axis=1).tolist()}

        M = code.shape[2]
        best = (INF, INF, "", 0)
        for row in rows:
            routes = []
            for dv in range(D):
                for c in row[dv * M:(dv + 1) * M]:
                    if c >= 0:
                        routes.append((self.path(device(0, dv), device(0, c)), 1))
                    elif c == -1:  # leaves the node: where it lands does not matter (non-blocking core)
                        routes.append((self.path(device(0, dv), device(1, dv)), 1))
                if row[D * M + dv]:
                    routes.append((self.path(device(1, dv), device(0, dv)), row[D * M + dv]))
            best = self._bottleneck(routes, best)

        # latency of each flow: its slowest placement (routes are cached per device pair)
        to = np.where(local, dest, D)  # column D: another node
        lat = np.zeros((D, D + 1))
        pairs = np.bincount((here * (D + 1) + to)[sends], minlength=D * (D + 1))  # np.unique would import numpy.ma
        for key in np.flatnonzero(pairs).tolist():
            a, b = divmod(key, D + 1)
            lat[a, b] = self._latency(device(0, a), device(0 if b < D else 1, b if b < D else a))
        latency = np.zeros(E)
        np.maximum.at(latency, out_ids[sends], lat[np.broadcast_to(here, to.shape)[sends], to[sends]])
        return best + (latency,)

    def _flows_one_position(self, g, src, dst):
        """`flows` when the stride is a multiple of devices_per_node: the D devices of a node hold one
        position k of D different groups, and every flow leaves or enters the node. A node's load is
        fixed by how many flows position k sends and receives, so only those pairs are studied."""
        D = self.devices_per_node
        degrees = set(zip(np.bincount(src, minlength=g).tolist(), np.bincount(dst, minlength=g).tolist()))
        best = (INF, INF, "", 0)
        for sent, received in degrees:
            routes = []
            for dv in range(D):
                if sent:
                    routes.append((self.path(device(0, dv), device(1, dv)), sent))
                if received:
                    routes.append((self.path(device(1, dv), device(0, dv)), received))
            best = self._bottleneck(routes, best)
        away = max(self._latency(device(0, dv), device(1, dv)) for dv in range(D))
        return best + (np.full(len(src), away),)

    def tree(self, size: int, stride: int, op: str = ALL_REDUCE) -> TreeShape:
        """Bandwidth and latency of a pipelined double binary tree over dimension (size, stride),
        every group running it at once: op "all_reduce" (reduce up both trees, broadcast down, at
        once) or "broadcast" (down both trees from member 0; a reduce is the same, reversed)."""
        size, stride = int(size), max(int(stride), 1)
        key = ("tree", op, size, stride)
        if key not in self._shapes:
            self._shapes[key] = self._tree(size, stride, op)
        return self._shapes[key]

    def _tree(self, g, s, op):
        if g <= 1:
            return TreeShape(g, s, op, INF, INF, 0.0, 0, "", 0)
        if g == 2:  # both trees are the one edge: the ring's flows and steps (n/2 twice each way)
            r = self.ring(2, s, wrap=op == ALL_REDUCE)
            steps = 2 if op == ALL_REDUCE else 1
            return TreeShape(g, s, op, r.bandwidth_Bps / 2, r.raw_bandwidth_Bps / 2, steps * r.latency_s, 1,
                             r.bottleneck, 2 * r.flows)
        if op == ALL_REDUCE:
            trees, directions = double_binary_tree(g), ("up", "down")
        elif op == BROADCAST:
            trees, directions = broadcast_trees(g), ("down",)
        else:
            raise ValueError(f"tree op must be {ALL_REDUCE!r} or {BROADCAST!r}, got {op!r}")
        src, dst, ids = [], [], []  # ids[t][direction]: flow id of each position's edge to its parent
        for parent in trees:
            child = np.flatnonzero(parent >= 0)
            index = {}
            for direction in directions:
                ends = (child, parent[child]) if direction == "up" else (parent[child], child)
                flow_id = np.full(g, -1, dtype=np.int64)
                flow_id[child] = np.arange(len(child)) + sum(len(x) for x in src)
                src.append(ends[0])
                dst.append(ends[1])
                index[direction] = flow_id
            ids.append(index)
        eff_bw, raw_bw, kind, nflows, latency = self.flows(g, s, np.concatenate(src), np.concatenate(dst))
        total, depth = 0.0, 0
        for parent, index in zip(trees, ids):  # per tree: the longest way up, the longest way down, levels
            edges = [np.where(flow_id >= 0, latency[flow_id], 0.0) for flow_id in index.values()] + [np.ones(g)]
            longest = path_sums(parent, np.array(edges)).max(axis=1)
            total, depth = max(total, float(longest[:-1].sum())), max(depth, int(longest[-1]))
        return TreeShape(g, s, op, eff_bw, raw_bw, total, depth, kind, nflows)

    # --- algorithms: times for one shape, vectorised over nbytes ---
    def _splits(self, g, s):
        """Sizes m of local sub-groups (one card's or one node's members) a hierarchical algorithm
        can use: m consecutive members share the card (node), m divides g, 1 < m < g."""
        out = []
        for domain in (self.devices_per_card, self.devices_per_node):
            if s < domain and domain % s == 0:
                m = domain // s
                if 1 < m < g and g % m == 0 and m not in out:
                    out.append(m)
        return out

    def _node_split(self, g, s):
        D = self.devices_per_node
        if s < D and D % s == 0:
            m = D // s
            if 1 < m < g and g % m == 0:
                return m
        return None

    def _multi_ring(self, n, g, s, steps_factor):
        """NCCL-style channels: m rings (m members per node), each carrying n/m, each leaving the
        node through a different member, so every member's NIC share is used. Per ring step a device
        sends one chunk of n/(m g) off-node and m-1 chunks to its in-node neighbour."""
        m = self._node_split(g, s)
        inside, across, whole = self.ring(m, s), self.ring(g // m, m * s), self.ring(g, s)
        per_step = n / (m * g) * max((m - 1) / inside.bandwidth_Bps, 1 / across.bandwidth_Bps)
        return steps_factor * (g - 1) * (per_step + whole.latency_s)

    def _options(self, op, n, g, s):
        """(time, label) of every algorithm the rule (`collectives.algorithm`) allows for `op` over
        (g, s), g > 1: op "all_reduce", "reduce_scatter" (all-gather alike) or "broadcast" (reduce
        alike). Labels are callables: they name the sub-collectives, which costs a little."""
        rule = self.algorithm_rule
        if op == BROADCAST:
            r = self.ring(g, s, wrap=False)
            chain = (n / r.bandwidth_Bps + (g - 1) * r.latency_s, lambda: f"chain({g}, stride {s})")
            if rule not in (AUTO, TREE):
                return [chain]
            tree = (self.tree(g, s, BROADCAST).time(n), lambda: f"double binary tree({g}, stride {s})")
            return [chain, tree] if rule == AUTO else [tree]
        k = 2 if op == ALL_REDUCE else 1
        r = self.ring(g, s)
        rings = [(k * (g - 1) / g * n / r.bandwidth_Bps + k * (g - 1) * r.latency_s, lambda: f"ring({g}, stride {s})")]
        channels = self._node_split(g, s)
        if channels:
            rings.append((self._multi_ring(n, g, s, k), lambda: f"{channels}-channel ring({g}, stride {s})"))
        if rule == RING or (rule == TREE and op != ALL_REDUCE):  # no tree reduce-scatter (as in NCCL)
            return rings
        trees = []
        if op == ALL_REDUCE:
            trees = [(self.tree(g, s, ALL_REDUCE).time(n), lambda: f"double binary tree({g}, stride {s})")]
            if rule == TREE:
                return trees
        hierarchical = []
        for m in self._splits(g, s):  # local reduce-scatter, op across sub-groups on n/m, local all-gather
            t = k * self._time(REDUCE_SCATTER, n, m, s) + self._time(op, n / m, g // m, m * s)
            hierarchical.append((t, lambda m=m: f"hierarchical[{self.algorithm(REDUCE_SCATTER, n, m, s)} | "
                                                 f"{self.algorithm(op, n / m, g // m, m * s)}]"))
        if rule == HIERARCHICAL:
            return hierarchical or rings
        return rings + trees + hierarchical

    def _time(self, op, n, g, s):
        """Time of the fastest allowed algorithm for `op` on n bytes (elementwise) over (g, s)."""
        lines = self._lines(op, g, s)
        return np.min(np.asarray(n, float)[..., None] * lines[:, 0] + lines[:, 1], axis=-1)

    def _lines(self, op, g, s) -> np.ndarray:
        """`op`'s time over (g, s) as the lower envelope of lines: rows (seconds per byte, seconds),
        time(n) = min over rows of a n + b. Every algorithm of `_options` is linear in n, and a
        hierarchical one is a sum of such minima, itself the minimum of the sums of their lines;
        cached per shape, so a search's millions of calls cost one gather and one minimum."""
        key = (op, int(g), max(int(s), 1))
        cached = self._line_cache.get(key)
        if cached is not None:
            return cached
        g, s = key[1], key[2]
        if g <= 1:
            lines = np.zeros((1, 2))
        else:
            lines = _lower_envelope(self._option_lines(op, g, s))
        self._line_cache[key] = lines
        return lines

    def _option_lines(self, op, g, s) -> list:
        """The lines of every algorithm `_options` offers, in the same order and under the same rule."""
        rule = self.algorithm_rule
        if op == ALL_TO_ALL_OP:
            return [all_to_all_line(self.system, g, s)]
        if op == SEND:  # one hop of a chain, every chain sending at once
            r = self.ring(g, s, wrap=False)
            return [(1 / r.bandwidth_Bps, r.latency_s)]
        if op == BROADCAST:
            r = self.ring(g, s, wrap=False)
            chain = [(1 / r.bandwidth_Bps, (g - 1) * r.latency_s)]
            if rule not in (AUTO, TREE):
                return chain
            t = self.tree(g, s, BROADCAST)
            tree = [(0.5 / t.bandwidth_Bps, t.latency_s)]
            return chain + tree if rule == AUTO else tree
        k = 2 if op == ALL_REDUCE else 1
        r = self.ring(g, s)
        rings = [(k * (g - 1) / g / r.bandwidth_Bps, k * (g - 1) * r.latency_s)]
        m = self._node_split(g, s)
        if m:
            inside, across, whole = self.ring(m, s), self.ring(g // m, m * s), self.ring(g, s)
            per_byte = max((m - 1) / inside.bandwidth_Bps, 1 / across.bandwidth_Bps) / (m * g)
            rings.append((k * (g - 1) * per_byte, k * (g - 1) * whole.latency_s))
        if rule == RING or (rule == TREE and op != ALL_REDUCE):
            return rings
        trees = []
        if op == ALL_REDUCE:
            t = self.tree(g, s, ALL_REDUCE)
            trees = [(0.5 / t.bandwidth_Bps, t.latency_s)]
            if rule == TREE:
                return trees
        hierarchical = []
        for m in self._splits(g, s):  # k local reduce-scatters of n, then op across sub-groups on n/m
            local, across = self._lines(REDUCE_SCATTER, m, s), self._lines(op, g // m, m * s)
            hierarchical += [(k * a1 + a2 / m, k * b1 + b2) for a1, b1 in local for a2, b2 in across]
        if rule == HIERARCHICAL:
            return hierarchical or rings
        return rings + trees + hierarchical

    def _op_lines(self, op, g, s) -> np.ndarray:
        """`op`'s lines over (g, s) with the profile's per-operation factors applied: every slope
        divided by the operation's efficiency, every offset multiplied by its latency factor, then
        the step overhead added to it. All three change every algorithm of the operation alike, so
        the envelope keeps the same lines."""
        lines = self._lines(_ALGORITHMS_OF[op], g, s)
        factors = self.operation_factors.get(op)
        if factors is None or g <= 1:  # a group of one sends nothing and waits for nobody
            return lines
        key = (op, int(g), max(int(s), 1))
        scaled = self._op_line_cache.get(key)
        if scaled is None:
            scaled = lines * np.array([1.0 / factors[0], factors[1]]) + np.array([0.0, factors[2]])
            self._op_line_cache[key] = scaled
        return scaled

    def algorithm(self, op: str, nbytes: float, size: int, stride: int) -> str:
        """Which algorithm `op` ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
        uses for one call of nbytes over (size, stride), under the profile's rule."""
        g, s = int(size), max(int(stride), 1)
        if g <= 1:
            return "none"
        if op == ALL_TO_ALL_OP:
            return DIRECT
        efficiency, latency_factor, _ = self.operation_factors.get(op, (1.0, 1.0, 0.0))  # an overhead picks none
        # a n / e + f b = f (a n / (e f) + b): the scaled operation's fastest algorithm at n is the
        # unscaled one's at n / (e f)
        n = np.asarray(float(nbytes) / (efficiency * latency_factor))
        op = {ALL_GATHER: REDUCE_SCATTER, REDUCE: BROADCAST}.get(op, op)
        return min(self._options(op, n, g, s), key=lambda o: float(o[0]))[1]()

    # --- the CommModel interface ---
    def _each_shape(self, lines_of, nbytes, size, stride, fill=0.0):
        """min over lines_of(g, s) of a n + b, row by row, for every distinct (g, s) with g > 1;
        `fill` where g <= 1. Rows are matched to their shape's lines by index, not by a loop."""
        pairs, inverse, group_shape = self._group_shapes(size, stride)
        nbytes = np.asarray(nbytes, float)
        shape = np.broadcast_shapes(nbytes.shape, group_shape)
        if shape != group_shape:  # more sizes than groups: spread the groups' indices over them
            inverse = np.broadcast_to(inverse.reshape(group_shape), shape).reshape(-1)
        n = np.broadcast_to(nbytes, shape).reshape(-1)
        tables = [lines_of(int(gi), int(si)) if gi > 1 else np.array([[0.0, fill]]) for gi, si in pairs]
        width = max(len(t) for t in tables)
        slope, offset = np.zeros((len(tables), width)), np.full((len(tables), width), INF)
        for i, t in enumerate(tables):
            slope[i, :len(t)], offset[i, :len(t)] = t[:, 0], t[:, 1]
        out = slope[:, 0][inverse] * n + offset[:, 0][inverse]
        for j in range(1, width):  # column by column: contiguous, unlike a minimum along a short axis
            np.minimum(out, slope[:, j][inverse] * n + offset[:, j][inverse], out=out)
        return out.reshape(shape)

    def _group_shapes(self, size, stride):
        """(distinct (g, s) pairs, each entry's index among them, shape) of size and stride arrays
        broadcast together. A plan batch passes the same arrays to dozens of collectives, so the
        answer is remembered per pair of array objects while they live."""
        if np.ndim(size) == 0 and np.ndim(stride) == 0:
            return np.array([[int(size), max(int(stride), 1)]]), np.zeros(1, dtype=np.int64), ()
        key = (id(size), id(stride))
        hit = self._groupings.get(key)
        if hit is not None and hit[0]() is size and hit[1]() is stride:
            return hit[2:]
        size_b, stride_b = np.broadcast_arrays(np.asarray(size), np.asarray(stride))
        g = size_b.reshape(-1).astype(np.int64)
        s = np.maximum(stride_b.reshape(-1).astype(np.int64), 1)
        pairs, inverse = _distinct_pairs(g, s)
        try:
            refs = (weakref.ref(size), weakref.ref(stride))
        except TypeError:  # plain numbers or lists: nothing to remember them by
            return pairs, inverse, size_b.shape
        self._groupings = {k: v for k, v in self._groupings.items() if v[0]() is not None and v[1]() is not None}
        self._groupings[key] = refs + (pairs, inverse, size_b.shape)
        return pairs, inverse, size_b.shape

    def _measured(self, op: str, times, nbytes, size, stride):
        """`times` of `op` corrected by the profile's measured table of the prediction's dtype
        (perfsim.cost.measured: near a measured (group size, stride, bytes) the measurement, far
        from all the link model); `times` itself without one."""
        table = measured.find_table(self.system.collectives.measured, op, self.system.device.kernel_dtype)
        if table is None:
            return times
        at_points = self._table_points.get((op, table.dtype))
        if at_points is None:  # the link model at the table's own points, once per model
            at_points = self._table_points[(op, table.dtype)] = np.array(
                [float(self._each_shape(lambda gi, si: self._op_lines(op, gi, si), ni, int(gi), int(si)))
                 for gi, si, ni in zip(*table.coordinates_linear())])
        size_b, stride_b, bytes_b = np.broadcast_arrays(np.asarray(size, float), np.maximum(np.asarray(stride, float), 1),
                                                        np.asarray(nbytes, float))
        factor, _ = measured.correction(table, [np.maximum(size_b, 1), stride_b, np.maximum(bytes_b, 1)], at_points)
        return times * np.where(size_b > 1, factor, 1.0)  # a group of one sends nothing

    def link(self, size, stride):
        """(bandwidth in bytes/s, latency in s) of one step of the flat ring, all groups busy
        (efficiency applied; infinite bandwidth and zero latency for a group of one)."""
        bw = self._each_shape(lambda g, s: np.array([[0.0, self.ring(g, s).bandwidth_Bps]]), 0.0, size, stride, fill=INF)
        lat = self._each_shape(lambda g, s: np.array([[0.0, self.ring(g, s).latency_s]]), 0.0, size, stride)
        return bw, lat

    def all_reduce(self, nbytes, size, stride):
        return self._measured(ALL_REDUCE, self._each_shape(lambda g, s: self._op_lines(ALL_REDUCE, g, s), nbytes, size, stride),
                             nbytes, size, stride)

    def all_gather(self, nbytes, size, stride):
        """n is the full (gathered) tensor's bytes."""
        return self._measured(ALL_GATHER, self._each_shape(lambda g, s: self._op_lines(ALL_GATHER, g, s), nbytes, size, stride),
                             nbytes, size, stride)

    def reduce_scatter(self, nbytes, size, stride):
        """n is the full (unscattered) tensor's bytes; the all-gather's algorithms, run the other way."""
        return self._measured(REDUCE_SCATTER, self._each_shape(lambda g, s: self._op_lines(REDUCE_SCATTER, g, s), nbytes, size, stride),
                             nbytes, size, stride)

    def broadcast(self, nbytes, size, stride):
        """Broadcast (or reduce) from one member: the pipelined chain in rank order,
        n / B + (g-1) alpha, or the pipelined double binary tree (docs/topology.md section 4)."""
        return self._measured(BROADCAST, self._each_shape(lambda g, s: self._op_lines(BROADCAST, g, s), nbytes, size, stride),
                             nbytes, size, stride)

    def reduce(self, nbytes, size, stride):
        """Reduce to one member: the broadcast's flows, reversed (links are full duplex and symmetric)."""
        return self._measured(REDUCE, self._each_shape(lambda g, s: self._op_lines(REDUCE, g, s), nbytes, size, stride),
                             nbytes, size, stride)

    def all_to_all(self, nbytes, size, stride):
        """All-to-all in which each member sends nbytes in all (nbytes / size to each member, itself
        included): all_to_all_line, with the profile's all_to_all factors and measured table."""
        return self._measured(ALL_TO_ALL_OP, self._each_shape(lambda g, s: self._op_lines(ALL_TO_ALL_OP, g, s), nbytes,
                                                              size, stride), nbytes, size, stride)

    def send(self, nbytes, size, stride):
        """Point-to-point messages between neighbours of a chain of `size` ranks `stride` apart
        (pipeline stages), all chains sending at once: n / B + alpha of the slowest hop."""
        return self._measured(SEND, self._each_shape(lambda g, s: self._op_lines(SEND, g, s), nbytes, size, stride),
                             nbytes, size, stride)
