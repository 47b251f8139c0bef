"""validate.device and the rank environment with the import machinery faked: the XPU/oneCCL paths
cannot run here, so their selection logic is tested against fake torch, IPEX and oneCCL modules."""

from __future__ import annotations

import sys
import types

import pytest

from perfsim.errors import PerfsimError
from validate import device as vdev
from validate.ranks import rank_environment


def fake_torch(xccl=None, gloo=True, nccl=True, xpu=True, cuda=False, distributed=True):
    """A stand-in for torch with just what validate.device reads. xccl=None: no is_xccl_available
    at all (torch < 2.8); True/False: what it answers."""
    dist = types.SimpleNamespace(is_available=lambda: distributed, is_gloo_available=lambda: gloo,
                                 is_nccl_available=lambda: nccl)
    if xccl is not None:
        dist.is_xccl_available = lambda: xccl
    torch = types.ModuleType("torch")
    torch.__version__ = "2.8.0+xpu"
    torch.distributed = dist
    torch.version = types.SimpleNamespace(cuda=None, xpu="20250101")
    torch.cuda = types.SimpleNamespace(is_available=lambda: cuda)
    if xpu is not None:
        torch.xpu = FakeXpu(available=xpu)
    return torch


class FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        FakeEvent.clock[0] += 0.25  # each record is 0.25 ms after the previous
        self.t = FakeEvent.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t  # milliseconds, as torch.xpu.Event does


class FakeXpu:
    """torch.xpu (or torch.cuda: the same API) with what validate.device calls."""

    Event = FakeEvent

    def __init__(self, available=True):
        self.available, self.current, self.synced, self.reset = available, None, 0, []
        self.allocated = 100  # bytes the caching allocator holds now

    def memory_allocated(self, index):
        return self.allocated

    def is_available(self):
        return self.available

    def device_count(self):
        return 8

    def set_device(self, index):
        self.current = index

    def synchronize(self):
        self.synced += 1

    def reset_peak_memory_stats(self, index):
        self.reset.append(index)

    def max_memory_allocated(self, index):
        return 123 * (index + 1)

    def get_device_properties(self, index):
        return types.SimpleNamespace(total_memory=64 * 2**30)

    def get_device_name(self, index):
        return "Intel(R) Data Center GPU Max 1550"


@pytest.fixture
def no_module(monkeypatch):
    """Make `import name` fail (sys.modules[name] = None raises ImportError)."""
    def hide(*names):
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)
    return hide


def test_xccl_first_when_torch_has_it(monkeypatch, no_module):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=True))
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", types.ModuleType("oneccl_bindings_for_pytorch"))
    assert vdev.distributed_backend("xpu") == "xccl"


def test_ccl_through_oneccl_bindings_when_no_xccl(monkeypatch):
    imported = []
    bindings = types.ModuleType("oneccl_bindings_for_pytorch")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=None))
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", bindings)
    real = vdev.importlib.import_module
    monkeypatch.setattr(vdev.importlib, "import_module", lambda name: imported.append(name) or real(name))
    assert vdev.distributed_backend("xpu") == "ccl"
    assert "oneccl_bindings_for_pytorch" in imported  # importing it is what registers `ccl`


def test_ccl_when_xccl_is_reported_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=False))
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", types.ModuleType("oneccl_bindings_for_pytorch"))
    assert vdev.distributed_backend("xpu") == "ccl"


@pytest.mark.parametrize("xccl", [None, False])
def test_no_oneccl_backend_names_what_to_install(monkeypatch, no_module, xccl):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=xccl))
    no_module("oneccl_bindings_for_pytorch")
    with pytest.raises(PerfsimError) as err:
        vdev.distributed_backend("xpu")
    message = str(err.value)
    assert "xccl" in message and "oneccl_bindings_for_pytorch" in message and "install" in message


def test_broken_binary_extension_counts_as_absent(monkeypatch):
    def explode(name):
        raise OSError(f"{name}: undefined symbol")  # what a mismatched binary extension raises
    monkeypatch.setattr(vdev.importlib, "import_module", explode)
    assert vdev.optional_import("intel_extension_for_pytorch") is None
    assert vdev.load_intel_extension() is None


def test_ipex_is_optional_and_used_when_importable(monkeypatch, no_module):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=True))
    no_module("intel_extension_for_pytorch")
    vdev.check_available("xpu")  # no IPEX: fine
    ipex = types.ModuleType("intel_extension_for_pytorch")
    ipex.__version__ = "2.8.10+xpu"
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", ipex)
    assert vdev.load_intel_extension() == "2.8.10+xpu"


@pytest.mark.parametrize("xpu", [None, False])
def test_xpu_missing_or_unavailable(monkeypatch, no_module, xpu):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=True, xpu=xpu))
    no_module("intel_extension_for_pytorch")
    with pytest.raises(PerfsimError, match="--device xpu: .*sees no Intel GPU.*install"):
        vdev.check_available("xpu")


def test_cuda_and_cpu_backends(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    assert vdev.distributed_backend("cuda") == "nccl"
    assert vdev.distributed_backend("cpu") == "gloo"
    monkeypatch.setitem(sys.modules, "torch", fake_torch(nccl=False, gloo=False))
    with pytest.raises(PerfsimError, match="no nccl backend"):
        vdev.distributed_backend("cuda")
    with pytest.raises(PerfsimError, match="no gloo backend"):
        vdev.distributed_backend("cpu")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(distributed=False))
    with pytest.raises(PerfsimError, match="without torch.distributed"):
        vdev.distributed_backend("cpu")


def test_unknown_device_kind():
    with pytest.raises(PerfsimError, match="unknown device 'tpu'"):
        vdev.check_kind("tpu")


def test_no_torch_says_how_to_install(monkeypatch, no_module):
    no_module("torch")
    with pytest.raises(PerfsimError, match="torch==2.13.0"):
        vdev.import_torch()


def test_xpu_device_layer_against_the_documented_api(monkeypatch, no_module):
    torch = fake_torch(xccl=True)
    torch.device = lambda kind, index=None: (kind, index)
    monkeypatch.setitem(sys.modules, "torch", torch)
    no_module("intel_extension_for_pytorch")
    dev = vdev.Device("xpu", local_rank=11)  # 8 tiles visible: local rank 11 owns tile 3
    assert dev.index == 3 and torch.xpu.current == 3 and dev.torch_device == ("xpu", 3)
    dev.sync()
    assert torch.xpu.synced == 1
    timer = dev.timer()
    assert isinstance(timer, vdev.EventTimer)
    timer.start()
    assert timer.stop() == pytest.approx(0.25e-3)  # events report milliseconds; the timer seconds
    dev.reset_peak_memory()
    assert torch.xpu.reset == [3] and dev.peak_memory_bytes() == 123 * 4
    assert dev.describe() == {"kind": "xpu", "index": 3, "name": "Intel(R) Data Center GPU Max 1550",
                              "memory_bytes": 64 * 2**30}


def test_xpu_allocation_peak_reads_the_caching_allocator(monkeypatch, no_module):
    """What a window's peak is made of on a GPU: the allocator's max over a reset at the window,
    less what was allocated when the region began; every read after the device was waited for."""
    torch = fake_torch(xccl=True)
    torch.device = lambda kind, index=None: (kind, index)
    monkeypatch.setitem(sys.modules, "torch", torch)
    no_module("intel_extension_for_pytorch")
    dev = vdev.Device("xpu", local_rank=2)
    with dev.allocation_peak() as peak:
        synced = torch.xpu.synced
        peak.window()
        assert torch.xpu.synced == synced + 1 and torch.xpu.reset == [2, 2]
    assert peak.bytes == 123 * 3 - 100  # max_memory_allocated(2) less memory_allocated at entry


def test_cuda_device_takes_the_same_calls(monkeypatch):
    """Device("cuda") goes through torch.cuda exactly as Device("xpu") through torch.xpu."""
    torch = fake_torch(cuda=True)
    torch.cuda = FakeXpu()
    torch.device = lambda kind, index=None: (kind, index)
    monkeypatch.setitem(sys.modules, "torch", torch)
    dev = vdev.Device("cuda", local_rank=9)
    assert dev.index == 1 and torch.cuda.current == 1 and dev.torch_device == ("cuda", 1)
    dev.sync()
    assert torch.cuda.synced == 1 and isinstance(dev.timer(), vdev.EventTimer)
    dev.reset_peak_memory()
    assert torch.cuda.reset == [1] and dev.peak_memory_bytes() == 123 * 2 and dev.memory_bytes() == 64 * 2**30


def test_xpu_software_versions_name_the_stack(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(xccl=False))
    for name, version in (("intel_extension_for_pytorch", "2.8.10+xpu"), ("oneccl_bindings_for_pytorch", "2.8.0")):
        module = types.ModuleType(name)
        module.__version__ = version
        monkeypatch.setitem(sys.modules, name, module)
    versions = vdev.software_versions("xpu")
    assert (versions["torch"], versions["xpu"]) == ("2.8.0+xpu", "20250101")
    assert (versions["ipex"], versions["oneccl_bindings_for_pytorch"]) == ("2.8.10+xpu", "2.8.0")


def test_rank_environment_from_mpiexec_pmi():
    env = {"PMI_RANK": "13", "PMI_SIZE": "16", "PALS_LOCAL_RANKID": "5", "LOCAL_WORLD_SIZE": "8"}
    assert rank_environment(env) == rank_environment(env)
    r = rank_environment(env)
    assert (r.rank, r.world, r.local_rank, r.local_world) == (13, 16, 5, 8)


def test_rank_environment_torchrun_wins_and_defaults():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "PMI_RANK": "7", "PMI_SIZE": "9"}
    r = rank_environment(env)
    assert (r.rank, r.world, r.local_rank, r.local_world) == (1, 2, 1, 2)
    assert rank_environment({}) == type(r)(0, 1, 0, 1)


@pytest.mark.parametrize("env, message", [({"PMI_RANK": "x"}, "not a whole number"),
                                          ({"RANK": "4", "WORLD_SIZE": "4"}, "outside a world")])
def test_rank_environment_errors(env, message):
    with pytest.raises(PerfsimError, match=message):
        rank_environment(env)
