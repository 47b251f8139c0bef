"""Collective times from an alpha-beta model that knows where a group lands (docs/equations.md, section 5).

A group is described by its size g and its stride in rank space (ranks r0, r0 + stride, ...).
Ranks fill cards, then nodes, in order. A group is one of three link classes:
- card: every member on one card (the two tiles of a Max 1550);
- node: every member in one node (NVLink/NVSwitch, Xe Link);
- network: members in several nodes. All groups of a parallel dimension communicate at once, so
  each node's NICs are shared by the devices_per_node / members_per_node rings that leave it.
Ring algorithms: all-reduce 2(g-1)/g n / B + 2(g-1) alpha; all-gather and reduce-scatter
(g-1)/g n / B + (g-1) alpha, with n the full (gathered) tensor's bytes; pipelined broadcast and
reduce n / B + (g-1) alpha. B is the bottleneck
bandwidth of the ring times the link class's collective efficiency.

This is the interface a topology model replaces: anything with `link(size, stride)` works.
Everything accepts numpy arrays of sizes and strides as well as numbers.
"""

from __future__ import annotations

import numpy as np

from perfsim.spec.system import System


def group_strides(order: str, sizes: dict) -> dict:
    """Stride in rank space of each parallel dimension, `order` listing dimensions innermost first."""
    strides, stride = {}, 1
    for dim in order.split("-"):
        strides[dim] = stride
        stride = stride * sizes[dim]
    return strides


class CommModel:
    def __init__(self, system: System):
        node, net, eff = system.node, system.network, system.collectives
        self.devices_per_node = node.devices_per_node
        self.devices_per_card = node.devices_per_card
        self.card_bw = node.card_link_bandwidth_Bps * eff.card_efficiency
        self.node_bw = node.node_link_bandwidth_Bps * eff.node_efficiency
        if node.devices_per_card > 1:  # a ring over several cards also crosses card links
            self.node_bw = min(self.node_bw, self.card_bw)
        self.node_nic_bw = net.nics_per_node * net.nic_bandwidth_Bps / net.oversubscription * eff.network_efficiency
        self.card_latency = node.card_link_latency_s
        self.node_latency = node.node_link_latency_s
        self.net_latency = net.latency_s

    def link(self, size, stride):
        """(bandwidth in bytes/s, latency in s) of one ring step of a group, all groups busy."""
        size, stride = np.asarray(size), np.asarray(stride)
        span = stride * (size - 1) + 1
        on_card = span <= self.devices_per_card
        in_node = span <= self.devices_per_node
        members_per_node = np.clip(self.devices_per_node // np.maximum(stride, 1), 1, size)
        rings_per_node = self.devices_per_node / members_per_node
        net_bw = self.node_nic_bw / rings_per_node
        net_bw = np.where(members_per_node > 1, np.minimum(net_bw, self.node_bw), net_bw)
        bandwidth = np.where(on_card, self.card_bw, np.where(in_node, self.node_bw, net_bw))
        latency = np.where(on_card, self.card_latency, np.where(in_node, self.node_latency, self.net_latency))
        return bandwidth, latency

    def all_reduce(self, nbytes, size, stride):
        bw, lat = self.link(size, stride)
        return np.where(size > 1, 2 * (size - 1) / size * nbytes / bw + 2 * (size - 1) * lat, 0.0)

    def all_gather(self, nbytes, size, stride):
        bw, lat = self.link(size, stride)
        return np.where(size > 1, (size - 1) / size * nbytes / bw + (size - 1) * lat, 0.0)

    reduce_scatter = all_gather  # the same ring, run the other way

    def broadcast(self, nbytes, size, stride):
        """Pipelined broadcast (or reduce) from one member: about n / B + (g-1) alpha."""
        bw, lat = self.link(size, stride)
        return np.where(size > 1, nbytes / bw + (size - 1) * lat, 0.0)

    reduce = broadcast

    def send(self, nbytes, size, stride):
        """Point-to-point messages between neighbours of a chain of `size` ranks `stride` apart
        (pipeline stages), all sending at once: the slowest hop's link, shared as in a ring."""
        bw, lat = self.link(size, stride)
        return nbytes / bw + lat
