"""Topology-aware communication model (perfsim/cost/topology.py, docs/topology.md).

Expected values come from the profiles' link numbers and hand arithmetic, and from a brute-force
reference written here: route every ring edge of every group of a whole small machine over
build_graph with networkx and count flows on every link. The model itself studies one node at a
time on a two-node graph with its own router, so the two computations share only the graph.
"""

from __future__ import annotations

import math
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from perfsim.cost.collectives import CommModel
from perfsim.cost import topology
from perfsim.cost.topology import TopologyCommModel, build_graph, node_patterns
from perfsim.spec.system import load_system

PROFILES = ("smng-p2", "dgx-a100", "dgx-h100", "v100-tacc", "cpu-example")


@pytest.fixture(scope="module")
def smng():
    return load_system("smng-p2")


@pytest.fixture(scope="module")
def dgx():
    return load_system("dgx-a100")


def brute_force(system, size, stride, nodes, card_topology=None):
    """(raw bandwidth, effective bandwidth, latency) of the slowest ring edge of dimension
    (size, stride) on `nodes` whole nodes, every group's ring running at once."""
    graph = build_graph(system, nodes, card_topology)
    D = system.node.devices_per_node
    world = nodes * D
    assert world % (size * stride) == 0
    eff = {"card": system.collectives.card_efficiency, "node": system.collectives.node_efficiency,
           "network": system.collectives.network_efficiency, "host": 1.0}
    dev = lambda r: ("device", r // D, r % D)  # noqa: E731
    routes = []
    for r in range(world):
        k = (r // stride) % size
        dst = r + stride if k < size - 1 else r - (size - 1) * stride
        routes.append(nx.shortest_path(graph, dev(r), dev(dst), weight="cost"))
    load = {}
    for path in routes:
        for u, v in zip(path, path[1:]):
            load[(u, v)] = load.get((u, v), 0) + 1
    raw = effective = math.inf
    latency = 0.0
    for path in routes:
        latency = max(latency, sum(graph.edges[u, v]["latency"] for u, v in zip(path, path[1:])))
        for u, v in zip(path, path[1:]):
            e = graph.edges[u, v]
            raw = min(raw, e["bandwidth"] / load[(u, v)])
            effective = min(effective, e["bandwidth"] * eff[e["kind"]] / load[(u, v)])
    return raw, effective, latency


# ---- known cases -------------------------------------------------------------------------------

def test_ring_over_the_eight_tiles_of_one_smng_node(smng):
    r = TopologyCommModel(smng).ring(8, 1)
    xe_link = smng.node.node_link_bandwidth_Bps  # ALCF measurement in the profile
    assert r.raw_bandwidth_Bps == pytest.approx(xe_link)
    assert r.bandwidth_Bps == pytest.approx(xe_link * 0.7)  # x node_efficiency
    assert r.bottleneck == "node"
    assert r.latency_s == pytest.approx(smng.node.node_link_latency_s)


def test_data_parallel_one_tile_per_node_shares_the_nics(smng):
    # stride 8, size 4: every tile of every node sends off-node at once; 2 HDR NICs of 25 GB/s
    r = TopologyCommModel(smng).ring(4, 8)
    assert r.raw_bandwidth_Bps == pytest.approx(2 * 25e9 / 8)  # 6.25e9
    assert r.bandwidth_Bps == pytest.approx(6.25e9 * smng.collectives.network_efficiency)
    assert r.bottleneck == "network" and r.flows == 4  # 4 tiles per NIC
    assert r.latency_s == pytest.approx(smng.network.latency_s)


def test_two_tiles_of_one_card_get_mdfi(smng):
    r = TopologyCommModel(smng).ring(2, 1)
    assert r.raw_bandwidth_Bps == pytest.approx(196e9)
    assert r.bandwidth_Bps == pytest.approx(196e9 * 0.7)
    assert r.bottleneck == "card"


def test_dgx_a100_eight_gpu_ring_gets_nvlink(dgx):
    r = TopologyCommModel(dgx).ring(8, 1)
    assert r.raw_bandwidth_Bps == pytest.approx(300e9)
    assert r.bandwidth_Bps == pytest.approx(300e9 * 0.775)


def test_ring_across_nodes_on_dgx_leaves_through_one_nic(dgx):
    # a rank-ordered ring over 16 GPUs has one off-node edge per node, through one GPU's own NIC
    r = TopologyCommModel(dgx).ring(16, 1)
    assert r.raw_bandwidth_Bps == pytest.approx(25e9)
    assert r.bottleneck == "network"


def test_odd_group_size_straddles_nodes(smng):
    # tp=4, dp=35: some nodes hold the last member of one block and the first of the next, so all
    # 8 tiles send off-node there: 4 per NIC (CommModel assumes 2 members per node: 12.5 GB/s)
    r = TopologyCommModel(smng).ring(35, 4)
    assert r.raw_bandwidth_Bps == pytest.approx(25e9 / 4)


# ---- the model equals a brute force over whole machines, for every profile and many shapes ----

SHAPES = [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4), (16, 1), (8, 2), (4, 4), (2, 8), (4, 8),
          (3, 8), (6, 4), (3, 4), (12, 2), (2, 16), (5, 8)]


def odd_machine():
    """12 devices per node in cards of 3, 3 NICs: placements that straddle cards and NICs."""
    from dataclasses import replace
    s = load_system("smng-p2")
    return replace(s, node=replace(s.node, devices_per_node=12, devices_per_card=3),
                   network=replace(s.network, nics_per_node=3))


@pytest.mark.parametrize("name", PROFILES + ("odd",))
def test_model_equals_brute_force(name):
    system = odd_machine() if name == "odd" else load_system(name)
    D = system.node.devices_per_node
    model = TopologyCommModel(system)
    for g, s in SHAPES:
        world = math.lcm(g * s, D)
        nodes = world // D
        if nodes > 16:
            continue
        raw, eff, lat = brute_force(system, g, s, nodes)
        r = model.ring(g, s)
        assert r.raw_bandwidth_Bps == pytest.approx(raw), (name, g, s)
        assert r.bandwidth_Bps == pytest.approx(eff), (name, g, s)
        assert r.latency_s == pytest.approx(lat), (name, g, s)


def test_same_shape_same_answer_on_any_number_of_nodes(smng):
    model = TopologyCommModel(smng)
    for g, s, node_counts in [(8, 1, (1, 2, 32)), (4, 2, (1, 4, 16)), (16, 1, (2, 4, 32)), (32, 8, (32,)),
                              (4, 8, (4, 8, 32)), (35, 4, (35,))]:
        for nodes in node_counts:
            raw, eff, lat = brute_force(smng, g, s, nodes)
            assert (raw, eff, lat) == pytest.approx((model.ring(g, s).raw_bandwidth_Bps,
                                                     model.ring(g, s).bandwidth_Bps, model.ring(g, s).latency_s))
    # the model has no node count: a plan's shapes on 1024 nodes are answered from the same cache
    ring = TopologyCommModel(smng, algorithm="ring")
    bw = 6.25e9 * smng.collectives.network_efficiency
    assert ring.all_reduce(1e9, 1024, 8) == pytest.approx(2 * 1023 / 1024 * 1e9 / bw + 2 * 1023 * 2e-6)


@pytest.mark.parametrize("name", ["smng-p2", "v100-tacc", "dgx-a100"])
def test_card_wiring_does_not_change_rings(name):
    system = load_system(name)
    switch = TopologyCommModel(system, card_topology="switch")
    mesh = TopologyCommModel(system, card_topology="all-to-all")
    for g, s in SHAPES:
        a, b = switch.ring(g, s), mesh.ring(g, s)
        assert (a.bandwidth_Bps, a.latency_s) == pytest.approx((b.bandwidth_Bps, b.latency_s))


@pytest.mark.parametrize("name", ["smng-p2", "dgx-a100"])
def test_own_router_equals_networkx(name):
    system = load_system(name)
    own, ref = TopologyCommModel(system), TopologyCommModel(system, router="networkx")
    graph = build_graph(system, 2)
    devices = [v for v in graph if v[0] == "device"]
    for u in devices:
        for v in devices:
            if u != v:
                assert [h[:2] for h in own.path(u, v)] == [h[:2] for h in ref.path(u, v)]
    for g, s in SHAPES:
        assert own.ring(g, s) == ref.ring(g, s)


# ---- the graph --------------------------------------------------------------------------------

def test_smng_graph_structure(smng):
    g = build_graph(smng, 2)
    kinds = [d["kind"] for _, _, d in g.edges(data=True)]
    assert kinds.count("card") == 2 * 4  # one MDFI link per Max 1550
    assert kinds.count("node") == 2 * (8 * 6 // 2)  # Xe Link between every two tiles on different cards
    assert kinds.count("host") == 2 * 8 and kinds.count("network") == 2 * 2
    assert g.edges[("device", 0, 0), ("device", 0, 1)]["bandwidth"] == 196e9
    assert g.has_edge(("device", 0, 3), ("nic", 0, 0)) and g.has_edge(("device", 0, 4), ("nic", 0, 1))
    assert g.edges[("nic", 1, 1), ("core",)]["bandwidth"] == 25e9


def test_dgx_graph_has_a_switch(dgx):
    g = build_graph(dgx, 1)
    assert g.degree[("switch", 0)] == 8
    assert not any(d["kind"] == "card" for _, _, d in g.edges(data=True))
    assert all(g.has_edge(("device", 0, d), ("nic", 0, d)) for d in range(8))


def test_oversubscription_scales_uplinks(dgx):
    from dataclasses import replace
    system = replace(dgx, network=replace(dgx.network, oversubscription=2.0))
    assert TopologyCommModel(system).ring(4, 8).raw_bandwidth_Bps == pytest.approx(12.5e9)


# ---- agreement with collectives.CommModel where that model is exact -----------------------------

@pytest.mark.parametrize("name", PROFILES)
def test_link_agrees_with_simple_model_where_it_is_exact(name):
    """Exact cases of the simple model: groups inside one card; groups inside one node (every ring
    edge has its own link, the slowest class bounds the ring); one member per node (stride a
    multiple of devices_per_node, NICs serving equal shares of devices)."""
    system = load_system(name)
    D = system.node.devices_per_node
    topo, simple = TopologyCommModel(system), CommModel(system)
    cases = [(g, s) for g, s in SHAPES if g * s <= D and D % (g * s) == 0]
    cases += [(g, k * D) for g in (2, 3, 4, 64) for k in (1, 2, 3)]
    for g, s in cases:
        assert topo.link(g, s)[0] == pytest.approx(simple.link(g, s)[0]), (g, s)
        assert topo.link(g, s)[1] == pytest.approx(simple.link(g, s)[1]), (g, s)


def test_collectives_agree_with_simple_model_when_rings_are_used(dgx):
    topo, simple = TopologyCommModel(dgx, algorithm="ring"), CommModel(dgx)
    n = np.array([1e3, 1e6, 1e9])
    for g, s in [(8, 1), (4, 2), (2, 4), (4, 8), (64, 8)]:
        assert topo.all_reduce(n, g, s) == pytest.approx(simple.all_reduce(n, g, s))
        assert topo.all_gather(n, g, s) == pytest.approx(simple.all_gather(n, g, s))
        assert topo.broadcast(n, g, s) == pytest.approx(simple.broadcast(n, g, s))
    # across nodes, NCCL-style channels use every GPU's NIC, as the simple model assumes
    assert topo.all_reduce(1e9, 16, 1) == pytest.approx(simple.all_reduce(1e9, 16, 1))


# ---- algorithms ---------------------------------------------------------------------------------

def test_hierarchical_all_reduce_inside_an_smng_node(smng):
    """8 tiles: reduce-scatter over MDFI pairs, all-reduce of n/2 over Xe Link among the 4 cards
    (two rings, one per tile index, on separate links), all-gather over MDFI."""
    model = TopologyCommModel(smng)
    n = 1e9
    mdfi, xe = 196e9 * 0.7, smng.node.node_link_bandwidth_Bps * 0.7
    pair = 0.5 * n / mdfi + 5e-6
    across = 2 * 3 / 4 * (n / 2) / xe + 2 * 3 * 10e-6
    flat = 2 * 7 / 8 * n / xe + 2 * 7 * 10e-6
    assert model.all_reduce(n, 8, 1) == pytest.approx(2 * pair + across)
    assert model.all_reduce(n, 8, 1) < flat
    assert model.algorithm("all_reduce", n, 8, 1).startswith("hierarchical")


def test_no_algorithm_is_slower_than_the_flat_ring():
    for name in PROFILES:
        model = TopologyCommModel(load_system(name))
        for g, s in SHAPES + [(64, 8), (128, 1), (16, 4)]:
            for n in (1e2, 1e6, 1e10):
                bw, lat = model.link(g, s)
                ring_all_reduce = 2 * (g - 1) / g * n / bw + 2 * (g - 1) * lat
                ring_reduce_scatter = (g - 1) / g * n / bw + (g - 1) * lat
                assert model.all_reduce(n, g, s) <= ring_all_reduce * (1 + 1e-12)
                assert model.reduce_scatter(n, g, s) <= ring_reduce_scatter * (1 + 1e-12)


def test_small_messages_pick_by_latency_large_by_bandwidth(dgx):
    model = TopologyCommModel(dgx)
    small, large = model.algorithm("all_reduce", 1e3, 16, 1), model.algorithm("all_reduce", 1e10, 16, 1)
    assert small != large  # the choice depends on the size, as in NCCL's tuner
    assert model.all_reduce(1e3, 16, 1) < 2 * 15 * model.link(16, 1)[1] + 1e-3


def test_pipeline_send_and_summa_broadcast(smng):
    model = TopologyCommModel(smng, algorithm="ring")  # the chain; the tree is tested below
    # pipeline stages one node apart: every tile of a middle stage sends off-node, 4 per NIC
    assert model.send(1e8, 4, 8) == pytest.approx(1e8 / (6.25e9 * smng.collectives.network_efficiency) + 2e-6)
    # pipeline stages inside a node, 2 tiles apart: Xe Link, one flow per link
    xe = smng.node.node_link_bandwidth_Bps * 0.7
    assert model.send(1e8, 4, 2) == pytest.approx(1e8 / xe + 10e-6)
    # pipelined broadcast along a row of 4 cards: n / B + (g-1) alpha
    assert model.broadcast(1e8, 4, 2) == pytest.approx(1e8 / xe + 3 * 10e-6)
    assert model.reduce(1e8, 2, 1) == pytest.approx(1e8 / (196e9 * 0.7) + 5e-6)


# ---- interface ----------------------------------------------------------------------------------

def test_numpy_arrays_match_scalar_calls(smng):
    model = TopologyCommModel(smng)
    n = np.array([1e6, 2e6, 3e9, 1e3, 5e5])
    g = np.array([8, 1, 4, 16, 8])
    s = np.array([1, 8, 8, 1, 1])
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send"):
        fn = getattr(model, op)
        vector = fn(n, g, s)
        assert vector.shape == (5,)
        expected = [float(fn(n[i], g[i], s[i])) for i in range(5)]
        assert vector == pytest.approx(expected)
    assert model.all_reduce(1e9, 1, 8) == 0.0
    bw, lat = model.link(np.array([[1, 2], [8, 4]]), np.array([[1, 1], [1, 8]]))
    assert bw.shape == (2, 2) and math.isinf(bw[0, 0]) and lat[0, 0] == 0.0


def test_fast_path_does_not_import_networkx():
    code = ("import sys, time; t = time.perf_counter();"
            "from perfsim.cost.topology import TopologyCommModel; from perfsim.spec.system import load_system;"
            "m = TopologyCommModel(load_system('smng-p2')); m.all_reduce(1e9, 8, 1); m.all_reduce(1e9, 64, 8);"
            "assert 'networkx' not in sys.modules, 'networkx imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_node_patterns_python_and_numpy_agree(monkeypatch):
    shapes = [(g, s) for g in range(2, 12) for s in range(1, 20)]
    small = {(g, s, w): node_patterns(8, g, s, w) for g, s in shapes for w in (True, False)}
    monkeypatch.setattr(topology, "_PYTHON_PATTERN_LIMIT", 0)
    for (g, s, w), rows in small.items():
        assert sorted(node_patterns(8, g, s, w)) == sorted(rows), (g, s, w)


# ---- trees --------------------------------------------------------------------------------------
# A reference written top-down (children from parents), where the module builds parents bottom-up.

def reference_tree(g):
    """Parent list of the in-order binary tree: position p with lowest set bit b (the root 0: the
    power of two >= g) has children p - b/2 (not the root) and p + h for the largest h of b/2, b/4, ...
    with p + h < g."""
    parent = [-1] * g
    todo = [(0, 1 << max(g - 1, 0).bit_length())]
    while todo:
        p, b = todo.pop()
        h = b // 2
        if p > 0 and h >= 1:
            parent[p - h] = p
            todo.append((p - h, h))
        while h >= 1 and p + h >= g:
            h //= 2
        if h >= 1:
            parent[p + h] = p
            todo.append((p + h, h))
    return parent


def reference_double_tree(g):
    first = reference_tree(g)
    if g % 2 == 0:  # mirror
        second = [-1 if first[g - 1 - p] < 0 else g - 1 - first[g - 1 - p] for p in range(g)]
    else:  # shift by one
        second = [-1 if first[(p - 1) % g] < 0 else (first[(p - 1) % g] + 1) % g for p in range(g)]
    return first, second


def tree_edges(g, op):
    """(tree, child, parent, direction) of every flow of a double-tree all-reduce or broadcast from 0."""
    first, second = reference_double_tree(g)
    if op == "broadcast":
        root = second.index(-1)
        second = list(second)
        second[0], second[root] = -1, 0
    out = []
    for t, parent in enumerate((first, second)):
        for c in range(g):
            if parent[c] >= 0:
                out.append((t, c, parent[c], "down"))
                if op == "all_reduce":
                    out.append((t, c, parent[c], "up"))
    return out, (first, second)


def port_keys(graph, u, v):
    """Resources a hop loads (docs/topology.md): card/node links load the devices' ports, a NIC's
    up- or downlink is its own resource, host links none."""
    e = graph.edges[u, v]
    if e["kind"] == "host":
        return []
    if e["kind"] == "network":
        return [(u, v)]
    return [k for k in ((u, e["kind"], "out") if u[0] == "device" else None,
                        (v, e["kind"], "in") if v[0] == "device" else None) if k]


def brute_force_tree(system, size, stride, nodes, op, card_topology=None):
    """(raw, effective bandwidth per flow, latency term) of the double tree over every group of a
    whole machine, all groups at once; latency = max over groups and trees of the first chunk's way."""
    graph = build_graph(system, nodes, card_topology)
    D = system.node.devices_per_node
    world = nodes * D
    eff = {"card": system.collectives.card_efficiency, "node": system.collectives.node_efficiency,
           "network": system.collectives.network_efficiency}
    dev = lambda r: ("device", r // D, r % D)  # noqa: E731
    edges, trees = tree_edges(size, op)
    load, bw, latency = {}, {}, 0.0
    for base in range(world):
        if (base // stride) % size:
            continue  # not the first member of a group
        member = lambda k: base + k * stride  # noqa: E731
        hop_latency = {}
        for t, c, p, direction in edges:
            a, b = (member(c), member(p)) if direction == "up" else (member(p), member(c))
            path = nx.shortest_path(graph, dev(a), dev(b), weight="cost")
            hop_latency[(t, c, direction)] = sum(graph.edges[u, v]["latency"] for u, v in zip(path, path[1:]))
            for u, v in zip(path, path[1:]):
                for key in port_keys(graph, u, v):
                    load[key] = load.get(key, 0) + 1
                    bw[key] = (graph.edges[u, v]["bandwidth"], eff[graph.edges[u, v]["kind"]])
        for t, parent in enumerate(trees):
            way = 0.0
            for direction in ("up", "down") if op == "all_reduce" else ("down",):
                longest = 0.0
                for c in range(size):
                    total, q = 0.0, c
                    while parent[q] >= 0:
                        total += hop_latency[(t, q, direction)]
                        q = parent[q]
                    longest = max(longest, total)
                way += longest
            latency = max(latency, way)
    raw = min(b / load[k] for k, (b, _) in bw.items())
    effective = min(b * e / load[k] for k, (b, e) in bw.items())
    return raw, effective, latency


@pytest.mark.parametrize("g", list(range(1, 70)) + [128, 255, 256, 1000, 1024])
def test_double_binary_tree_structure(g):
    first, second = topology.double_binary_tree(g)
    ref_first, ref_second = reference_double_tree(g)
    assert first.tolist() == ref_first and second.tolist() == ref_second
    for parent in (first, second):
        assert (parent < 0).sum() == 1  # one root
        assert np.bincount(parent[parent >= 0], minlength=g).max(initial=0) <= 2  # binary
        depth = topology.path_sums(parent, np.ones(g))
        assert depth.max() == math.ceil(math.log2(g))  # every member reaches the root, in log2 g levels
    inner = lambda parent: set(parent[parent >= 0].tolist())  # noqa: E731
    if g % 2 == 0:  # every member is inner in at most one tree
        assert not inner(first) & inner(second)


TREE_SHAPES = [(2, 1), (4, 1), (8, 1), (3, 1), (4, 2), (2, 4), (16, 1), (8, 2), (4, 8), (3, 8), (6, 4),
               (5, 8), (12, 2), (16, 8), (7, 1)]


@pytest.mark.parametrize("name", PROFILES + ("odd",))
@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_tree_equals_brute_force(name, op):
    system = odd_machine() if name == "odd" else load_system(name)
    D = system.node.devices_per_node
    model = TopologyCommModel(system)
    for g, s in TREE_SHAPES:
        nodes = math.lcm(g * s, D) // D
        if nodes > 16:
            continue
        raw, eff, lat = brute_force_tree(system, g, s, nodes, op)
        t = model.tree(g, s, op)
        assert t.raw_bandwidth_Bps == pytest.approx(raw), (name, op, g, s)
        assert t.bandwidth_Bps == pytest.approx(eff), (name, op, g, s)
        # per edge the model takes its slowest placement: exact for alike groups, never below
        assert t.latency_s >= lat * (1 - 1e-12), (name, op, g, s)
        if D % (g * s) == 0 or s % D == 0:
            assert t.latency_s == pytest.approx(lat), (name, op, g, s)


@pytest.mark.parametrize("name", ["smng-p2", "v100-tacc", "dgx-a100"])
def test_card_wiring_does_not_change_trees(name):
    system = load_system(name)
    switch = TopologyCommModel(system, card_topology="switch")
    mesh = TopologyCommModel(system, card_topology="all-to-all")
    for g, s in TREE_SHAPES:
        for op in ("all_reduce", "broadcast"):
            a, b = switch.tree(g, s, op), mesh.tree(g, s, op)
            assert (a.bandwidth_Bps, a.latency_s) == pytest.approx((b.bandwidth_Bps, b.latency_s)), (g, s, op)


@pytest.mark.parametrize("name", PROFILES)
def test_generic_flows_reproduce_the_ring(name):
    model = TopologyCommModel(load_system(name))
    for g, s in SHAPES:
        k = np.arange(g)
        eff, raw, kind, flows, latency = model.flows(g, s, k, (k + 1) % g)
        r = model.ring(g, s)
        assert (eff, raw, latency.max()) == pytest.approx((r.bandwidth_Bps, r.raw_bandwidth_Bps, r.latency_s)), (g, s)


@pytest.mark.parametrize("name", ["smng-p2", "dgx-a100"])
def test_tree_wins_small_and_loses_large_on_64_nodes(name):
    """Data parallel over 64 nodes, one device per node per group (tp = devices per node), every
    device of every node in its own group at once. Per device the double tree has at most 4 flows
    each way (inner in one tree: up + 2 down; leaf in the other: up), each carrying n/2; the ring
    has 1 flow carrying 2 (g-1)/g n in all."""
    system = load_system(name)
    D, nics = system.node.devices_per_node, system.network.nics_per_node
    nic = system.network.nic_bandwidth_Bps * system.collectives.network_efficiency
    alpha = system.network.latency_s
    g = 64
    tree = lambda n: 0.5 * n / (nic / (4 * D // nics)) + 2 * 6 * alpha  # noqa: E731  (depth log2 64 = 6)
    ring = lambda n: 2 * (g - 1) / g * n / (nic / (D // nics)) + 2 * (g - 1) * alpha  # noqa: E731
    auto = TopologyCommModel(system)
    fixed_tree, fixed_ring = TopologyCommModel(system, algorithm="tree"), TopologyCommModel(system, algorithm="ring")
    for n in (1024.0, 2.0 ** 30):
        assert fixed_tree.all_reduce(n, g, D) == pytest.approx(tree(n))
        assert fixed_ring.all_reduce(n, g, D) == pytest.approx(ring(n))
        assert auto.all_reduce(n, g, D) == pytest.approx(min(tree(n), ring(n)))
    assert tree(1024.0) < ring(1024.0) / 5 and auto.algorithm("all_reduce", 1024, g, D).startswith("double binary tree")
    assert tree(2.0 ** 30) > ring(2.0 ** 30) and auto.algorithm("all_reduce", 2 ** 30, g, D).startswith("ring")


def test_tree_of_two_is_the_ring(smng):
    model, tree = TopologyCommModel(smng), TopologyCommModel(smng, algorithm="tree")
    mdfi = 196e9 * smng.collectives.card_efficiency
    for n in (1e3, 1e9):  # two flows each way, n/2 each: n / B, and one step up and one down
        assert tree.all_reduce(n, 2, 1) == pytest.approx(n / mdfi + 2 * 5e-6)
        assert model.all_reduce(n, 2, 1) == pytest.approx(n / mdfi + 2 * 5e-6)


def test_tree_broadcast_across_four_cards(smng):
    """Broadcast from member 0 over the 4 cards of a node (g 4, stride 2). Trees: 0 -> 2 -> {1, 3};
    mirrored 3 -> 1 -> {0, 2}, with 0 cut loose and sending to 3 instead: 0 -> 3 -> 1 -> 2. Member 0
    and member 2 each send two halves at once over their tile's Xe Link port: n / B; the deeper tree
    has 3 levels. Same time as the chain here; on 64 nodes the tree's 7 levels beat 63 steps."""
    xe = smng.node.node_link_bandwidth_Bps * smng.collectives.node_efficiency
    tree = TopologyCommModel(smng, algorithm="tree")
    assert tree.broadcast(1e8, 4, 2) == pytest.approx(1e8 / xe + 3 * 10e-6)
    assert tree.reduce(1e8, 4, 2) == pytest.approx(1e8 / xe + 3 * 10e-6)
    auto, chain = TopologyCommModel(smng), TopologyCommModel(smng, algorithm="ring")
    nic = 25e9 * smng.collectives.network_efficiency
    assert chain.broadcast(1024, 64, 8) == pytest.approx(1024 / (nic / 4) + 63 * 2e-6)
    assert auto.broadcast(1024, 64, 8) == pytest.approx(0.5 * 1024 / (nic / 8) + 7 * 2e-6)
    assert auto.algorithm("broadcast", 1024, 64, 8).startswith("double binary tree")


# ---- the algorithm fixed by the profile ---------------------------------------------------------

def test_fixed_ring_is_the_flat_ring(smng):
    """The 8 tiles of a node: auto takes a hierarchical algorithm (rings for 1 GB, a tree across the
    cards for 1 KiB); fixed to "ring" it is the flat ring, 2 (g-1)/g n / B + 2 (g-1) alpha over Xe Link."""
    xe = smng.node.node_link_bandwidth_Bps * smng.collectives.node_efficiency
    flat = lambda n: 2 * 7 / 8 * n / xe + 2 * 7 * 10e-6  # noqa: E731
    auto = TopologyCommModel(smng)
    ring = TopologyCommModel(replace_algorithm(smng, "ring"))  # fixed by the profile
    assert ring.algorithm_rule == "ring"
    for n in (1024.0, 1e9):
        assert ring.all_reduce(n, 8, 1) == pytest.approx(flat(n))
        assert auto.all_reduce(n, 8, 1) < 0.9 * flat(n)
        assert ring.algorithm("all_reduce", n, 8, 1) == "ring(8, stride 1)"
        assert ring.all_gather(n, 8, 1) == pytest.approx(7 / 8 * n / xe + 7 * 10e-6)
    assert auto.algorithm("all_reduce", 1e9, 8, 1) == "hierarchical[ring(2, stride 1) | ring(4, stride 2)]"
    # 1 KiB: MDFI pairs, then the tree over the 4 cards (2 x 2 x 10 us) beats the flat tree (2 x 3 x 10 us)
    assert auto.algorithm("all_reduce", 1024, 8, 1) == "hierarchical[ring(2, stride 1) | double binary tree(4, stride 2)]"


def test_fixed_tree_and_hierarchical(smng):
    n = 1024.0
    tree = TopologyCommModel(smng, algorithm="tree")
    assert tree.all_reduce(n, 8, 1) == pytest.approx(tree.tree(8, 1).time(n))
    assert tree.algorithm("all_reduce", n, 8, 1) == "double binary tree(8, stride 1)"
    ring = TopologyCommModel(smng, algorithm="ring")
    assert tree.reduce_scatter(n, 8, 1) == pytest.approx(ring.reduce_scatter(n, 8, 1))  # no tree reduce-scatter
    # hierarchical even where the tree is faster: reduce-scatter over MDFI pairs, flat ring all-reduce
    # of n/2 over the 4 cards (no further split), all-gather over MDFI
    hier = TopologyCommModel(smng, algorithm="hierarchical")
    mdfi = 196e9 * smng.collectives.card_efficiency
    xe = smng.node.node_link_bandwidth_Bps * smng.collectives.node_efficiency
    expected = 2 * (0.5 * n / mdfi + 5e-6) + 2 * 3 / 4 * (n / 2) / xe + 2 * 3 * 10e-6
    assert hier.all_reduce(n, 8, 1) == pytest.approx(expected)
    assert TopologyCommModel(smng).all_reduce(n, 8, 1) < expected
    assert hier.algorithm("all_reduce", n, 8, 1) == "hierarchical[ring(2, stride 1) | ring(4, stride 2)]"
    # no split offered (one member per node): rings
    assert hier.all_reduce(n, 64, 8) == pytest.approx(ring.all_reduce(n, 64, 8))
    with pytest.raises(ValueError):
        TopologyCommModel(smng, algorithm="bus")


def replace_algorithm(system, algorithm):
    from dataclasses import replace
    return replace(system, collectives=replace(system.collectives, algorithm=algorithm))


def _with_algorithm(value):
    def edit(data):
        data["collectives"]["algorithm"] = value
    return edit


def test_profile_key_loads_and_defaults_to_auto(tmp_path):
    from profile_toml import write_variant
    assert load_system("smng-p2").collectives.algorithm == "auto"  # left out
    for value in ("auto", "ring", "tree", "hierarchical"):
        path = write_variant(tmp_path, "smng-p2", _with_algorithm(value), filename=f"{value}.toml")
        assert load_system(path).collectives.algorithm == value


def test_profile_algorithm_reaches_predict(tmp_path):
    """The built-in case (175B, TP 8 inside an SMNG-P2 node): its large tensor-parallel all-reduces
    take the hierarchical algorithm under auto; a profile that fixes the flat ring is slower."""
    from profile_toml import write_variant
    from perfsim.spec.case import BUILTIN_CASE
    from perfsim.predict import predict
    from perfsim.spec.plan import Plan
    plan = Plan(**BUILTIN_CASE["plan"], dp=1)
    times = {}
    for value in ("auto", "ring"):
        path = write_variant(tmp_path, "smng-p2", _with_algorithm(value), filename=f"{value}.toml")
        times[value] = predict(BUILTIN_CASE["model"], load_system(path), plan).time_breakdown_s["tp_comm"]
    assert times["ring"] > 1.2 * times["auto"]


@pytest.mark.parametrize("value", ["fastest", "Ring", 3, {"value": "ring", "provenance": "assumed", "source": "x"}])
def test_bad_algorithm_is_a_one_line_error(tmp_path, capsys, value):
    from profile_toml import write_variant
    from perfsim import cli
    path = write_variant(tmp_path, "smng-p2", _with_algorithm(value))
    assert cli.main(["predict", "--system", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("perfsim: error:")
    assert "collectives.algorithm" in err and path in err and "auto, ring, tree, hierarchical" in err


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("rule", ["auto", "ring", "tree", "hierarchical"])
def test_cached_time_lines_equal_the_fastest_listed_algorithm(name, rule):
    """_time evaluates cached lower envelopes of lines; _options lists each algorithm's time
    directly. Both must give the same fastest time for every size."""
    model = TopologyCommModel(load_system(name), algorithm=rule)
    sizes = np.array([1.0, 1e3, 1e5, 1e7, 1e9, 1e11])
    for g, s in SHAPES + [(64, 8), (16, 4), (8, 2)]:
        for op in ("all_reduce", "reduce_scatter", "broadcast"):
            listed = np.min([np.broadcast_to(t, sizes.shape) for t, _ in model._options(op, sizes, g, s)], axis=0)
            assert model._time(op, sizes, g, s) == pytest.approx(listed, rel=1e-12)


# --- per-operation factors (collectives.operation_efficiency, collectives.operation_latency_factor) ---

def with_operation_factors(system, efficiency=None, latency_factor=None):
    from dataclasses import replace
    ops = topology.OPERATIONS
    return replace(system, collectives=replace(
        system.collectives,
        operation_efficiency=tuple((op, (efficiency or {})[op]) for op in ops if op in (efficiency or {})),
        operation_latency_factor=tuple((op, (latency_factor or {})[op]) for op in ops if op in (latency_factor or {}))))


OPERATION_SHAPES = [(2, 1), (8, 1), (4, 2), (64, 8), (16, 4), (4, 8)]


@pytest.mark.parametrize("name", ["smng-p2", "dgx-a100", "cpu-example"])
@pytest.mark.parametrize("rule", ["auto", "ring", "hierarchical"])
def test_operation_factors_scale_bandwidth_and_latency_parts(name, rule):
    """Scaled op: every algorithm's a n + b becomes a n / e + f b, so its fastest time at n is
    f x the unscaled fastest time at n / (e f) (whichever algorithm wins); other ops are untouched."""
    base = load_system(name)
    eff = {"all_reduce": 0.4, "reduce_scatter": 0.2, "reduce": 0.9, "send": 0.5}
    lat = {"all_reduce": 1.5, "all_gather": 3.0, "broadcast": 0.5, "send": 2.0}
    plain = TopologyCommModel(base, algorithm=rule)
    scaled = TopologyCommModel(with_operation_factors(base, eff, lat), algorithm=rule)
    sizes = np.array([1.0, 1e3, 1e5, 1e7, 1e9, 1e11])
    for g, s in OPERATION_SHAPES:
        for op in topology.OPERATIONS:
            e, f = eff.get(op, 1.0), lat.get(op, 1.0)
            expected = f * getattr(plain, op)(sizes / (e * f), g, s)
            assert getattr(scaled, op)(sizes, g, s) == pytest.approx(expected, rel=1e-12), (op, g, s)
            for n in (1e3, 1e9):  # the algorithm it reports is the one that gives that time
                assert scaled.algorithm(op, n, g, s) == plain.algorithm(op, n / (e * f), g, s)
    # by hand on one ring: 2 ranks of one SMNG-P2 card, all-reduce 2 (g-1)/g n / B + 2 (g-1) alpha
    if name == "smng-p2" and rule == "ring":
        bw, alpha = scaled.ring(2, 1).bandwidth_Bps, scaled.ring(2, 1).latency_s
        assert scaled.all_reduce(1e8, 2, 1) == pytest.approx(1e8 / (0.4 * bw) + 2 * 1.5 * alpha, rel=1e-12)


def test_operations_are_priced_apart_only_when_the_profile_says_so(smng):
    """Without factors an all-gather costs what a reduce-scatter does and a reduce what a broadcast
    does (the same flows); a factor on one of each pair separates them."""
    plain = TopologyCommModel(smng)
    n, g, s = np.array([1e4, 1e8]), np.array([8, 64]), np.array([1, 8])
    assert np.array_equal(plain.reduce_scatter(n, g, s), plain.all_gather(n, g, s))
    assert np.array_equal(plain.reduce(n, g, s), plain.broadcast(n, g, s))
    model = TopologyCommModel(with_operation_factors(smng, {"reduce_scatter": 0.5}, {"reduce": 2.0}))
    assert np.array_equal(model.all_gather(n, g, s), plain.all_gather(n, g, s))
    assert np.all(model.reduce_scatter(n, g, s) > plain.reduce_scatter(n, g, s))
    assert np.array_equal(model.broadcast(n, g, s), plain.broadcast(n, g, s))
    assert np.all(model.reduce(n, g, s) > plain.reduce(n, g, s))
    assert model.all_reduce(1e8, 8, 1) == plain.all_reduce(1e8, 8, 1)
    assert model.all_reduce(1e8, 1, 1) == 0.0  # a group of one still costs nothing


def _profile_with(tmp_path, extra: str):
    from profile_toml import profile_with
    return profile_with(tmp_path, extra)


def _entry(table, op, value, provenance="measured", source="a test: gloo on this machine"):
    return f'[collectives.{table}.{op}]\nvalue = {value}\nprovenance = "{provenance}"\nsource = "{source}"\n\n'


def test_profile_operation_tables_load_with_provenance_and_reach_predict(tmp_path):
    from perfsim.predict import predict
    from perfsim.spec.plan import Plan
    path = _profile_with(tmp_path, _entry("operation_efficiency", "all_reduce", 0.25)
                         + _entry("operation_latency_factor", "all_reduce", 3)
                         + _entry("operation_efficiency", "send", 1.0))
    system = load_system(path)
    c = system.collectives
    assert c.operation_efficiency == (("all_reduce", 0.25), ("send", 1.0))
    assert c.operation_latency_factor == (("all_reduce", 3.0),)
    assert c.operation_factors("all_reduce") == (0.25, 3.0, 0.0) and c.operation_factors("broadcast") == (1.0, 1.0, 0.0)
    assert system.provenance["collectives.operation_efficiency.all_reduce"] == ("measured", "a test: gloo on this machine")
    assert "collectives.operation_latency_factor.send" not in system.provenance
    plain = load_system("cpu-example")
    assert plain.collectives.operation_efficiency == () and plain.collectives.operation_latency_factor == ()
    plan = Plan(tp=2, mbs=1, gbs=1)
    model = "layers=2,hidden=256,heads=4,seq=128,vocab=1024"
    slow, fast = predict(model, system, plan), predict(model, plain, plan)
    # 1D TP without SP: every collective is an all-reduce, priced 4x on bandwidth and 3x on latency
    assert slow.time_breakdown_s["tp_comm"] > 2.9 * fast.time_breakdown_s["tp_comm"]
    assert slow.time_breakdown_s["compute"] == fast.time_breakdown_s["compute"]


def test_step_overhead_is_added_to_every_call_of_its_operation_only(tmp_path):
    """collectives.operation_step_overhead_s.<op>: w seconds on every call of op over a group of
    two or more, on top of the scaled link model; nothing for a group of one or for other ops, and
    the algorithm chosen does not change (the same constant on every line)."""
    from perfsim.predict import predict
    from perfsim.spec.plan import Plan
    w = 2e-3
    path = _profile_with(tmp_path, _entry("operation_efficiency", "all_reduce", 0.25)
                         + _entry("operation_step_overhead_s", "all_reduce", w)
                         + _entry("operation_step_overhead_s", "send", 0))
    waiting = load_system(path)
    assert waiting.collectives.operation_factors("all_reduce") == (0.25, 1.0, w)
    assert waiting.provenance["collectives.operation_step_overhead_s.send"][0] == "measured"
    plain = TopologyCommModel(load_system(_profile_with(tmp_path, _entry("operation_efficiency", "all_reduce", 0.25))))
    model = TopologyCommModel(waiting)
    n = np.array([1e3, 1e6, 1e9])
    for g, s in [(2, 1), (4, 1), (8, 2)]:
        assert model.all_reduce(n, g, s) == pytest.approx(plain.all_reduce(n, g, s) + w, rel=1e-12)
        assert np.array_equal(model.all_gather(n, g, s), plain.all_gather(n, g, s))
        assert np.array_equal(model.send(n, g, s), plain.send(n, g, s))
        assert model.algorithm("all_reduce", 1e6, g, s) == plain.algorithm("all_reduce", 1e6, g, s)
    assert model.all_reduce(1e8, 1, 1) == 0.0
    # 1D TP without SP: 4 all-reduces per layer per micro-batch, each w more
    plan, spec = Plan(tp=2, mbs=1, gbs=2), "layers=2,hidden=256,heads=4,seq=128,vocab=1024,tied_embeddings=false"
    slow, fast = predict(spec, waiting, plan), predict(spec, plain.system, plan)
    from perfsim.cost.traffic import tp_collectives
    from perfsim.spec.model import load_model
    _, layer, edges = tp_collectives(load_model(spec), plan)
    per_microbatch = sum(int(c.count) for c in layer) * 2 + sum(int(c.count) for c in edges)
    calls = plan.microbatches * per_microbatch  # every one an all-reduce here
    extra = slow.time_breakdown_s["tp_comm"] - fast.time_breakdown_s["tp_comm"]
    assert extra == pytest.approx(calls * w, rel=1e-9)


@pytest.mark.parametrize("extra, words", [
    (_entry("operation_step_overhead_s", "all_reduce", -1), ["collectives.operation_step_overhead_s.all_reduce",
                                                             "at least 0"]),
    (_entry("operation_efficiency", "allreduce", 0.5), ["unknown operation", "collectives.operation_efficiency.allreduce",
                                                         "all_reduce, all_gather, reduce_scatter, broadcast, reduce, send"]),
    (_entry("operation_efficiency", "all_reduce", 1.5), ["collectives.operation_efficiency.all_reduce.value",
                                                          "at most 1"]),
    (_entry("operation_efficiency", "send", 0), ["collectives.operation_efficiency.send.value", "above 0"]),
    (_entry("operation_latency_factor", "reduce", -1), ["collectives.operation_latency_factor.reduce.value", "above 0"]),
    (_entry("operation_latency_factor", "reduce", '"fast"'), ["collectives.operation_latency_factor.reduce.value",
                                                              "a number"]),
    (_entry("operation_efficiency", "reduce", 0.5, provenance="guessed"), ["operation_efficiency.reduce.provenance"]),
    ("[collectives.operation_latency_factor.broadcast]\nvalue = 2.0\nprovenance = \"assumed\"\n",
     ["collectives.operation_latency_factor.broadcast has no source"]),
    ("[collectives.operation_efficiency]\nall_gather = 0.5\n", ["collectives.operation_efficiency.all_gather must be a table"]),
])
def test_bad_operation_tables_are_one_line_errors(tmp_path, capsys, extra, words):
    from profile_toml import assert_one_line_error
    assert_one_line_error(capsys, _profile_with(tmp_path, extra), words)


def test_a_table_where_the_operations_belong_must_be_a_table(tmp_path, capsys):
    from perfsim import cli
    from profile_toml import HWPROFILES
    with open(f"{HWPROFILES}/cpu-example.toml", encoding="utf-8") as fh:
        text = fh.read()
    path = tmp_path / "bad.toml"
    assert "[collectives.card_efficiency]" in text
    path.write_text(text.replace("[collectives.card_efficiency]",
                                "[collectives]\noperation_efficiency = 0.5\n\n[collectives.card_efficiency]", 1))
    assert cli.main(["predict", "--system", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "collectives.operation_efficiency must be a table of operations" in err
