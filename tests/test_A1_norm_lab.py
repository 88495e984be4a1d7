"""Appendix A1: the RMSNorm checker passes notebook 16's rms_norm_triton and notebook 02's eager functions, and names
the right check for broken ones (the gain applied before rounding, the residual sum left in float32, statistics in
bf16, a residual written in place)."""
import pytest
import torch

import nanovllm_edu  # noqa: F401  (before triton: sets TRITON_INTERPRET=1 when there is no CUDA GPU)

pytest.importorskip("triton")

from nanovllm_edu.kernels.pdl_chain import rms_norm_triton
from nanovllm_edu.labs import check_rms_norm
from nanovllm_edu.labs.report import LabReport
from nanovllm_edu.layers.layernorm import add_rms_norm, rms_norm

BITS, RESIDUAL, INPUTS = ("notebook 02's bits in bf16, any width",
                          "the residual add: (rms_norm(x + residual), x + residual)", "inputs are left unchanged")


def failed(report: LabReport) -> set[str]:
    return {c.name for c in report.failed}


def eager(x, weight, eps, residual=None):
    """Notebook 02's functions as written: the reference passes its own checks."""
    if residual is None:
        return rms_norm(x, weight, eps)
    return add_rms_norm(x, residual, weight, eps)


def test_the_kernel_and_notebook_02s_functions_pass():
    for norm in (rms_norm_triton, eager):
        report = check_rms_norm(norm)
        assert report.passed, str(report)
        assert len(report.checks) == 3


def test_the_gain_before_the_rounding_fails_the_bits_check_and_says_so():
    def rounded_once(x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        return out if residual is None else (out, x)
    report = check_rms_norm(rounded_once)
    assert BITS in failed(report) and "gain applied before rounding" in report.failed[0].detail


def test_a_float32_residual_sum_fails_the_residual_check_and_says_so():
    def float32_sum(x, weight, eps, residual=None):
        if residual is None:
            return eager(x, weight, eps)
        total = x.float() + residual.float()
        return rms_norm(total, weight.float(), eps).to(x.dtype), total.to(x.dtype)
    report = check_rms_norm(float32_sum)
    assert failed(report) == {RESIDUAL} and "round x + residual to bf16 first" in report.failed[0].detail


def test_statistics_in_bf16_fail_the_bits_check():
    def bf16_statistics(x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        out = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # all in bf16
        return out if residual is None else (out, x)
    assert BITS in failed(check_rms_norm(bf16_statistics))


def test_a_residual_written_in_place_fails_the_inputs_check():
    def in_place(x, weight, eps, residual=None):
        if residual is None:
            return rms_norm_triton(x, weight, eps)
        out, new_residual = rms_norm_triton(x, weight, eps, residual)
        residual.copy_(new_residual)
        return out, residual
    assert failed(check_rms_norm(in_place)) == {INPUTS}
