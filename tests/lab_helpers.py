"""What the lab tests (test_A1_*) share. Imports nothing: a test module imports it before the package, and the
package must be first to set Triton's interpreter mode (nanovllm_edu.utils.device) on a CPU."""


def failed_names(report) -> set[str]:
    """The names of the checks a lab's `LabReport` failed."""
    return {c.name for c in report.failed}
