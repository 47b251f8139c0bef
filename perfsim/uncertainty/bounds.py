"""Which end of each profile number's range makes a training step fastest and smallest, and the
system at that end over a set of draws: a lower bound on every plan's step time and peak memory in
every one of those draws (docs/validation.md, "Pruning the robust search").

The closed form is monotone in every number it samples: a step time is sums, products by
non-negative counts, max()es and min()es (pipeline bubbles, overlap, the fastest collective
algorithm) of terms each of which falls as a bandwidth, efficiency, peak or overlap share rises and
as a latency, overhead or half-size falls; peak memory rises only with the reserved bytes, the
allocator's share and the collective library's copies of a reduce-scatter's input. The exception:
collectives take the route of least summed latency, so a shorter latency can move traffic onto a
slower link; a corner bounds only draws that route as it does
(`routes`, checked by the robust search). tests/test_uncertainty_bounds.py checks this number by
number on plans of every kind, and checks that the corners bound every draw.
"""

from __future__ import annotations


# A number's name (its key without the section, or the table of a per-operation entry) -> True
# where a higher value makes a step faster (or its memory smaller), False where a lower one does.
FASTER_WHEN_HIGHER = {
    **dict.fromkeys(("peak_flops_bf16", "peak_flops_fp16", "peak_flops_fp32", "peak_flops_fp8", "memory_bandwidth_Bps",
                     "gemm_efficiency", "memory_efficiency", "operation_memory_efficiency", "flash_forward_efficiency",
                     "flash_backward_efficiency", "fp8_gemm_efficiency", "card_link_bandwidth_Bps",
                     "node_link_bandwidth_Bps", "nic_bandwidth_Bps", "card_efficiency", "node_efficiency",
                     "network_efficiency", "operation_efficiency", "overlap_efficiency", "zero3_overlap",
                     "sm_count", "sustained_clock_ratio", "unattributed_at_scale_ratio", "flash_dropout_forward_ratio",
                     "flash_dropout_backward_ratio"), True),
    **dict.fromkeys(("gemm_half_dim", "gemm_half_dim_k", "kernel_overhead_s", "card_link_latency_s", "node_link_latency_s", "latency_s",
                     "oversubscription", "operation_latency_factor", "operation_step_overhead_s",
                     "reserved_memory_bytes", "allocator_overhead_fraction", "step_overhead_s", "tp_layer_overhead_s",
                     "sp_layer_overhead_s", "layer_overhead_s", "microbatch_overhead_s", "reduce_scatter_input_copies",
                     "flash_score_s", "optimizer_bytes_per_param", "grad_accumulation_bytes_per_param",
                     "tp_comm_sms", "dp_comm_sms", "cp_comm_sms", "grad_buffer_pass_bytes_per_param",
                     "workspace_bytes", "rank_jitter", "imbalance", "expert_kernel_host_s"), False),
}


def faster_when_higher(key: str) -> bool:
    """For "section.name" or "section.table.entry": does a higher value make a step faster?"""
    name = key.split(".")[1]
    if name not in FASTER_WHEN_HIGHER:  # a number added to the profile format without its direction
        raise KeyError(f"{key}: no direction in perfsim.uncertainty.bounds.FASTER_WHEN_HIGHER")
    return FASTER_WHEN_HIGHER[name]


def _end(draws, rows, fastest: bool) -> dict:
    values = draws.values if rows is None else draws.values[rows]
    return {key: float(values[:, j].max() if faster_when_higher(key) == fastest else values[:, j].min())
            for j, key in enumerate(draws.keys)}


def optimistic_numbers(draws, rows=None) -> dict:
    """{key: value} of every drawn number at its fastest end over `rows` of the draws (all by default)."""
    return _end(draws, rows, True)


def pessimistic_numbers(draws, rows=None) -> dict:
    """{key: value} of every drawn number at its slowest end over `rows` of the draws."""
    return _end(draws, rows, False)


def optimistic_system(draws, rows=None):
    """The system at the optimistic corner of `rows` of the draws: in each of those draws every plan
    is at least as slow and needs at least as much memory as here."""
    from perfsim.uncertainty.sampling import with_numbers

    return with_numbers(draws.system, optimistic_numbers(draws, rows))


def routes(system) -> tuple:
    """The route the collective model takes between every pair of devices it studies, as vertex
    pairs. Routes follow the link latencies (the cheapest by summed latency), and a shorter latency
    may move traffic onto a slower link: a corner bounds only draws that route as it does."""
    from perfsim.cost.topology import TopologyCommModel, device

    comm, n = TopologyCommModel(system), system.node.devices_per_node
    ends = [(device(0, a), device(0, b)) for a in range(n) for b in range(n) if a != b]
    ends += [(device(0, a), device(1, a)) for a in range(n)] + [(device(1, a), device(0, a)) for a in range(n)]
    return tuple(tuple((u, v) for u, v, _ in comm.path(src, dst)) for src, dst in ends)
