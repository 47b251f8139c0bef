"""validate.optim.MasterAdam (fp32 master weights and moments behind low-precision parameters) and
the allocator peak the timing run measures memory with (validate.device.AllocationPeak)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from validate.optim import OPTIMIZER_STATE_BYTES_PER_PARAM, MasterAdam  # noqa: E402


def _pair():
    torch.manual_seed(0)
    low = torch.nn.Linear(8, 4).to(torch.bfloat16)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    return low, ref


def test_follows_fp32_adamw_to_bf16_rounding():
    low, ref = _pair()
    ours = MasterAdam(low.parameters(), lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randn(3, 8)
    for _ in range(3):
        ours.zero_grad()
        theirs.zero_grad()
        low(x.bfloat16()).float().square().sum().backward()
        ref(x).square().sum().backward()
        ours.step()
        theirs.step()
    # the master copy tracks fp32 AdamW up to the bf16 rounding of the gradients it is fed
    master = ours.state[low.weight]["master"]
    assert torch.allclose(master, ref.weight, atol=2e-3)
    assert torch.equal(low.weight, master.to(torch.bfloat16))


def test_state_is_twelve_bytes_a_parameter_once_initialised():
    low, _ = _pair()
    opt = MasterAdam(low.parameters())
    assert opt.state_bytes() == 0
    opt.init_states()
    assert opt.state_bytes() == OPTIMIZER_STATE_BYTES_PER_PARAM * sum(p.numel() for p in low.parameters())


def test_cpu_allocation_peak_counts_what_the_build_keeps_not_its_transients():
    from validate.device import Device

    dev = Device("cpu")
    mb = 1 << 20
    with dev.allocation_peak() as peak:
        kept = torch.empty(4 * mb, dtype=torch.uint8)
        transient = torch.empty(40 * mb, dtype=torch.uint8)
        del transient
        peak.window()
        during = torch.empty(8 * mb, dtype=torch.uint8)
        del during
    assert 12 * mb <= peak.bytes < 13 * mb
    with dev.allocation_peak() as whole:  # no window: the whole region
        transient = torch.empty(40 * mb, dtype=torch.uint8)
        del transient
    assert 40 * mb <= whole.bytes < 41 * mb
    del kept


def test_cpu_allocation_peak_sees_frees_on_other_threads():
    """A tensor freed on a thread the profiler does not follow (as gloo's workers free a
    reduce-scatter's clone) leaves the peak's running total, and c10's flag is put back after."""
    import threading

    from validate.device import Device, count_frees_on_every_thread

    dev = Device("cpu")
    mb = 1 << 20
    before = count_frees_on_every_thread(False)
    assert before is not None, "this torch build does not export c10's flag: CPU peaks would miss other threads' frees"
    held = [torch.empty(40 * mb, dtype=torch.uint8)]
    with dev.allocation_peak() as peak:
        held.append(torch.empty(40 * mb, dtype=torch.uint8))
        freeing = threading.Thread(target=held.clear)
        freeing.start()
        freeing.join()
        peak.window()
        during = torch.empty(8 * mb, dtype=torch.uint8)
        del during
    assert 8 * mb <= peak.bytes < 9 * mb  # 48 MB when the other thread's free went unseen
    assert count_frees_on_every_thread(before) is False
