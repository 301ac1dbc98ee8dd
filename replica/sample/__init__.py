"""Sampling: the sampler, its logits processors, logprobs and structured-output grammar masks."""
