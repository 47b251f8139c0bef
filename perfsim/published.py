"""Published measurements perfsim is held against (docs/validation.md), as data.

SC21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21, Table 1 (weak scaling on Selene, DGX A100 80 GB): model preset, TP, PP,
GPUs, global batch, reported TFLOP/s per GPU (hardware FLOPs, eq. 3, full recomputation).

Megatron-LM on H100: the weak-scaling table of NVIDIA's Megatron-LM README (r0.8.0, July 2024) and
its 177B strong-scaling endpoints (published.md section 6): GPT models with GeLU MLP, multi-head
attention, untied embeddings, vocabulary 131,072, sequence 4096; TFLOP/s by Megatron's formula,
which is perfsim's model-FLOP count (full square, logits, no recomputation).
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


@dataclass(frozen=True)
class H100Row:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    batch: int
    tflops_per_gpu: float

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


H100_SEQ, H100_VOCAB = 4096, 131072
MEGATRON_H100_WEAK = (
    H100Row("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    H100Row("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    H100Row("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    H100Row("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    H100Row("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    H100Row("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    H100Row("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    H100Row("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    H100Row("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
)
# The 177B model strong-scaled at global batch 1152 (TP 8, PP 6): (GPUs, MFU of 989 TFLOP/s).
MEGATRON_H100_STRONG_177B = ((96, 0.47), (4608, 0.42))
H100_PEAK = 989e12
