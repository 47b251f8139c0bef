"""validate.instrument in one process (a one-rank gloo group): every collective family the harness
uses is recorded with its kind and full-tensor size, and FLOPs are counted on local shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from validate.instrument import CollectiveCounter, LocalFlopCounter  # noqa: E402

# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (*_single); the old names are
# what existing training code calls, so the test keeps them.
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


def test_plain_and_functional_collectives_are_recorded(one_rank_group):
    import torch.distributed._functional_collectives as funcol

    group = one_rank_group
    x = torch.ones(6, 4)
    with CollectiveCounter() as c:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(6, 4), x)
        dist.reduce_scatter_tensor(torch.empty(6, 4), x)
        dist.broadcast(x, src=0)
        dist.reduce(x, dst=0)
        for out in (funcol.all_reduce(x, "sum", group), funcol.all_gather_single(x, 0, group),
                    funcol.reduce_scatter_single(x, "sum", 0, group)):
            funcol.wait_tensor(out)
    kinds = [(r.kind, r.elements, r.element_bytes, r.group_size) for r in c.records]
    assert kinds == [("all_reduce", 24, 4, 1), ("all_gather", 24, 4, 1), ("reduce_scatter", 24, 4, 1),
                     ("broadcast", 24, 4, 1), ("reduce", 24, 4, 1), ("all_reduce", 24, 4, 1),
                     ("all_gather", 24, 4, 1), ("reduce_scatter", 24, 4, 1)]
    assert c.by_kind() == {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "broadcast": 0.0,
                           "reduce": 0.0}  # one rank sends nothing


def test_flops_of_linear_and_batched_products():
    lin = torch.nn.Linear(8, 16)
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 2)
    with LocalFlopCounter() as f:
        lin(torch.randn(4, 8))
        torch.matmul(a, b)
    assert f.total() == 2 * 4 * 8 * 16 + 2 * 3 * 5 * 7 * 2
