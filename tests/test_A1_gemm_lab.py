"""Appendix A1: the decode GEMM checker passes notebook 16's skinny_gemm and names the right check for broken
ones (gate and up swapped, the gate of the product, the last split dropped, rows past the first tile left out,
atomics-like run-to-run noise)."""
import pytest
import torch
import torch.nn.functional as F

import nanovllm_edu  # noqa: F401  (before triton: sets TRITON_INTERPRET=1 when there is no CUDA GPU)

pytest.importorskip("triton")

from nanovllm_edu.kernels.skinny_gemm import skinny_gemm
from nanovllm_edu.labs import check_skinny_gemm
from nanovllm_edu.labs.report import LabReport

PLAIN, GATED, SPLIT = "x @ w.T for any number of rows", "the gate: silu(x gate.T) * (x up.T)", \
    "K split in parts adds up to the whole"
BITS, INPUTS = "the same bits on every run", "inputs are left unchanged"


def failed(report: LabReport) -> set[str]:
    return {c.name for c in report.failed}


def torch_gemm(x, w, gated=False, splits=1):
    """A correct torch version: K in `splits` parts summed in order."""
    parts = [xp @ wp.T for xp, wp in zip(x.chunk(splits, dim=1), w.chunk(splits, dim=1))]
    out = sum(parts[1:], parts[0])
    if gated:
        gate, up = out.chunk(2, dim=-1)
        return F.silu(gate) * up
    return out


def test_ours_and_a_torch_version_pass():
    for gemm in (skinny_gemm, torch_gemm):
        report = check_skinny_gemm(gemm)
        assert report.passed, str(report)
        assert len(report.checks) == 5


def test_swapped_halves_fail_the_gate_check_and_say_so():
    def swapped(x, w, gated=False, splits=1):
        return torch_gemm(x, torch.cat(w.chunk(2)[::-1]) if gated else w, gated, splits)
    report = check_skinny_gemm(swapped)
    assert failed(report) == {GATED}
    assert "halves are swapped" in report.failed[0].detail


def test_gate_of_the_product_fails_the_gate_check_and_say_so():
    def product(x, w, gated=False, splits=1):
        out = torch_gemm(x, w, False, splits)
        if not gated:
            return out
        gate, up = out.chunk(2, dim=-1)
        return F.silu(gate * up)
    report = check_skinny_gemm(product)
    assert failed(report) == {GATED} and "silu(gate * up)" in report.failed[0].detail


def test_a_dropped_split_fails_the_split_check():
    def drops_last(x, w, gated=False, splits=1):
        if splits == 1:
            return torch_gemm(x, w, gated)
        parts = [xp @ wp.T for xp, wp in zip(x.chunk(splits, dim=1), w.chunk(splits, dim=1))]
        return sum(parts[1:-1], parts[0])
    assert SPLIT in failed(check_skinny_gemm(drops_last))


def test_rows_past_the_first_tile_fail_the_rows_check():
    def first_tile_only(x, w, gated=False, splits=1):
        out = torch_gemm(x, w, gated, splits)
        out[16:] = 0
        return out
    report = check_skinny_gemm(first_tile_only)
    assert PLAIN in failed(report) and "rows past the first tile are zero" in report.failed[0].detail


def test_run_to_run_noise_fails_the_bits_check():
    def noisy(x, w, gated=False, splits=1):
        out = torch_gemm(x, w, gated, splits)
        return out + torch.randn_like(out) * 1e-7 * out.abs() if splits > 1 else out
    assert failed(check_skinny_gemm(noisy)) == {BITS}


def test_writing_into_the_input_fails_the_inputs_check():
    def in_place(x, w, gated=False, splits=1):
        out = torch_gemm(x, w, gated, splits)
        x.mul_(1.0000001)
        return out
    assert INPUTS in failed(check_skinny_gemm(in_place))
