"""Chat continuation flags (router/request/chat_flags.py) against transformers' own template, with
the real SmolLM2 tokenizer: for every combination of ``add_generation_prompt`` and
``continue_final_message`` (omitted, true, false; in the body or in ``chat_template_kwargs``) after
a user or an assistant turn, the router's prompt is what ``apply_chat_template`` renders with the
same flags, and the router refuses exactly the combinations transformers refuses (which vLLM
answers with a 400)."""

from __future__ import annotations

import itertools

import pytest

from router.config import IngressConfig
from router.request.body_checks import BodyChecks
from router.request.chat_flags import chat_flags
from router.request.preparation import RequestPreparer
from router.request.protocol import ChatCompletionRequest, OpenAIError

INFO = {"max_model_len": 2048, "vocab_size": 49152, "block_size": 16}
USER_LAST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
ASSISTANT_LAST = [*USER_LAST, {"role": "assistant", "content": "My favourite fruit is"}]
SETTINGS = [None, True, False]  # omitted, true, false


def _cases():
    for messages, gen, cont, where in itertools.product((USER_LAST, ASSISTANT_LAST), SETTINGS, SETTINGS, ("body", "kwargs")):
        flags = {k: v for k, v in (("add_generation_prompt", gen), ("continue_final_message", cont)) if v is not None}
        body = dict(flags) if where == "body" else {"chat_template_kwargs": flags}
        yield pytest.param(messages, body, gen, cont, id=f"{messages[-1]['role']}-gen={gen}-cont={cont}-{where}")


@pytest.mark.parametrize("messages,body,gen,cont", list(_cases()))
def test_prompt_equals_transformers_or_both_refuse(smollm2_tokenizer, messages, body, gen, cont):
    tok = smollm2_tokenizer
    effective = {"add_generation_prompt": True if gen is None else gen, "continue_final_message": bool(cont)}
    request = ChatCompletionRequest(model="m", messages=messages, **body)
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **effective)
    except ValueError:  # transformers refuses the pair: so must the router, naming the field
        with pytest.raises(OpenAIError) as err:
            BodyChecks(IngressConfig()).check_chat(request)
        assert err.value.status_code == 400 and err.value.param == "continue_final_message"
        return
    BodyChecks(IngressConfig()).check_chat(request)
    ids = RequestPreparer(IngressConfig(), tok, "m")._apply_chat_template(request, INFO)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids).endswith(messages[-1]["content"]) == effective["continue_final_message"]


@pytest.mark.parametrize(
    "messages,body,role,echo",
    [
        (ASSISTANT_LAST, {}, "assistant", "My favourite fruit is"),  # a new turn after a prefill echoes it too (vLLM)
        (ASSISTANT_LAST, {"add_generation_prompt": False, "continue_final_message": True}, "assistant", "My favourite fruit is"),
        (USER_LAST, {}, "assistant", ""),  # the last turn is not the reply's role: nothing to echo
        (USER_LAST, {"add_generation_prompt": False}, "user", "Name a fruit."),
        (USER_LAST, {"chat_template_kwargs": {"add_generation_prompt": False}}, "user", "Name a fruit."),
    ],
)
def test_reply_role_and_echoed_text(messages, body, role, echo):
    with_echo = chat_flags(ChatCompletionRequest(model="m", messages=messages, echo=True, **body))
    assert (with_echo.role, with_echo.echo_text) == (role, echo)
    assert chat_flags(ChatCompletionRequest(model="m", messages=messages, **body)).echo_text == ""


def test_a_flag_in_template_kwargs_must_be_a_boolean():
    request = ChatCompletionRequest(model="m", messages=USER_LAST, chat_template_kwargs={"add_generation_prompt": "no"})
    with pytest.raises(OpenAIError) as err:
        chat_flags(request)
    assert err.value.param == "chat_template_kwargs.add_generation_prompt"
