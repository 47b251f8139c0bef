"""The real-run side of perfsim: microbenchmarks, a measurement ledger and launchers.

This package imports torch (the `validate` extra) and perfsim; perfsim imports it only inside the
commands that run real work (`perfsim calibrate`). Modules:

- device: one interface to xpu, cuda and cpu (synchronisation, timers, memory, backend choice)
- microbench: GEMMs, memory-bound ops, attention and collectives, timed with warm-up and repeats
- ledger: the JSON Lines record of every measurement, resumable
- campaign: what one rank of a calibration run does
- launcher: the ranks of a local run as child processes that die with it, their output filtered,
  a failure blamed on the rank that caused it
- slurm: the batch script for SuperMUC-NG Phase 2 (mpiexec, oneCCL settings)
- gpt: a small GPT whose layers run 1D tensor parallelism (with or without sequence parallelism)
  through torch.distributed.tensor.parallel, and recompute none/selective/full; its attention
  core unfused (Megatron's kernels) or fused (scaled_dot_product_attention)
- context_parallel: ring attention over the sequence (causal load balancing) and the
  context-parallel training step
- instrument: counting a real step's matrix FLOPs and collectives per rank (dispatch modes)
- tp_check: one rank's correctness and exactness checks of the GPT against a single-process
  reference and against perfsim (run under launcher.launch_ranks); cp_check the same for
  context parallelism; attention_check the fused attention core against the unfused one

Importing the package itself does not import torch; its modules do.
"""
