"""Which chat template renders a chat that involves tools, and which parser reads the calls.

A chat involves tools when it sends ``tools`` (with a ``tool_choice`` other than ``none``) or
holds earlier calls (an assistant message's ``tool_calls``, which its results follow). It is
rendered, in this order of preference, with:

1. the template file given by ``--tool-chat-template`` (vLLM's ``--chat-template`` for tools);
2. the model's own template, when it reads the ``tools`` variable (Qwen 2.5, Llama 3.1, Hermes...);
3. Carpool's ChatML tool template (``router/request/templates/chatml_tools.jinja``) for a ChatML model
   whose template ignores tools, such as the default SmolLM2: tools listed in the system turn,
   calls written as ``<tool_call>`` blocks, results in ``<tool_response>`` blocks;

otherwise the request is refused (400 on ``tools``) rather than silently dropping the tools.
Chats without tools always get the model's own template, unchanged.
"""

# No "from __future__ import annotations", as in router/ingress.py.

from pathlib import Path
from typing import Any

from router.config import PARSER_NAMES  # noqa: F401  (re-exported: the parsers this module reads)
from router.request.protocol import OpenAIError

CHATML_TOOLS = Path(__file__).parent / "templates" / "chatml_tools.jinja"


class ToolTemplates:
    """The tool template and parser of one model.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its ``chat_template``).
        template_path: a Jinja chat template file that renders tools, or None.
        parser: one of :data:`PARSER_NAMES`.
    Raises:
        ValueError: an unknown parser; OSError: an unreadable template file.
    """

    def __init__(self, tokenizer: Any, template_path: str | None = None, parser: str = "auto") -> None:
        if parser not in PARSER_NAMES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {parser!r}")
        own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.model_renders_tools = "tools" in own
        if template_path:
            self.template: str | None = Path(template_path).read_text()
        elif not self.model_renders_tools and "<|im_start|>" in own:
            self.template = CHATML_TOOLS.read_text()
        else:
            self.template = None
        self.parser = "hermes" if parser == "auto" else parser

    def template_for(self, messages: list[dict[str, Any]], has_tools: bool) -> str | None:
        """The template text to render ``messages`` with, or None for the model's own.

        Raises:
            OpenAIError: 400 on ``tools`` when the chat involves tools and no template renders them.
        """
        involves = has_tools or any(m.get("tool_calls") for m in messages)
        if not involves or (self.template is None and self.model_renders_tools):
            return None
        if self.template is None:
            raise OpenAIError(
                "tools: this model's chat template does not render tools; start the server with "
                "--tool-chat-template <a Jinja template that does>", param="tools", code="unsupported",
            )
        return self.template
