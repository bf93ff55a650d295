"""`conftest.covering`: the parameter grids CI runs in part (the rest marked slow)."""

import itertools

import pytest
from conftest import covering


@pytest.mark.parametrize("strength", [1, 2])
def test_the_kept_combinations_cover_every_value_or_pair(strength):
    axes = (["float32", "bfloat16"], [1, 7, 64, 10_000], [1, 4, 16])
    params = covering(*axes, strength=strength)
    assert [p.values for p in params] == list(itertools.product(*axes))  # the whole grid, in order
    kept = [p.values for p in params if not p.marks]
    slow = [p.values for p in params if p.marks]
    assert all(m.name == "slow" for p in params for m in p.marks)
    for ix in itertools.combinations(range(len(axes)), strength):
        for values in itertools.product(*(axes[i] for i in ix)):
            assert any(tuple(c[i] for i in ix) == values for c in kept), (ix, values)
    assert len(kept) == (4 if strength == 1 else 12) and len(slow) == 24 - len(kept)
    assert [p.values for p in covering(*axes, strength=strength) if not p.marks] == kept  # deterministic
    assert [p.values for p in covering([True, False], ["a", "b"], strength=1) if not p.marks] == [
        (True, "a"),
        (False, "b"),
    ]
