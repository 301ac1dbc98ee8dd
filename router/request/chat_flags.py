"""Chat continuation: vLLM's ``add_generation_prompt``, ``continue_final_message`` and ``echo``.

The rules, as vLLM's chat completions apply them (``vllm/entrypoints/openai/serving_chat.py`` and
its ``ChatCompletionRequest.check_generation_prompt``), with transformers' ``apply_chat_template``
rendering the prompt:

* ``chat_template_kwargs`` may set ``add_generation_prompt`` and ``continue_final_message`` too;
  vLLM merges them over the body's fields, so theirs win. Each must be a boolean.
* ``add_generation_prompt`` (default true) ends the prompt with the template's header of a new
  assistant turn; ``continue_final_message`` (default false) leaves the last message open, so that
  the reply continues its text (whatever its role). Both true is refused: vLLM's validator refuses
  the pair sent explicitly, and transformers refuses it when ``add_generation_prompt`` is left at
  its default, so ``continue_final_message`` needs ``add_generation_prompt: false``.
* The reply's role is ``assistant`` with a generation prompt, else the last message's role
  (vLLM's ``get_chat_request_role``).
* ``echo`` returns the last message's content before the reply's text when that message has the
  reply's role (a prefilled assistant turn): in the body's ``message.content``, and, streamed, as
  each choice's first content delta right after its role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.request.protocol import ChatCompletionRequest, OpenAIError

_FLAGS = ("add_generation_prompt", "continue_final_message")


@dataclass(frozen=True)
class ChatFlags:
    """How a chat body is rendered and answered.

    Attributes:
        add_generation_prompt: render the template's header of a new assistant turn at the end.
        continue_final_message: leave the last message open (its text continues).
        role: the reply's ``role``.
        echo_text: the text ``echo`` puts before each choice's reply (``""``: none).
    """

    add_generation_prompt: bool
    continue_final_message: bool
    role: str
    echo_text: str


def chat_flags(body: ChatCompletionRequest) -> ChatFlags:
    """The rendering flags, reply role and echoed text of a chat body (see the module's rules).

    Raises:
        OpenAIError: 400 (``chat_template_kwargs.<flag>``) for a flag there that is not a
            boolean; 400 (``continue_final_message``) when both flags are true.
    """
    kwargs = body.chat_template_kwargs or {}
    flags = {name: getattr(body, name) for name in _FLAGS}
    for name in _FLAGS:
        if name in kwargs:
            if not isinstance(kwargs[name], bool):
                raise OpenAIError(
                    f"chat_template_kwargs.{name}: must be a boolean, got {type(kwargs[name]).__name__}",
                    param=f"chat_template_kwargs.{name}", code="invalid_type",
                )
            flags[name] = kwargs[name]
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt cannot both be true: the first continues the last "
            "message, the second starts a new assistant turn; send add_generation_prompt: false with "
            "continue_final_message: true (add_generation_prompt is true unless sent false)",
            param="continue_final_message", code="invalid_value",
        )
    last = body.messages[-1]
    role = "assistant" if flags["add_generation_prompt"] else last.role
    echo_text = (last.content or "") if body.echo and last.role == role else ""
    return ChatFlags(flags["add_generation_prompt"], flags["continue_final_message"], role, echo_text)


def template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The client's ``chat_template_kwargs`` less the two flags, which :func:`chat_flags` has
    taken (they reach the template as the render's own arguments)."""
    return {k: v for k, v in kwargs.items() if k not in _FLAGS}
