"""The response path: OpenAI response bodies and server-sent events (``responses.py``), logprobs in
the API's shape (``logprob_format.py``) and tool calls read out of a reply, whole or streamed
(``tool_calls.py``)."""
