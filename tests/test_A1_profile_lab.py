"""Appendix A1: the reading-a-profile lab checker (floor ratios from notebook 20's decode-step records, with
notebook 19's roofline) passes the package's own computation and names the right check for realistic broken
readings."""
from lab_helpers import failed_names

from nanovllm_edu.labs import check_profile_floors
from nanovllm_edu.labs.profile_checks import floor_ratios, lab_inputs

KINDS = "a ratio for attention and for the GEMMs"
ATTENTION = "attention at batch 256: over its bytes' floor"
GEMM_1 = "GEMMs at batch 1: over the weights' bytes"
GEMM_256 = "GEMMs at batch 256: the larger of the two floors"
RATES = "the rates passed in"


def test_the_package_passes():
    report = check_profile_floors(floor_ratios)
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [KINDS, ATTENTION, GEMM_1, GEMM_256, RATES]
    assert report.stage == "reading a profile (20)"


def test_the_records_read_as_notebook_19_reads_them():
    """Attention at batch 256 is at its roof (notebook 19: 101% of it), the GEMMs above theirs."""
    records, shape, bandwidth, peak = lab_inputs()
    ratios = {batch: floor_ratios(record, shape, bandwidth, peak) for batch, record in records.items()}
    assert round(ratios[256]["attention"], 2) == 0.99 and 2 < ratios[256]["gemm"] < 3
    assert ratios[1]["attention"] > 5  # one sequence: attention far from its bytes' floor


# --- a learner's reading, with one decision swapped for a broken one ---------------------------------

def learner_ratios(floor=lambda flops, nbytes, peak, bandwidth: max(flops / peak, nbytes / bandwidth),
                   measured=lambda record, kind: record["by_category_us_per_step"][kind],
                   ratio=lambda us, floor_us: us / floor_us, rates=None):
    def ratios(record, shape, bandwidth, peak):
        bandwidth, peak = rates or (bandwidth, peak)
        tokens = record["batch"] * record["context_lens"]["mean"]
        weights = shape.linear_params + shape.vocab * shape.hidden
        work = {"attention": (4 * shape.num_heads * shape.head_dim * shape.num_layers * tokens,
                              tokens * shape.kv_bytes_per_token),
                "gemm": (2 * record["batch"] * weights, 2 * weights)}
        return {kind: ratio(measured(record, kind), 1e6 * floor(f, b, peak, bandwidth))
                for kind, (f, b) in work.items()}
    return ratios


def test_a_learner_reading_passes():
    assert check_profile_floors(learner_ratios()).passed


def test_an_inverted_ratio_fails_every_value():
    report = check_profile_floors(learner_ratios(ratio=lambda us, floor_us: floor_us / us))
    assert {ATTENTION, GEMM_1, GEMM_256} <= failed_names(report) and KINDS not in failed_names(report), str(report)
    assert "it is floor / measured" in str(report)


def test_summing_over_the_profiled_steps_fails_with_their_count():
    """Takes us_per_step for the time of all the profiled steps together: 20 of them at batch 256, 5 at batch 1."""
    report = check_profile_floors(learner_ratios(
        measured=lambda record, kind: record["by_category_us_per_step"][kind] * record["steps"]))
    assert {ATTENTION, GEMM_1, GEMM_256} <= failed_names(report), str(report)
    assert "20x too large" in str(report) and "5x too large" in str(report)


def test_peak_flops_for_a_memory_bound_kernel_fails_attention_and_small_gemms():
    """The floor from the FLOPs at peak alone: right only where the FLOPs take longer (the GEMMs at 256 rows)."""
    report = check_profile_floors(learner_ratios(floor=lambda flops, nbytes, peak, bandwidth: flops / peak))
    assert {ATTENTION, GEMM_1} <= failed_names(report) and GEMM_256 not in failed_names(report), str(report)
    assert "its floor is bytes / bandwidth" in str(report)


def test_the_bytes_alone_fail_the_full_batch_gemms():
    """The floor from the bytes alone, as for a memory-bound kernel: at 256 rows the GEMMs' FLOPs take longer."""
    report = check_profile_floors(learner_ratios(floor=lambda flops, nbytes, peak, bandwidth: nbytes / bandwidth))
    assert failed_names(report) == {GEMM_256}, str(report)
    assert "at 256 rows the FLOPs at peak take longer" in str(report)


def test_datasheet_rates_fail_the_rates_check():
    report = check_profile_floors(learner_ratios(rates=(4.8e12, 989e12)))
    assert RATES in failed_names(report), str(report)
