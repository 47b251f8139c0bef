"""perfsim.cost.measured.unique_rows: the distinct shapes a batch of plans asks a measured table
about, found without sorting a search's columns, are np.unique's."""

import numpy as np
import pytest


@pytest.mark.parametrize("distinct", [1, 3, 40, 5000])
def test_unique_rows_are_numpys_distinct_rows(distinct):
    """unique_rows finds the distinct rows without sorting a search's columns (a few values each,
    some the strided sample misses, scalars broadcast beside them): the rows, in order, and each
    element's row are np.unique(axis=0)'s over the log2 coordinates, at any number of distinct values."""
    from perfsim.cost.measured import unique_rows

    rng = np.random.default_rng(distinct)
    n = 20_000
    m = rng.choice(2.0 ** rng.integers(6, 20, size=distinct), size=n)
    n_col = np.where(np.arange(n) % 997 == 0, 12288.0, 4096.0)  # a value the sample can miss
    rows, inverse, shape = unique_rows([1.0, m.reshape(100, 200), n_col.reshape(100, 200), 1024.0])
    whole = np.log2(np.stack([np.ones(n), m, n_col, np.full(n, 1024.0)], axis=1))
    expected, expected_inverse = np.unique(whole, axis=0, return_inverse=True)
    assert shape == (100, 200)
    assert np.array_equal(rows, expected) and np.array_equal(inverse, expected_inverse.ravel())
