"""The Slurm batch script of a calibration campaign on SuperMUC-NG Phase 2.

One rank per Max 1550 tile (FLAT device hierarchy, 8 tiles per node), started by `mpiexec -ppn 8`;
each rank reads its rank and local rank from PMI_RANK / PMI_SIZE / PALS_LOCAL_RANKID
(validate.campaign.rank_environment), the rendezvous address from MASTER_ADDR / MASTER_PORT, which
the script sets from the allocation. The environment is the one the SMNG-P2 LLM study validated
(shared/reference/hardware.md). After the campaign the script fits the profile on the first node.
No torch is needed to write the script.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

TILES_PER_NODE = 8

# Level Zero and SYCL: one device per tile, all eight visible, numbered in PCI order.
LEVEL_ZERO_ENV = (
    ("ZE_FLAT_DEVICE_HIERARCHY", "FLAT"),
    ("ZE_AFFINITY_MASK", ",".join(str(i) for i in range(TILES_PER_NODE))),
    ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"),
    ("SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS", "1"),
    ("UR_L0_IN_ORDER_BARRIER_BY_SIGNAL", "0"),
)
# oneCCL settings of the SMNG-P2 LLM study (LRZ-BADW/LLMsOnSMNG-P2), and its SDP fusion switch.
ONECCL_ENV = (
    ("CCL_OP_SYNC", "1"),
    ("CCL_SKIP_SCHEDULER", "1"),
    ("CCL_ALLGATHERV_MEDIUM_SIZE_THRESHOLD", "0"),
    ("ENABLE_SDP_FUSION", "1"),
)


@dataclass(frozen=True)
class Job:
    nodes: int
    worker_argv: tuple  # `perfsim calibrate --worker ...` arguments (validate.campaign.worker_argv)
    fit_argv: tuple  # `perfsim calibrate --fit ...` arguments, or empty
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "perfsim-calibrate"
    setup: tuple = ()  # shell lines run before the campaign (module load, activate a venv)
    port_base: int = 29500


def script(job: Job) -> str:
    """The batch script's text (deterministic: the golden-file test compares it byte for byte)."""
    worker = " ".join(shlex.quote(a) for a in ("perfsim",) + tuple(job.worker_argv))
    lines = [
        "#!/bin/bash",
        "# perfsim calibrate on SuperMUC-NG Phase 2: one rank per Max 1550 tile, 8 tiles per node.",
        "# Written by `perfsim calibrate --emit-slurm`; submit with `sbatch` from the folder that should",
        "# hold the ledger. Resubmitting the same script resumes from the ledger.",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={TILES_PER_NODE}",
        f"#SBATCH --time={job.time}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={job.job_name}-%j.out",
    ]
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        lines.append(f"#SBATCH --account={job.account}")
    lines += ["", "set -euo pipefail", ""]
    if job.setup:
        lines += ["# Software environment"] + list(job.setup) + [""]
    else:
        lines += ["# Software environment: load the XPU torch stack here (module load ..., source venv/bin/activate)",
                  ""]
    lines.append("# One device per tile (FLAT hierarchy), the node's 8 tiles in PCI order")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in LEVEL_ZERO_ENV]
    lines += ["", "# oneCCL settings validated on SMNG-P2 (shared/reference/hardware.md)"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in ONECCL_ENV]
    lines += [
        "",
        "# Rendezvous on the first node of the allocation; each rank takes RANK, WORLD_SIZE and",
        "# LOCAL_RANK from PMI_RANK, PMI_SIZE and PALS_LOCAL_RANKID set by mpiexec.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT=$(( {job.port_base} + SLURM_JOB_ID % 1000 ))",
        "export MASTER_ADDR MASTER_PORT",
        f"NRANKS=$(( SLURM_NNODES * {TILES_PER_NODE} ))",
        f"export LOCAL_WORLD_SIZE={TILES_PER_NODE}",
        "",
        'echo "perfsim calibrate: $NRANKS ranks on $SLURM_NNODES nodes, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        f'mpiexec -n "$NRANKS" -ppn {TILES_PER_NODE} {worker}',
    ]
    if job.fit_argv:
        fit = " ".join(shlex.quote(a) for a in ("perfsim",) + tuple(job.fit_argv))
        lines += ["", "# Fit the profile to the ledger (no GPU needed; can be rerun anywhere)", fit]
    return "\n".join(lines) + "\n"
