"""The engine: the step loop (``LLMEngine``), its asyncio wrapper, the offline ``LLM``, the detokenizer
and the engine's metrics."""
