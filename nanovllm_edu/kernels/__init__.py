"""nanovllm_edu.kernels (modules exported from the course notebooks)."""
