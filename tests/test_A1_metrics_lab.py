"""Appendix A1: the reading-a-Prometheus-histogram lab checker passes PromQL's rules (the package's
`histogram_quantile`) and names the right check for realistic broken readings of cumulative buckets."""
import math

import pytest
from lab_helpers import failed_names

pytest.importorskip("prometheus_client")

from nanovllm_edu.labs import check_histogram_quantile
from nanovllm_edu.labs.metrics_checks import buckets_of, histogram_quantile

INSIDE = "a rank inside a bucket is interpolated"
CUMULATIVE = "the counts are cumulative"
FIRST = "the first bucket starts at 0"
INF = "a rank in the +Inf bucket"
EMPTY = "an empty histogram"
CLIENT = "a histogram prometheus_client wrote"


def test_the_package_passes():
    report = check_histogram_quantile(histogram_quantile)
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [INSIDE, CUMULATIVE, FIRST, INF, EMPTY, CLIENT]


def test_histogram_quantile_follows_promql():
    """Values worked by hand with PromQL's bucketQuantile rules."""
    buckets = [(0.1, 2), (0.5, 8), (1.0, 8), (math.inf, 8)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * 2 / 6)
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.1)
    assert histogram_quantile([(0.1, 2), (0.5, 5), (math.inf, 10)], 0.9) == 0.5
    assert math.isnan(histogram_quantile([(0.1, 0), (math.inf, 0)], 0.5))
    assert math.isnan(histogram_quantile([(0.1, 3), (0.5, 3)], 0.5))  # no +Inf bucket


def test_buckets_are_read_from_a_scrape_by_name_and_labels():
    scrape = ('# TYPE x_seconds histogram\n'
              'x_seconds_bucket{le="0.1",model_name="a"} 1.0\nx_seconds_bucket{le="+Inf",model_name="a"} 3.0\n'
              'x_seconds_bucket{le="0.1",model_name="b"} 5.0\nx_seconds_bucket{le="+Inf",model_name="b"} 5.0\n'
              'x_seconds_count{model_name="a"} 3.0\nx_seconds_sum{model_name="a"} 1.0\n')
    assert buckets_of(scrape, "x_seconds", {"model_name": "a"}) == [(0.1, 1.0), (math.inf, 3.0)]
    with pytest.raises(KeyError):
        buckets_of(scrape, "y_seconds")


# --- a learner's reading, with one decision swapped for a broken one ---------------------------------

def learner(cumulative=True, lower_for_first=0.0, inf_answer="bound", empty=math.nan, interpolate=True):
    def quantile(buckets, q):
        if not cumulative:  # reads each count as its own bucket's
            running, total = [], 0
            for le, count in buckets:
                total += count
                running.append((le, total))
            buckets = running
        if buckets[-1][1] == 0:
            return empty
        rank, below, lower = q * buckets[-1][1], 0, None
        for i, (le, count) in enumerate(buckets):
            if count >= rank:
                if le == math.inf:
                    return buckets[i - 1][0] if inf_answer == "bound" else math.inf
                if not interpolate:
                    return le
                lower = buckets[i - 1][0] if i else (le if lower_for_first is None else lower_for_first)
                return lower + (le - lower) * (rank - below) / (count - below)
            below = count
    return quantile


def test_a_learner_reading_passes():
    assert check_histogram_quantile(learner()).passed


def test_the_bucket_bound_alone_fails_interpolation():
    report = check_histogram_quantile(learner(interpolate=False))
    assert INSIDE in failed_names(report) and EMPTY not in failed_names(report), str(report)


def test_counts_read_per_bucket_fail_the_cumulative_check():
    report = check_histogram_quantile(learner(cumulative=False))
    assert {INSIDE, CUMULATIVE, CLIENT} <= failed_names(report), str(report)


def test_interpolating_from_the_first_bound_fails_the_first_bucket_check():
    report = check_histogram_quantile(learner(lower_for_first=None))
    assert failed_names(report) == {FIRST}, str(report)


def test_infinity_for_the_top_bucket_fails():
    report = check_histogram_quantile(learner(inf_answer="inf"))
    assert failed_names(report) == {INF}, str(report)


def test_zero_for_an_empty_histogram_fails():
    report = check_histogram_quantile(learner(empty=0.0))
    assert failed_names(report) == {EMPTY}, str(report)
