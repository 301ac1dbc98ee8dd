"""OpenAI's Responses API (``/v1/responses``) over the chat path, and the store of its responses
(docs/responses.md)."""
