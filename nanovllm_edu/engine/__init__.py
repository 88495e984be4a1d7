"""nanovllm_edu.engine (modules exported from the course notebooks)."""
