"""Published measurements perfsim is held against (shared/reference/published.md), as data.

SC21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21, Table 1 (weak scaling on Selene, DGX A100 80 GB): model preset, TP, PP,
GPUs, global batch, reported TFLOP/s per GPU (hardware FLOPs, eq. 3, full recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sc21Row:
    preset: str
    params_billion: float
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float


SC21_TABLE1 = (
    Sc21Row("sc21-1.7b", 1.7, 1, 1, 32, 512, 137),
    Sc21Row("sc21-3.6b", 3.6, 2, 1, 64, 512, 138),
    Sc21Row("sc21-7.5b", 7.5, 4, 1, 128, 512, 142),
    Sc21Row("sc21-18.4b", 18.4, 8, 1, 256, 1024, 135),
    Sc21Row("sc21-39.1b", 39.1, 8, 2, 512, 1536, 138),
    Sc21Row("sc21-76.1b", 76.1, 8, 4, 1024, 1792, 140),
    Sc21Row("sc21-145.6b", 145.6, 8, 8, 1536, 2304, 148),
    Sc21Row("sc21-310.1b", 310.1, 8, 16, 1920, 2160, 155),
    Sc21Row("sc21-529.6b", 529.6, 8, 35, 2520, 2520, 163),
    Sc21Row("sc21-1t", 1008.0, 8, 64, 3072, 3072, 163),
)
