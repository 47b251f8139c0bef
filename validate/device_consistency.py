"""A check, on a CPU-only machine, that a piece of harness code would not mix devices on a GPU.

On a GPU run a tensor made without `device=` (torch.zeros(()), torch.randint(..., generator=g),
torch.tensor(...)) lives on the CPU, and an op that meets it beside GPU tensors fails there
("state_steps is on cpu, different from other tensors on cuda:0": MasterAdam's step counter
once). On a CPU run every tensor is on the CPU and nothing fails, so CI never saw it. Inside
`with DeviceConsistency():` such tensors count as being on a device of their own, "host", and
every op whose tensors a GPU would refuse to mix raises MixedDevices naming the op, its
arguments, their devices and where the host tensor was made.

How:
- A TorchFunctionMode marks the storage of what a factory (torch's own list of them, the one
  torch.set_default_device acts on) returns when called without a device, and of `.cpu()`;
  `.to(device)` / `.cuda()` / `.xpu()` clear the mark (on a CPU the move to the CPU is a no-op
  that returns the same tensor, so the mark is cleared on that tensor's storage, which a GPU run
  would have left on the CPU: a later use of the original is not seen).
- A TorchDispatchMode sees every aten and c10d op with its tensors (a DTensor's or another
  wrapper's inner tensors): an op whose tensors lie on more than one device raises, and what an
  op makes from host tensors alone is host too (slices of a host batch, say), unless it is given
  a device.
Marks live on storages, not tensor objects: views, `.data` and `.detach()` share them.

On a CPU run the step's device and a deliberate `device="cpu"` are the same value, so any device
named counts as the step's: code that keeps a tensor on the host on purpose (a batch drawn whole,
then sliced and moved) makes it without a device (validate.training.synthetic_batches).

Why not run the step under torch.set_default_device("meta"): then a tensor made without a
device has no data, and the pattern every GPU harness uses, make on the CPU and move with
`.to(device)` (the seeded batches, the initial weights), fails with "Cannot copy out of meta
tensor" though a GPU runs it. Marking tells the two apart; which factories are seen is the same
(function modes are off inside torch's own overridable Python functions, for both).

What a GPU accepts and this check therefore lets through (exemptions, with their reasons):
- copies between devices (copy_, _to_copy, _foreach_copy_): that is how a tensor moves;
- a 0-dim host tensor read by a pointwise op (torch.Tag.pointwise): TensorIterator, which runs
  them on every device, takes CPU scalars beside device tensors (not as an output). Not for other
  ops: a fused optimizer, a matmul or a collective refuses them, as it refused MasterAdam's step
  counter. (FakeTensor lets 0-dim CPU tensors through every op, which would miss that.)
- collectives (c10d ops) refuse host tensors outright: NCCL and XCCL take device tensors only.
Meant for CPU runs; on a GPU the real devices differ and the ops check themselves.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

HOST = "host"  # the device a tensor made without one would be on in a GPU run: the CPU
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NAMED = 3  # tensors an error names per device
_PRUNE_EVERY = 4096  # marks between sweeps of the marks of freed storages
_aten = torch.ops.aten
# ops that move data between devices: mixing is what they are for
COPIES = frozenset({_aten.copy_.default, _aten.copy.default, _aten._to_copy.default, _aten._copy_from.default,
                    _aten._foreach_copy_.default})
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class MixedDevices(RuntimeError):
    """An op would meet tensors of different devices on a GPU run."""


def _factories() -> frozenset:
    """The functions torch.set_default_device gives a device to (torch.utils._device's list)."""
    try:
        from torch.utils._device import _device_constructors

        return frozenset(_device_constructors())
    except (ImportError, AttributeError):  # a torch without the private list: the common ones
        return frozenset(getattr(torch, n) for n in ("arange", "empty", "full", "ones", "rand", "randint", "randn",
                                                      "randperm", "tensor", "zeros", "as_tensor", "scalar_tensor"))


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (where a tensor was made)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != __file__:
            return f"{os.path.relpath(name) if not name.startswith('<') else name}:{frame.f_lineno}"
        frame = frame.f_back
    return "torch"


class _HostStorages:
    """Which storages hold host tensors, and where each was made. Keyed by a weak reference to the
    storage: it keeps the storage's address from being reused while the mark exists."""

    def __init__(self):
        self._made_at = {}
        self._marks = 0

    @staticmethod
    def _key(t):
        if t.device.type != "cpu":
            return None
        try:
            return StorageWeakRef(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # no storage (sparse and other layouts)
            return None

    def made_at(self, t) -> str | None:
        key = self._key(t)
        return self._made_at.get(key) if key is not None else None

    def mark(self, t, made_at: str) -> None:
        key = self._key(t)
        if key is None:
            return
        self._made_at[key] = made_at
        self._marks += 1
        if self._marks % _PRUNE_EVERY == 0:
            self._made_at = {k: v for k, v in self._made_at.items() if not k.expired()}

    def clear(self, t) -> None:
        key = self._key(t)
        if key is not None:
            self._made_at.pop(key, None)


def _plain(value):
    """The plain tensors in `value` (nested lists, tuples, dicts; a wrapper subclass's inner tensors)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _plain(getattr(value, name))
        else:
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _plain(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _plain(v)


_parameters = {}  # op -> (name, keyword-only, written) of each of its schema's arguments


def _named_tensors(func, args, kwargs):
    """(argument name, written by the op, plain tensor) for every tensor argument of `func`."""
    params = _parameters.get(func)
    if params is None:
        schema = getattr(func, "_schema", None)
        if schema is None:  # not an OpOverload (a higher-order op): its tensors, unnamed
            return [(f"arg[{i}]", False, t) for i, t in enumerate(_plain((args, kwargs)))]
        params = _parameters[func] = tuple((a.name, a.kwarg_only, bool(a.alias_info and a.alias_info.is_write))
                                           for a in schema.arguments)
    out = []
    for i, (name, kwarg_only, written) in enumerate(params):
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        tensors = list(_plain(value))
        single = len(tensors) == 1 and isinstance(value, torch.Tensor)
        out.extend((name if single else f"{name}[{j}]", written, t) for j, t in enumerate(tensors))
    return out


class _Ops(TorchDispatchMode):
    """Checks every op's tensors and carries host marks to what host tensors alone make."""

    def __init__(self, host: _HostStorages):
        super().__init__()
        self.host = host

    def device_of(self, t) -> str:
        return HOST if self.host.made_at(t) is not None else str(t.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = _named_tensors(func, args, kwargs)
        if named:
            self._check(func, named)
        out = func(*args, **kwargs)
        if named and kwargs.get("device") is None and all(self.device_of(t) == HOST for _, _, t in named):
            made_at = self.host.made_at(named[0][2])
            for t in _plain(out):
                self.host.mark(t, made_at)
        return out

    def _check(self, func, named) -> None:
        devices = [(name, written, t, self.device_of(t)) for name, written, t in named]
        if getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
            bad = [d for d in devices if d[3] == HOST]
            if bad:
                raise MixedDevices(self._message(func, devices, "a collective takes device tensors only (NCCL, XCCL)"))
        if func in COPIES or len({d[3] for d in devices}) < 2:
            return
        if torch.Tag.pointwise in getattr(func, "tags", ()):  # host scalars read beside device tensors are fine
            kept = [d for d in devices if d[1] or d[3] != HOST or d[2].dim() != 0]
            if len({d[3] for d in kept}) < 2:
                return
        raise MixedDevices(self._message(func, devices, "a GPU refuses tensors of different devices in one op"))

    def _message(self, func, devices, why: str) -> str:
        """The op, why it fails on a GPU, and its tensors by device (host first, with where each
        was made), a few names a device."""
        by_device = {}
        for name, _, t, device in devices:
            where = f" made at {self.host.made_at(t)}" if device == HOST else ""
            dtype = str(t.dtype).replace("torch.", "")
            by_device.setdefault(device, []).append(f"{name} {tuple(t.shape)} {dtype}{where}")
        parts = []
        for device in sorted(by_device, key=lambda d: d != HOST):
            names = by_device[device]
            more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
            parts.append(f"on {device}: {', '.join(names[:_NAMED])}{more}")
        return (f"{func}: {why}; {'; '.join(parts)} ({HOST}: made without device=, on the CPU in a GPU run; "
                f"give it the device of the tensors it meets)")


class _Factories(TorchFunctionMode):
    """Marks what factories return without a device, and `.cpu()`; clears the mark on a move."""

    def __init__(self, host: _HostStorages):
        super().__init__()
        self.host = host
        self.factories = _factories()
        self.takes_data = {f for f in self.factories if f.__name__ in ("tensor", "as_tensor", "asarray")}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.factories:
            if kwargs.get("device") is None and not (func in self.takes_data and args and
                                                     isinstance(args[0], torch.Tensor)):
                for t in _plain(out):
                    self.host.mark(t, _caller())
        elif func is torch.Tensor.cpu:
            for t in _plain(out):
                self.host.mark(t, _caller())
        elif func in (torch.Tensor.cuda, torch.Tensor.xpu) or (func is torch.Tensor.to and self._moves(args, kwargs)):
            target = args[1] if func is torch.Tensor.to and len(args) > 1 else kwargs.get("other")
            made_at = self.host.made_at(target) if isinstance(target, torch.Tensor) else None
            for t in _plain(out):
                if made_at is None:
                    self.host.clear(t)
                else:  # .to(a host tensor): where that one is
                    self.host.mark(t, made_at)
        return out

    @staticmethod
    def _moves(args, kwargs) -> bool:
        """Whether a Tensor.to call names a device (or a tensor whose device it takes)."""
        try:
            return torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None
        except (TypeError, RuntimeError):
            return False


class DeviceConsistency:
    """`with DeviceConsistency():` raises MixedDevices where the code inside would mix devices in
    one op on a GPU (see the module doc). Tensors made before entering are taken as device tensors."""

    def __init__(self):
        self.host = _HostStorages()
        self._modes = (_Factories(self.host), _Ops(self.host))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
