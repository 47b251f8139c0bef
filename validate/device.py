"""One interface to the devices a rank can own: an Intel XPU tile, a CUDA GPU, or a CPU rank.

What the benchmarks need from a device: put tensors on it, wait for it (`sync`), time a piece of
work (device events on XPU and CUDA, the wall clock on CPU), read and reset the peak memory, and
the torch.distributed backend that talks between such devices:

| device | backend | where it comes from |
|---|---|---|
| xpu | `xccl` | torch >= 2.8 XPU builds (`torch.distributed.is_xccl_available()`) |
| xpu | `ccl` | `import oneccl_bindings_for_pytorch` (older stacks; archived upstream) |
| cuda | `nccl` | CUDA builds of torch |
| cpu | `gloo` | every build |

`intel_extension_for_pytorch` is imported when importable (older XPU stacks need it to register
the device); nothing requires it. The XPU paths follow the documented torch.xpu API
(shared/reference/hardware.md) and cannot run on the project's machines: tests fake the imports.
"""

from __future__ import annotations

import importlib
import os
import resource
import time

from perfsim.errors import PerfsimError

KINDS = ("cpu", "cuda", "xpu")
# Where to get what is missing (said in the error messages).
INSTALL_TORCH = "pip install torch==2.13.0 (CPU), a CUDA build of torch, or the XPU build from Intel's torch index"
INSTALL_XPU = ("the XPU build of torch >= 2.8 (native xccl backend) from the vendor's torch index, or an older "
               "XPU stack with oneccl_bindings_for_pytorch (oneccl_bind_pt) and intel_extension_for_pytorch")


# What to install for each device kind. The [validate] extra names torch unpinned (an unpinned
# torch pulls the newest CUDA build, several GB), so the pin goes with it.
INSTALL_TORCH_FOR = {"cpu": "pip install torch==2.13.0 (or the project's [validate] extra with that pin: "
                            "pip install \".[validate]\" torch==2.13.0)",
                     "cuda": "a CUDA build of torch (or the project's [validate] extra with it)",
                     "xpu": "the XPU build of torch from Intel's torch index"}


def import_torch(command: str = "perfsim calibrate", kind: str | None = None):
    """torch, or a PerfsimError saying that `command` (on device `kind`) needs it and how to install it."""
    try:
        import torch  # noqa: PLC0415 (the harness only; perfsim itself never imports torch)
    except ImportError:
        what = f"{command} --device {kind}" if kind else command
        raise PerfsimError(f"{what} needs torch, which is not installed here: "
                           f"{INSTALL_TORCH_FOR.get(kind, INSTALL_TORCH)}") from None
    return torch


def optional_import(name: str):
    """The module if it imports, else None. A broken optional extension (IPEX built for another
    torch raises at import) counts as absent."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - ImportError, or whatever a mismatched binary extension raises
        return None


def load_intel_extension():
    """Import intel_extension_for_pytorch when it is there (older stacks need it to register the
    xpu device and its kernels); its version, or None."""
    ipex = optional_import("intel_extension_for_pytorch")
    return getattr(ipex, "__version__", "unknown") if ipex is not None else None


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise PerfsimError(f"unknown device {kind!r}; choose one of {', '.join(KINDS)}")


def xpu_available(torch) -> bool:
    xpu = getattr(torch, "xpu", None)
    try:
        return bool(xpu is not None and xpu.is_available())
    except Exception:  # noqa: BLE001 - a driver problem reads as "not available"
        return False


def check_available(kind: str, command: str = "perfsim calibrate") -> None:
    """Raise a PerfsimError saying what to install when `kind` cannot be used here by `command`."""
    check_kind(kind)
    torch = import_torch(command, kind)
    if kind == "cuda" and not torch.cuda.is_available():
        built = getattr(torch.version, "cuda", None)
        why = "no CUDA device is visible" if built else f"torch {torch.__version__} is a build without CUDA"
        raise PerfsimError(f"--device cuda: {why}; install a CUDA build of torch on a GPU machine, or use --device cpu")
    if kind == "xpu":
        load_intel_extension()
        if not xpu_available(torch):
            raise PerfsimError(f"--device xpu: torch {torch.__version__} sees no Intel GPU (torch.xpu is missing or "
                               f"not available); install {INSTALL_XPU}, and the Level Zero driver")


def distributed_backend(kind: str) -> str:
    """The torch.distributed backend for `kind`: xccl > ccl on XPU, nccl on CUDA, gloo on CPU.
    Importing oneccl_bindings_for_pytorch registers `ccl`, so this is called before
    init_process_group."""
    check_kind(kind)
    torch = import_torch()
    dist = torch.distributed
    if not dist.is_available():
        raise PerfsimError(f"torch {torch.__version__} was built without torch.distributed; {INSTALL_TORCH}")
    if kind == "cpu":
        if not dist.is_gloo_available():
            raise PerfsimError(f"torch {torch.__version__} has no gloo backend; {INSTALL_TORCH}")
        return "gloo"
    if kind == "cuda":
        if not dist.is_nccl_available():
            raise PerfsimError(f"torch {torch.__version__} has no nccl backend; install a CUDA build of torch")
        return "nccl"
    is_xccl = getattr(dist, "is_xccl_available", None)
    if is_xccl is not None and is_xccl():
        return "xccl"
    if optional_import("oneccl_bindings_for_pytorch") is not None:
        return "ccl"
    raise PerfsimError(f"--device xpu: no oneCCL backend: torch {torch.__version__} has no xccl and "
                       f"oneccl_bindings_for_pytorch is not importable; install {INSTALL_XPU}")


def software_versions(kind: str) -> dict:
    """Versions of what the measurements depend on."""
    torch = import_torch()
    out = {"torch": torch.__version__}
    if kind == "cuda":
        out["cuda"] = getattr(torch.version, "cuda", None)
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            pass
    if kind == "xpu":
        out["xpu"] = getattr(torch.version, "xpu", None)
        out["ipex"] = load_intel_extension()
        ccl = optional_import("oneccl_bindings_for_pytorch")
        if ccl is not None:
            out["oneccl_bindings_for_pytorch"] = getattr(ccl, "__version__", "unknown")
    if kind == "cpu":
        out["threads"] = torch.get_num_threads()
    import numpy
    import perfsim
    out["numpy"], out["perfsim"] = numpy.__version__, perfsim.__version__
    return out


class Device:
    """The device one rank owns. `local_rank` picks the GPU/tile; on CPU it only names the rank,
    and `threads` sets torch's intra-op threads (one rank per core by default)."""

    def __init__(self, kind: str, local_rank: int = 0, threads: int | None = None):
        check_available(kind)
        self.torch = import_torch()
        self.kind, self.index = kind, local_rank
        if kind == "cpu":
            if threads:
                self.torch.set_num_threads(threads)
            self.torch_device = self.torch.device("cpu")
            self._module = None
        else:
            self._module = getattr(self.torch, kind)  # torch.cuda / torch.xpu share this API
            count = self._module.device_count()
            self.index = local_rank % max(count, 1)
            self._module.set_device(self.index)
            self.torch_device = self.torch.device(kind, self.index)

    # --- waiting and timing ---
    def sync(self) -> None:
        if self._module is not None:
            self._module.synchronize()

    def timer(self) -> "Timer":
        return EventTimer(self._module) if self._module is not None else WallTimer()

    # --- memory ---
    def reset_peak_memory(self) -> None:
        if self._module is not None:
            self._module.reset_peak_memory_stats(self.index)

    def peak_memory_bytes(self) -> int:
        """Peak bytes allocated on the device since the last reset; on CPU the process's peak
        resident set (which cannot be reset; allocation_peak measures what tensors hold)."""
        if self._module is not None:
            return int(self._module.max_memory_allocated(self.index))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def memory_bytes(self) -> int:
        if self._module is not None:
            return int(self._module.get_device_properties(self.index).total_memory)
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def allocation_peak(self) -> "AllocationPeak":
        """Context manager: the peak of bytes the allocator holds inside it, over what it held at entry."""
        return AllocationPeak(self)

    def name(self) -> str:
        if self._module is not None:
            return str(self._module.get_device_name(self.index))
        return _cpu_name()

    def describe(self) -> dict:
        return {"kind": self.kind, "index": self.index, "name": self.name(), "memory_bytes": self.memory_bytes()}


class AllocationPeak:
    """Peak allocated bytes of a window, counted from what was allocated when the region began.

    `with dev.allocation_peak() as peak: build(); peak.window(); run()` measures the run's peak
    with what the build left allocated (weights, optimizer states) counted in, but not what the
    build allocated only while it ran (a model built whole before it was sharded or cast); without
    `window()` the whole region counts. GPU and XPU: the caching allocator's max_memory_allocated
    after a reset. CPU: torch keeps no CPU allocator statistics, so the profiler records every
    allocation and free with the running total torch's CPU allocator holds ('Total Allocated' of
    its [memory] events); the peak is the largest inside the window. Either way it is what tensors
    occupy, not the runtime's own memory or heap slack."""

    WINDOW = "perfsim-allocation-window"

    def __init__(self, device: "Device"):
        self.device, self.bytes = device, None
        self._window = None
        self._every_thread = None

    def __enter__(self):
        dev = self.device
        if dev._module is not None:
            dev.sync()
            self._start = dev._module.memory_allocated(dev.index)
            dev._module.reset_peak_memory_stats(dev.index)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._every_thread = count_frees_on_every_thread(True)
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def window(self) -> None:
        """From here on, the peak counts (what is allocated now included)."""
        dev = self.device
        if dev._module is not None:
            dev.sync()
            dev._module.reset_peak_memory_stats(dev.index)
        else:
            from torch.profiler import record_function

            self._window = record_function(self.WINDOW)
            self._window.__enter__()
            # an allocation puts the running total of this moment in the trace: the last one
            # before may be stale, by frees on threads without a [memory] event of their own
            dev.torch.empty(1)

    def __exit__(self, *exc):
        dev = self.device
        if dev._module is not None:
            dev.sync()
            self.bytes = int(dev._module.max_memory_allocated(dev.index) - self._start)
            return
        if self._window is not None:
            self._window.__exit__(*exc)
        self._profile.__exit__(*exc)
        if self._every_thread is not None:
            count_frees_on_every_thread(self._every_thread)
        if exc[0] is None:
            self.bytes = _profiled_peak(self._profile, self.WINDOW if self._window is not None else None)


# c10's CPU allocator keeps the running total the profiler reports ('Total Allocated'), but only on
# threads where the profiler is on: a tensor freed on any other thread stays in that total for
# good. gloo's worker threads drop their work (and a reduce-scatter's clone of its input) outside
# the profiler's thread state, so each such free left a phantom block in the total: the same
# FSDP2 step "peaked" 362-502 MB from run to run (docs/calibration.md, section 5). c10's flag
# caffe2_report_cpu_memory_usage makes every thread's allocations and frees count; it has no
# Python binding, so it is set in libc10 itself.
_C10_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def count_frees_on_every_thread(on: bool) -> bool | None:
    """Set c10's flag that counts CPU allocations and frees on every thread; return its previous
    value, or None where this torch build does not export it (the total then misses other
    threads' frees)."""
    import ctypes
    import glob

    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), _C10_FLAG)
        except (OSError, ValueError):
            continue
        previous, flag.value = bool(flag.value), on
        return previous
    return None


def _profiled_peak(prof, window: str | None = None) -> int:
    """The largest 'Total Allocated' of the trace's CPU [memory] events, from the start of the
    `window` event on (AllocationPeak.window allocates right there, so the running total of
    that moment is in)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        events = json.load(open(fh.name))["traceEvents"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0)
    if not memory:
        return 0
    # the running total can carry what earlier profiled regions left allocated: count from the
    # level before this region's first allocation
    base = memory[0][1] - memory[0][2]
    if window is None:
        return int(max(t for _, t, _ in memory) - base)
    start = min(e["ts"] for e in events if e.get("name") == window)
    return int(max((t for ts, t, _ in memory if ts >= start), default=base) - base)


class WallTimer:
    """Wall clock around work that has already been waited for (CPU: torch ops are synchronous)."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class EventTimer:
    """Device events (torch.cuda.Event / torch.xpu.Event with timing), seconds between them."""

    def __init__(self, module):
        self._start = module.Event(enable_timing=True)
        self._end = module.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3  # elapsed_time is in milliseconds


Timer = WallTimer | EventTimer


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "cpu"
