"""Quantized weights: blocks packed for Carpool's CPU kernels and routed through them
(:mod:`replica.quant.blocks`), GGUF's block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) read as
ggml writes them (:mod:`replica.quant.gguf_blocks`), a model's linear layers computed from its
GGUF file's blocks (:mod:`replica.quant.gguf_weights`) and a full-precision model's quantized at
load (:mod:`replica.quant.online`)."""
