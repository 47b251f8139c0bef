"""No harness code mixes devices the way a GPU refuses (validate.device_consistency), checked on a
CPU: the checker itself, then one build and two optimizer steps of every plan kind `perfsim validate`
runs (validate.device_check, as 1, 2, 4 and 8 gloo ranks), the calibration's compute points and the
speed probes. MasterAdam's CPU step counter, which failed every GPU step at its
first optimizer step, is what the checker was written for (test_a_cpu_step_counter_is_caught)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from validate.device_check import cases_at  # noqa: E402
from validate.device_consistency import HOST, DeviceConsistency, MixedDevices  # noqa: E402
from validate.optim import MasterAdam  # noqa: E402

CPU = torch.device("cpu")  # the step's device, as the harness names it


class OldMasterAdam(MasterAdam):
    """MasterAdam as it was: its step counter made without a device."""

    def _init_state(self, p):
        state = super()._init_state(p)
        state["step"] = torch.zeros((), dtype=torch.float32)
        return state


def one_step(optimizer_class):
    lin = torch.nn.Linear(4, 4).to(CPU, torch.bfloat16)
    opt = optimizer_class(lin.parameters())
    opt.init_states()
    lin(torch.randn(2, 4).to(CPU, torch.bfloat16)).float().sum().backward()
    opt.step()


def test_a_cpu_step_counter_is_caught():
    with DeviceConsistency(), pytest.raises(MixedDevices) as err:
        one_step(OldMasterAdam)
    message = str(err.value)
    assert message.startswith("aten._fused_adamw_.default: a GPU refuses")
    assert f"on {HOST}: state_steps[0] () float32 made at " in message and __file__.rsplit("/", 1)[1] in message
    assert "on cpu: self[0] (4, 4) float32" in message


def test_master_adam_keeps_its_step_counter_on_the_parameters_device():
    with DeviceConsistency():
        one_step(MasterAdam)


def test_a_cpu_scalar_is_read_beside_device_tensors_by_pointwise_ops_only():
    x = torch.ones(3, device=CPU)
    with DeviceConsistency():
        assert torch.equal(x * torch.tensor(2.0), torch.full((3,), 2.0, device=CPU))  # TensorIterator's CPU scalar
        torch.randn(3) + torch.tensor(1.0)  # host tensors alone: no device met
        with pytest.raises(MixedDevices, match=r"aten.add.Tensor.*on host: other \(3,\)"):
            x + torch.ones(3)
        with pytest.raises(MixedDevices, match="aten.mm.default"):
            torch.mm(x.view(1, 3), torch.ones(3, 1))
        with pytest.raises(MixedDevices, match=r"aten.add_.Tensor.*on host: self \(\)"):
            torch.zeros(()).add_(x.sum())  # a CPU scalar written from a device tensor


def test_a_batch_made_on_the_host_is_used_once_moved():
    embedding = torch.nn.Embedding(10, 4).to(CPU)
    with DeviceConsistency():
        tokens = torch.randint(10, (2, 5), generator=torch.Generator().manual_seed(0))
        with pytest.raises(MixedDevices, match=r"aten.embedding.default.*on host: indices \(2, 4\) int64"):
            embedding(tokens[:, :-1])  # a slice of a host tensor is a host tensor
        moved = tokens[:, :-1].to(CPU)
        embedding(moved)
        embedding(tokens.detach().to(moved))  # .to(a tensor) takes its device
        with pytest.raises(MixedDevices):
            embedding(tokens.cpu())  # .cpu() brings it to the host


def test_factories_given_a_device_or_a_default_device_make_device_tensors():
    x = torch.ones(2, device=CPU)
    with DeviceConsistency():
        x + torch.zeros(2, device=CPU)
        x + torch.zeros_like(x)
        with torch.device("meta"):
            assert torch.zeros(2).device.type == "meta"


def test_a_collective_takes_device_tensors_only(one_rank_group):
    import torch.distributed as dist

    with DeviceConsistency():
        dist.all_reduce(torch.ones(2, device=CPU))
        with pytest.raises(MixedDevices, match="c10d.allreduce_.default: a collective takes device tensors only"):
            dist.all_reduce(torch.ones(2))


def test_a_dtensors_local_tensor_meets_a_host_tensor(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    weight = distribute_tensor(torch.ones(4, 3), init_device_mesh("cpu", (1,)), [Replicate()])
    with DeviceConsistency():
        with pytest.raises(MixedDevices, match="on host: self"):
            torch.ones(2, 4) @ weight


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_plan_kind_keeps_one_device(tmp_path_factory, world):
    """One device: every recompute mode, unfused and flash attention; 2 ranks: 1d (with and without
    SP, every recompute mode, unfused and flash attention), pipelines (GPipe, 1F1B, interleaved),
    ZeRO 0-3, context parallelism, the calibration's tensor-parallel overhead layers and its
    collectives; 4: 2d, context beside tensor and data parallelism; 8: 2.5d, 3d; each plan with the
    GPT and a Llama-shaped model; and at 1, 2 and 4 a model with experts' default plans (expert
    parallelism with either dispatcher, expert-DP, selective recomputation)."""
    data = run_rank_check(tmp_path_factory, "validate.device_check", world)
    assert data["plans"] == [label for label, _ in cases_at(world)]


def test_calibration_compute_points_and_speed_probes_keep_one_device():
    from perfsim.cost.layer import Gemm
    from validate.device import Device
    from validate.microbench import (ATTENTION_OPS, BACKWARD_OPS, CROSS_ENTROPY_OPS, GEMM_TIMING, MEMORY_OPS, Point,
                                     make_compute, point_shape)
    from validate.speed_probe import make_norm_probe, make_probe, make_reference_probes

    dev = Device("cpu")
    points = [Point("gemm", "matmul", dt, point_shape(count=count, m=128, n=128, k=128), timing=timing)
              for dt in ("fp32", "bf16") for count in (1, 2) for timing in ("", GEMM_TIMING)]
    points += [Point("memory", op, dt, point_shape(rows=16, cols=64))
               for dt in ("fp32", "bf16") for op in MEMORY_OPS + BACKWARD_OPS + CROSS_ENTROPY_OPS]
    points += [Point("attention", op, dt, point_shape(batch=1, heads=2, seq=32, head_dim=16))
               for dt in ("fp32", "bf16") for op in ATTENTION_OPS]
    with DeviceConsistency():
        for point in points:
            make_compute(torch, dev, point)()
        make_probe(torch, dev, Gemm("probe", 1, 64, 96, 32), "bf16")()
        make_norm_probe(torch, dev, (64, 32), "bf16", None)()
        for probe in make_reference_probes(torch, dev):
            probe()
