"""The fast tier's few cases of a parametrized test (README's Tests). Every case runs in the whole suite; the few
kept here also run in `pytest -m "not slow"`, the day-to-day loop: one case per code path they cover (a variant, a
shape class, a flag), the others differing in values, not in the lines they run."""

import pytest


def fast_few(cases, keep, unpack=False):
    """`cases` for @pytest.mark.parametrize with every case not in `keep` marked slow. unpack: each case is a tuple
    of several arguments (the parametrize names more than one)."""
    missing = [k for k in keep if k not in cases]
    assert not missing, f"fast_few keeps cases that are not parametrized: {missing}"
    out = []
    for case in cases:
        values = tuple(case) if unpack else (case,)
        out.append(pytest.param(*values, marks=() if case in keep else pytest.mark.slow))
    return out
