"""Fit a system profile's efficiencies to measurements (`perfsim calibrate --fit`; docs/calibration.md).

Input: a ledger written by validate/ (JSON Lines, one measurement per line) and a base profile.
Output: the base profile with the fitted numbers replaced, each with provenance "calibrated" and
a source naming the ledger, plus the fit quality on the points used and on held-out points.

What is fitted, always through perfsim's own cost functions (so that the profile predicts what
was measured with the very formulas predictions use):
- memory: element-wise ops (LayerNorm, softmax, GeLU, residual add) give the effective
  bandwidth memory_bandwidth_Bps x memory_efficiency and the per-kernel overhead kernel_overhead_s
  (time = bytes / bandwidth + overhead, perfsim.cost.layer.memory_time); copy and triad give the
  streaming bandwidth, which replaces memory_bandwidth_Bps unless the base value is a vendor peak.
  Then each element-wise kind and direction measured (LayerNorm, softmax, GeLU, add, dropout,
  cross-entropy, and the backward kernels) gets its own efficiency
  (device.operation_memory_efficiency.<kind>, one scalar each, with that bandwidth and overhead),
  fitted on the dtype a training step runs the kernels in where the ledger has it.
- GEMMs: gemm_efficiency and gemm_half_dim of the efficiency model, and gemm_half_dim_k where the
  shapes vary k alone (perfsim.cost.layer.gemm_time) on the first measured dtype of the device (fp32 on CPU, bf16 on
  GPUs); every other measured dtype gets its peak_flops_<dtype> rescaled to what it reached.
- tensor-parallel overhead: with tp_overhead points (the DTensor layer against Megatron's, timed
  alternately, validate/tp_overhead.py), framework.tp_layer_overhead_s and sp_layer_overhead_s are
  the median of their per-round differences (floored at 0).
- collectives: per link class (card, node, network) the bus bandwidth (link bandwidth x
  collective efficiency) and the latency, through perfsim.cost.topology.TopologyCommModel over
  all measured operations, group shapes and sizes, together with one efficiency and one latency
  factor per operation (collectives.operation_efficiency / operation_latency_factor) when more than
  one operation was measured. The report also shows the link classes alone and a model-free check
  of the measurements' own scatter (each point from its neighbour sizes). All-to-all points
  (expert parallelism) are fitted after, on those link classes, into the all_to_all entries of the
  same tables and its step overhead (collectives.fit_all_to_all).

Held out: a quarter of the GEMM shapes and of the message and tensor sizes, chosen by a hash of
the size (so the same sizes for every dtype, op and group), are never used in the fit; their
mean absolute percentage error (MAPE) is the figure that says how well the profile predicts.

The package, one concept per module: common (ledger statistics, held-out rule, quality rows,
applying fitted values), memory, compute (GEMMs, the attention check), collectives, overheads
(framework overheads), tables (measured kernel tables), fit (a whole ledger), profile (the TOML
written), report.
"""

from __future__ import annotations

# the ledger's reader and record checks (re-exported: validate/ and older callers import them here)
from perfsim.ledger import LEDGER_SCHEMA, SUITES, read_ledger  # noqa: F401
from perfsim.calibrate.common import (COLLECTIVE_OPS, ELEMENTWISE_OPS, STATISTICS, STREAM_OPS,  # noqa: F401
                                      Calibration, Fitted, Quality, held_out, mape)
from perfsim.calibrate.collectives import STEP_OVERHEAD_MAX_BYTES, collective_times  # noqa: F401
from perfsim.calibrate.fit import fit, fit_ledger  # noqa: F401
from perfsim.calibrate.profile import calibrated_profile  # noqa: F401
