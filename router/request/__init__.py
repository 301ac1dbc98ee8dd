"""The request path: the OpenAI request bodies and error shape (``protocol.py``), error responses and
the checks before routing (``errors.py``: API key, body size), a body's checks against the caps
(``body_checks.py``), the chat template and the tool template (``chat_template.py``,
``tool_templates.py``, ``templates/``), output constraints and tool plans (``structured.py``), and
preparing a request for the replicas: tokens, limits, ``SamplingParams`` per choice
(``preparation.py``)."""
