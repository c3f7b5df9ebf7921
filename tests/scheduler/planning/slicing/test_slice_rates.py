import pytest

from scheduler.planning.slicing.rates import SliceRates


@pytest.mark.parametrize("rates", [(-0.1, 0.6, 0.5), (0.5, 0.6, 0.0), (0.2, 0.2, 0.2), (1.5, 0.0, -0.5)])
def test_rates_outside_the_simplex_are_refused(rates):
    with pytest.raises(ValueError, match="slice rate"):
        SliceRates(*rates)


@pytest.mark.parametrize("num_units,align", [(100, 32), (1536, 64), (8, 1), (7, 1), (0, 32)])
@pytest.mark.parametrize("rates", [(0.3, 0.7, 0.0), (0.25, 0.25, 0.5), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0),
                                   (0.0, 1.0, 0.0), (0.5, 0.0, 0.5), (0.1, 0.2, 0.7)])
def test_counts_cover_every_unit_aligned_and_only_where_planned(rates, num_units, align):
    sliced = SliceRates(*rates)
    counts = sliced.counts(num_units, align)
    assert sum(counts) == num_units and min(counts) >= 0
    for count, rate in zip(counts, rates):
        if rate == 0.0:
            assert count == 0
    last = max(i for i, rate in enumerate(rates) if rate > 0)
    assert all(count % align == 0 for i, count in enumerate(counts) if i != last)
    for count, rate in zip(counts, rates):
        assert abs(count - rate * num_units) <= align


def test_bad_counts_arguments_are_refused():
    with pytest.raises(ValueError, match="align"):
        SliceRates.resident().counts(10, 0)
