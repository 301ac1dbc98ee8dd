"""Request preparation: from a validated body to token ids and one ``SamplingParams`` per choice.

Owns: the checks of a body against the server's caps (:class:`~router.config.IngressConfig`) and
the unsupported options (:meth:`RequestPreparer.check_completion`,
:meth:`RequestPreparer.check_chat`); the chat template and tokenization, run off the event loop;
the checks of a prompt against the vocabulary and ``max_model_len``; and the fan-out plan
(:class:`Prepared`): choice ``prompt_index * n + j`` of a seeded request uses ``seed + j``.
Every refusal is an :class:`~router.protocol.OpenAIError` (4xx) naming the field.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import time
import uuid
from typing import Any

from replica.request import SamplingParams
from router.config import IngressConfig
from router.errors import sampling_error
from router.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _SamplingRequest


class Prepared:
    """A validated request: prompts as token ids and one SamplingParams per choice.

    Attributes:
        request_id: ``cmpl-<hex>`` or ``chatcmpl-<hex>``; choice ``i`` runs as ``<request_id>-<i>``.
        model: the served model name.
        prompts: each prompt's token ids.
        prompt_texts: each prompt's text (for ``echo``; ``""`` where not needed).
        params: ``params[prompt_index][j]``, the sampling parameters of each choice.
        created: Unix time (seconds) of the preparation.
    """

    def __init__(self, request_id: str, model: str, prompts: list[list[int]], prompt_texts: list[str], params: list[list[SamplingParams]]):
        self.request_id = request_id
        self.model = model
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.params = params  # params[prompt_index][j]
        self.created = int(time.time())

    def jobs(self) -> list[tuple[int, int, list[int], SamplingParams]]:
        """(choice index, prompt index, prompt ids, params); choice index = prompt_index * n + j."""
        out = []
        for p, (ids, per_prompt) in enumerate(zip(self.prompts, self.params)):
            for j, params in enumerate(per_prompt):
                out.append((p * len(per_prompt) + j, p, ids, params))
        return out

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the request, every prompt counted once (not once per choice)."""
        return sum(len(p) for p in self.prompts)


class RequestPreparer:
    """Checks bodies against the server's caps and turns them into :class:`Prepared` requests.

    Args:
        config: the caps (``max_n``, ``max_logprobs``, stop sequences, prompts, choices).
        tokenizer: the model's Hugging Face tokenizer (chat template, encode, decode).
        model_name: the served model name; a body naming another model gets 404.
    """

    def __init__(self, config: IngressConfig, tokenizer: Any, model_name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Characters of the longest token (byte-level BPE and SentencePiece pieces decode to at
        # most as many characters as their vocabulary strings have); see _check_prompt_chars.
        self._max_token_chars = max(1, max(len(t) for t in tokenizer.get_vocab()))

    # ---- checks before any replica is asked ------------------------------------------------------
    def check_completion(self, body: CompletionRequest) -> tuple[int, str]:
        """Check a ``/v1/completions`` body against the caps and the options supported.

        Returns:
            (choices, param): the replica requests it asks for (prompts x ``n``) and the field
            that names them in an error (``prompt`` for a list of prompts, else ``n``).
        Raises:
            OpenAIError: 404 for another model, 400 naming the field otherwise.
        """
        self._check_common(body)
        if body.suffix:
            raise OpenAIError("suffix is not supported", param="suffix", code="unsupported")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError("best_of other than n is not supported", param="best_of", code="unsupported")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs (prompt logprobs) is not supported", param="echo", code="unsupported")
        caps = self.config
        if len(body.prompt) > caps.max_prompts_per_request:
            raise OpenAIError(
                f"prompt: at most {caps.max_prompts_per_request} prompts per request, got {len(body.prompt)}",
                param="prompt", code="invalid_value",
            )
        fanout_param = "prompt" if len(body.prompt) > 1 else "n"
        self._check_fanout(len(body.prompt) * body.n, fanout_param)
        if body.logprobs is not None and body.logprobs > caps.max_logprobs:
            raise OpenAIError(f"logprobs: must be at most {caps.max_logprobs}, got {body.logprobs}", param="logprobs", code="invalid_value")
        return len(body.prompt) * body.n, fanout_param

    def check_chat(self, body: ChatCompletionRequest) -> tuple[int, str]:
        """Check a ``/v1/chat/completions`` body against the caps and the options supported.

        Returns:
            (choices, param): ``(n, "n")``, as :meth:`check_completion`.
        Raises:
            OpenAIError: 404 for another model, 400 naming the field otherwise.
        """
        self._check_common(body)
        if body.tools:
            raise OpenAIError("tools are not supported", param="tools", code="unsupported")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise OpenAIError("only response_format {'type': 'text'} is supported", param="response_format", code="unsupported")
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if body.top_logprobs is not None and body.top_logprobs > self.config.max_logprobs:
            raise OpenAIError(
                f"top_logprobs: must be at most {self.config.max_logprobs}, got {body.top_logprobs}",
                param="top_logprobs", code="invalid_value",
            )
        self._check_fanout(body.n, "n")
        return body.n, "n"

    def _check_common(self, body: _SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(f"The model `{body.model}` does not exist.", 404, param="model", code="model_not_found")
        if body.n > self.config.max_n:
            raise OpenAIError(f"n: must be at most {self.config.max_n}, got {body.n}", param="n", code="invalid_value")
        if body.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias", code="unsupported")
        if body.stream_options is not None and not body.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
        stops = body.stop or []
        if len(stops) > self.config.max_stop_sequences:
            raise OpenAIError(
                f"stop: at most {self.config.max_stop_sequences} stop sequences, got {len(stops)}",
                param="stop", code="invalid_value",
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.config.max_stop_sequence_length:
            raise OpenAIError(
                f"stop: a stop sequence has at most {self.config.max_stop_sequence_length} characters, got {longest}",
                param="stop", code="invalid_value",
            )

    def _check_fanout(self, choices: int, param: str) -> None:
        """Prompts × ``n`` (one replica request each) must not pass ``max_choices_per_request``."""
        if choices > self.config.max_choices_per_request:
            raise OpenAIError(
                f"{param}: the request asks for {choices} choices (prompts x n), at most "
                f"{self.config.max_choices_per_request} are allowed",
                param=param, code="invalid_value",
            )

    # ---- tokens and sampling parameters ----------------------------------------------------------
    async def completion(self, body: CompletionRequest, info: dict[str, Any]) -> Prepared:
        """Tokenize a checked ``/v1/completions`` body (text prompts in a worker thread) and plan
        its choices. ``info`` is the replicas' ``model_info()`` (``max_model_len``, ``vocab_size``).

        Raises:
            OpenAIError: 400 for a prompt that does not fit or cannot be tokenized, or for
                sampling parameters the engine refuses.
        """
        prompts, texts = [], []
        for i, p in enumerate(body.prompt):
            param = "prompt" if len(body.prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                self._check_prompt_chars(p, info, param)
                ids = await asyncio.to_thread(self._encode, p, param, True)
                texts.append(p)
            else:
                ids = list(p)
                texts.append(self.tokenizer.decode(ids) if body.echo else "")
            self._check_prompt(ids, info, param)
            prompts.append(ids)
        return self._prepare("cmpl", body, prompts, texts, body.max_tokens, body.logprobs, info)

    async def chat(self, body: ChatCompletionRequest, info: dict[str, Any]) -> Prepared:
        """Apply the chat template to a checked ``/v1/chat/completions`` body and tokenize it (in
        a worker thread), then plan its choices; ``info`` as in :meth:`completion`.

        Raises:
            OpenAIError: 400 as :meth:`completion`, or when the chat template fails.
        """
        ids = await asyncio.to_thread(self._apply_chat_template, body, info)
        self._check_prompt(ids, info, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return self._prepare("chatcmpl", body, [ids], [""], max_tokens, logprobs, info, param)

    def _check_prompt(self, ids: list[int], info: dict[str, Any], param: str) -> None:
        vocab = info["vocab_size"]
        for t in ids:
            if not 0 <= t < vocab:
                raise OpenAIError(f"{param}: token id {t} is outside the vocabulary [0, {vocab})", param=param, code="invalid_value")
        if len(ids) >= info["max_model_len"]:
            raise OpenAIError(
                f"{param}: this model's maximum context length is {info['max_model_len']} tokens; the prompt "
                f"has {len(ids)} tokens, which leaves no room for output. Please shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def _check_prompt_chars(self, text: str, info: dict[str, Any], param: str) -> None:
        """Refuse, without tokenizing it, a text that must be longer than ``max_model_len`` tokens:
        no token decodes to more than ``self._max_token_chars`` characters, so a text of more than
        ``max_model_len × _max_token_chars`` characters has more than ``max_model_len`` tokens.
        Keeps a client's megabytes of prompt from holding the tokenizer for seconds."""
        limit = info["max_model_len"] * self._max_token_chars
        if len(text) > limit:
            raise OpenAIError(
                f"{param}: {len(text)} characters are more than the {info['max_model_len']} tokens "
                f"this model accepts can hold (at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def _apply_chat_template(self, body: ChatCompletionRequest, info: dict[str, Any]) -> list[int]:
        """Render the model's chat template over ``body.messages`` and tokenize; runs in a worker
        thread (``asyncio.to_thread``) so that the event loop keeps serving other requests.

        Raises:
            OpenAIError: 400 if the client sends its own ``chat_template`` (a template is code:
                the server runs only the model's), the template fails, or the text is too long.
        """
        kwargs = dict(body.chat_template_kwargs or {})
        if "chat_template" in kwargs:
            raise OpenAIError(
                "chat_template_kwargs.chat_template is not accepted: the server applies the model's own chat template",
                param="chat_template_kwargs", code="unsupported",
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for m in messages:
            m.setdefault("content", "")
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, str):
                self._check_prompt_chars(content, info, f"messages.{i}.content")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # jinja errors, e.g. a role the template rejects
            raise OpenAIError(f"messages: the chat template failed: {exc}", param="messages", code="invalid_value") from None
        self._check_prompt_chars(text, info, "messages")
        return self._encode(text, "messages", add_special_tokens=False)

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Tokenize, turning a text the tokenizer refuses (e.g. a lone UTF-16 surrogate) into a 400."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:
            raise OpenAIError(f"{param}: the text cannot be tokenized: {exc}", param=param, code="invalid_value") from None

    def _prepare(
        self,
        kind: str,
        body: _SamplingRequest,
        prompts: list[list[int]],
        texts: list[str],
        max_tokens: int | None,
        logprobs: int | None,
        info: dict[str, Any],
        max_tokens_param: str = "max_tokens",
    ) -> Prepared:
        limit = info["max_model_len"]
        params: list[list[SamplingParams]] = []
        for i, ids in enumerate(prompts):
            room = limit - len(ids)
            if max_tokens is None:
                tokens = room
            elif len(ids) + max_tokens > limit:
                raise OpenAIError(
                    f"{max_tokens_param}: this model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                    f"completion). Please reduce the prompt or {max_tokens_param}.",
                    param=max_tokens_param,
                    code="context_length_exceeded",
                )
            else:
                tokens = max_tokens
            per_prompt = []
            for j in range(body.n):
                try:
                    per_prompt.append(
                        SamplingParams(
                            n=1,
                            max_tokens=tokens,
                            min_tokens=min(body.min_tokens, tokens),
                            temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            top_k=0 if body.top_k is None else body.top_k,
                            min_p=0.0 if body.min_p is None else body.min_p,
                            presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0,
                            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                            seed=None if body.seed is None else body.seed + j,
                            stop=list(body.stop or []),
                            stop_token_ids=list(body.stop_token_ids or []),
                            ignore_eos=body.ignore_eos,
                            logprobs=logprobs,
                            include_stop_str_in_output=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens,
                        )
                    )
                except ValueError as exc:
                    raise sampling_error(exc) from None
            params.append(per_prompt)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        return Prepared(request_id, self.model_name, prompts, texts, params)
