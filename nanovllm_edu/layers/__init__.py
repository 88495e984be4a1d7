"""nanovllm_edu.layers (modules exported from the course notebooks)."""
