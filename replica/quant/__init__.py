"""Quantized weights: GGUF's Q4_0, Q4_1 and Q8_0 blocks packed for Carpool's CPU kernels and
routed through them (:mod:`replica.quant.blocks`), and a model's linear layers computed from its
GGUF file's blocks (:mod:`replica.quant.gguf_weights`)."""
