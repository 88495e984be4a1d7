"""nanovllm_edu.utils (modules exported from the course notebooks)."""
