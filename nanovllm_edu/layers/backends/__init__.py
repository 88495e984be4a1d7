"""nanovllm_edu.layers.backends: paged attention behind one interface (base and torch from notebook 04;
Triton, flash-attn and the backend registry from notebook 05)."""
