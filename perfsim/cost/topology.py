"""The machine as a graph, and what a group of ranks really gets on it (docs/topology.md).

`build_graph(system, nodes)` gives the machine as a networkx graph: one vertex per device, links
between the devices of one card, between cards of one node (a switch vertex, or direct links), one
vertex per NIC, and the fat tree as one core switch. Every edge carries `bandwidth` (bytes/s, one
direction; links are full duplex), `latency` (s), `kind` (card, node, network, host) and `node`
(the node whose link it is).

`TopologyCommModel(system)` answers the questions `collectives.CommModel` answers, with the same
interface (`link`, `all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `reduce`, `send`,
numpy arrays welcome), by routing every ring edge of every group of a parallel dimension over the
graph at once, counting the flows on each directed link, and choosing per collective and size the
fastest of a flat ring, NCCL-style multi-channel rings, and hierarchical algorithms.

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
import math
from dataclasses import dataclass

import numpy as np

from perfsim.spec.system import System

CARD, NODE, NETWORK, HOST = "card", "node", "network", "host"
LINK_KINDS = (CARD, NODE, NETWORK, HOST)
SWITCH, ALL_TO_ALL = "switch", "all-to-all"

# Routing cost added per device<->NIC hop, in seconds of path cost: large enough that a NIC is never
# a shortcut between two devices of one node, and equal on every inter-node route (each has two).
HOST_ROUTE_PENALTY_S = 1.0
INF = math.inf

# Per-process caches shared by every model of the same machine (a prediction builds several models):
# routes per (node, network, card topology, router); ring shapes per (machine, efficiencies, shape).
_ROUTES: dict = {}
_PYTHON_PATTERN_LIMIT = 1024  # node_patterns: device slots below which plain Python beats numpy
_SHAPES: dict = {}


def clear_caches():
    """Forget every cached route and shape (benchmarks use it to time a cold start)."""
    _ROUTES.clear()
    _SHAPES.clear()


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


class TopologyCommModel:
    """Collective times on the machine graph; the interface of collectives.CommModel.

    `router="graph"` (default) routes with this module's own shortest-path search; `"networkx"`
    routes with networkx on build_graph (slower; tests use it as the reference)."""

    def __init__(self, system: System, router: str = "graph", card_topology: str | None = None):
        nd, eff = system.node, system.collectives
        self.system = system
        self.devices_per_node = nd.devices_per_node
        self.devices_per_card = nd.devices_per_card
        self.efficiency = {CARD: eff.card_efficiency, NODE: eff.node_efficiency,
                           NETWORK: eff.network_efficiency, HOST: 1.0}
        self.router, self.card_topology = router, card_topology
        machine = (nd, system.network, card_topology or default_card_topology(system), router)
        self._adjacency = None
        self._paths = _ROUTES.setdefault(machine, {})
        self._shapes = _SHAPES.setdefault(machine + (eff,), {})

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
            load: dict = {}
            for hops in flows:
                for u, v, attrs in hops:
                    if attrs["node"] == 0:
                        load[(u, v)] = load.get((u, v), 0) + 1
            eff_bw, raw_bw, latency, kind, nflows = best
            for hops in flows:
                latency = max(latency, sum(attrs["latency"] for _, _, attrs in hops))
                for u, v, attrs in hops:
                    if attrs["node"] != 0:
                        continue
                    n = load[(u, v)]
                    raw_bw = min(raw_bw, attrs["bandwidth"] / n)
                    e = attrs["bandwidth"] * self.efficiency[attrs["kind"]] / n
                    if e < eff_bw:
                        eff_bw, kind, nflows = e, attrs["kind"], n
            best = (eff_bw, raw_bw, latency, kind, nflows)
        return RingShape(size, stride, best[0], best[1], best[2], best[3], best[4])

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

    def _reduce_scatter(self, n, g, s):
        """Best reduce-scatter (= all-gather) time of n bytes over dimension (g, s)."""
        if g <= 1:
            return np.zeros_like(n)
        r = self.ring(g, s)
        t = (g - 1) / g * n / r.bandwidth_Bps + (g - 1) * r.latency_s
        if self._node_split(g, s):
            t = np.minimum(t, self._multi_ring(n, g, s, 1))
        for m in self._splits(g, s):  # local reduce-scatter of n, then across sub-groups on n/m
            t = np.minimum(t, self._reduce_scatter(n, m, s) + self._reduce_scatter(n / m, g // m, m * s))
        return t

    def _all_reduce(self, n, g, s):
        if g <= 1:
            return np.zeros_like(n)
        r = self.ring(g, s)
        t = 2 * (g - 1) / g * n / r.bandwidth_Bps + 2 * (g - 1) * r.latency_s
        if self._node_split(g, s):
            t = np.minimum(t, self._multi_ring(n, g, s, 2))
        for m in self._splits(g, s):  # local reduce-scatter, all-reduce of n/m across, local all-gather
            t = np.minimum(t, 2 * self._reduce_scatter(n, m, s) + self._all_reduce(n / m, g // m, m * s))
        return t

    def algorithm(self, op: str, nbytes: float, size: int, stride: int) -> str:
        """Which algorithm `op` ("all_reduce" or "reduce_scatter"/"all_gather") uses for one call."""
        g, s, n = int(size), max(int(stride), 1), np.asarray(float(nbytes))
        if g <= 1:
            return "none"
        ar = op == "all_reduce"
        whole = self._all_reduce if ar else self._reduce_scatter
        r = self.ring(g, s)
        k = 2 if ar else 1
        options = [(k * (g - 1) / g * n / r.bandwidth_Bps + k * (g - 1) * r.latency_s, f"ring({g}, stride {s})")]
        if self._node_split(g, s):
            options.append((self._multi_ring(n, g, s, k), f"{self._node_split(g, s)}-channel ring({g}, stride {s})"))
        for m in self._splits(g, s):
            local = self._reduce_scatter(n, m, s)
            rest = whole(n / m, g // m, m * s)
            options.append((k * local + rest, f"hierarchical[{self.algorithm('reduce_scatter', n, m, s)} | "
                                              f"{self.algorithm(op, n / m, g // m, m * s)}]"))
        return min(options, key=lambda o: float(o[0]))[1]

    # --- the CommModel interface ---
    def _each_shape(self, fn, nbytes, size, stride, fill=0.0):
        """fn(nbytes, g, s) for every distinct (g, s) with g > 1; `fill` where g <= 1."""
        nbytes, size, stride = np.broadcast_arrays(np.asarray(nbytes, float), np.asarray(size), np.asarray(stride))
        shape = nbytes.shape
        n, g, s = nbytes.reshape(-1), size.reshape(-1).astype(np.int64), np.maximum(stride.reshape(-1).astype(np.int64), 1)
        out = np.full(n.shape, fill)
        if n.size == 1:
            if g[0] > 1:
                out[:] = fn(n, int(g[0]), int(s[0]))
            return out.reshape(shape)
        pairs, inverse = np.unique(np.stack([g, s], axis=1), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        for i, (gi, si) in enumerate(pairs):
            if gi > 1:
                mask = inverse == i
                out[mask] = fn(n[mask], int(gi), int(si))
        return out.reshape(shape)

    def link(self, size, stride):
        """(bandwidth in bytes/s, latency in s) of one step of the flat ring, all groups busy
        (efficiency applied; infinite bandwidth and zero latency for a group of one)."""
        bw = self._each_shape(lambda n, g, s: self.ring(g, s).bandwidth_Bps, 0.0, size, stride, fill=INF)
        lat = self._each_shape(lambda n, g, s: self.ring(g, s).latency_s, 0.0, size, stride)
        return bw, lat

    def all_reduce(self, nbytes, size, stride):
        return self._each_shape(self._all_reduce, nbytes, size, stride)

    def all_gather(self, nbytes, size, stride):
        """n is the full (gathered) tensor's bytes."""
        return self._each_shape(self._reduce_scatter, nbytes, size, stride)

    reduce_scatter = all_gather  # the same algorithms, run the other way

    def broadcast(self, nbytes, size, stride):
        """Pipelined broadcast (or reduce) along the rank-ordered chain: about n / B + (g-1) alpha."""
        def chain(n, g, s):
            r = self.ring(g, s, wrap=False)
            return n / r.bandwidth_Bps + (g - 1) * r.latency_s
        return self._each_shape(chain, nbytes, size, stride)

    reduce = broadcast

    def send(self, nbytes, size, stride):
        """Point-to-point messages between neighbours of a chain of `size` ranks `stride` apart
        (pipeline stages), all chains sending at once: n / B + alpha of the slowest hop."""
        def hop(n, g, s):
            r = self.ring(g, s, wrap=False)
            return n / r.bandwidth_Bps + r.latency_s
        return self._each_shape(hop, nbytes, size, stride)
