"""nanovllm_edu.models (modules exported from the course notebooks)."""
