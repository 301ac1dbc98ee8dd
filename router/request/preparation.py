"""Request preparation: from a checked body (:mod:`router.request.body_checks`) to token ids and one
``SamplingParams`` per choice.

Owns: the chat template and tokenization, run off the event loop; calling the request rules
(:mod:`replica.protocol.request_checks`, the engine's own: token ids inside the vocabulary, a
prompt that fits ``max_model_len``) where the request is built; the limits of ``max_tokens`` and
``min_tokens`` (the defaults are ``SamplingParams``'); and the fan-out plan (:class:`Prepared`,
one :class:`~replica.protocol.envelope.RequestEnvelope` per choice): choice ``prompt_index * n + j``
of a seeded request uses ``seed + j``. Every refusal is an
:class:`~router.request.protocol.OpenAIError` (4xx) naming the field.
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import contextvars
import functools
import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from replica.protocol.envelope import RequestEnvelope, RoutingHints
from replica.protocol.errors import RequestError
from replica.protocol.lora_request import LoRARequest
from replica.protocol.request_checks import check_priority, check_prompt_fits, check_token_ids, check_vocabulary
from replica.protocol.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams, scores_prompt_only
from replica.protocol.slo import LatencyTargets
from router.config import IngressConfig
from router.request.body_checks import check_generates, parse_logit_bias
from router.request.chat_flags import chat_flags, template_variables
from router.request.chat_template import ChatEncoder
from router.request.errors import request_error, sampling_error
from router.request.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _SamplingRequest
from router.request.structured import ToolPlan, chat_constraints, constrained, constraint_of
from router.request.tool_templates import ToolTemplates

CONSTRAINT_THREADS = 2  # threads that check constraints, apart from tokenization's (see RequestPreparer)
# Names transformers' apply_chat_template and its template rendering take themselves: a
# chat_template_kwargs key among them would set the server's own arguments or clash with them.
_RENDER_ARGUMENTS = {"self", "messages", "conversations", "compiled_template"}


def _renders(apply: Any, chat: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> bool:
    """Whether ``apply(chat, template_kwargs)`` renders without an error."""
    try:
        apply(chat, template_kwargs)
    except Exception:
        return False
    return True


class Prepared:
    """A validated request: prompts as token ids and one SamplingParams per choice.

    Attributes:
        request_id: ``cmpl-<hex>`` or ``chatcmpl-<hex>``; choice ``i`` runs as ``<request_id>-<i>``.
        model: the served model name.
        prompts: each prompt's token ids.
        prompt_texts: each prompt's text (for ``echo``; ``""`` where not needed).
        params: ``params[prompt_index][j]``, the sampling parameters of each choice.
        created: Unix time (seconds) of the preparation.
        tool_plan: how a chat request uses its tools (:class:`~router.request.structured.ToolPlan`), or None.
        tool_parser: the format tool calls are parsed from in ``auto`` mode.
        lora_request: the LoRA adapter every choice runs with (the request's ``model`` named
            one; ``model`` is then the adapter's name), or None for the base model.
        block_size: tokens per KV block of the replicas (the routing hints' prefix hashes).
        priority: every choice's scheduling priority (vLLM's: lower runs first; 0 by default).
        slo: every choice's latency targets (``router/request/slo_headers.py``), or None.
        reply_role: a chat reply's ``role`` (:mod:`router.request.chat_flags`).
        echo_text: what ``echo`` puts before each chat choice's text (``""``: nothing).
        continuation: the prompt continues a conversation this cluster served (routing hints:
            :class:`~replica.protocol.envelope.RoutingHints`).
    """

    def __init__(
        self, request_id: str, model: str, prompts: list[list[int]], prompt_texts: list[str],
        params: list[list[SamplingParams]], block_size: int,
    ):
        self.request_id = request_id
        self.model = model
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.params = params  # params[prompt_index][j]
        self.block_size = block_size
        self.created = int(time.time())
        self.tool_plan: ToolPlan | None = None
        self.tool_parser = "hermes"
        self.lora_request: LoRARequest | None = None
        self.priority = 0
        self.slo: LatencyTargets | None = None
        self.reply_role = "assistant"
        self.echo_text = ""
        self.continuation = False
        self._routing: dict[int, RoutingHints] = {}  # per prompt index, computed on first use

    def envelope(self, index: int, prompt_index: int, params: SamplingParams) -> RequestEnvelope:
        """The replica request of choice ``index`` (of prompt ``prompt_index``, with ``params``):
        id ``<request_id>-<index>``, the request's adapter, and routing hints computed once per
        prompt (its ``n`` choices share them). The request passed the checks of preparation."""
        routing = self._routing.get(prompt_index)
        if routing is None:
            routing = self._routing[prompt_index] = RoutingHints.of(
                self.prompts[prompt_index], self.block_size, self.lora_request, self.continuation,
            )
        return RequestEnvelope(
            request_id=f"{self.request_id}-{index}", prompt_token_ids=self.prompts[prompt_index],
            sampling_params=params, routing=routing, lora_request=self.lora_request, priority=self.priority,
            slo=self.slo,
        )

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
    """Turns bodies checked by :class:`~router.request.body_checks.BodyChecks` into :class:`Prepared` requests.

    Args:
        config: the server's settings (the same :class:`~router.config.IngressConfig`).
        tokenizer: the model's Hugging Face tokenizer (chat template, encode, decode).
        model_name: the served model name (the responses carry it).
    """

    def __init__(self, config: IngressConfig, tokenizer: Any, model_name: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        # Characters of the longest token (byte-level BPE and SentencePiece pieces decode to at
        # most as many characters as their vocabulary strings have); see _check_prompt_chars.
        self._max_token_chars = max(1, max(len(t) for t in tokenizer.get_vocab()))
        self._chat_encoder = ChatEncoder(tokenizer)  # the client's text stays text (router/request/chat_template.py)
        self.tool_templates = ToolTemplates(tokenizer, config.tool_chat_template, config.tool_call_parser)
        # tools too: the request's own field, validated, decides them and the template used.
        own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs", "documents"}
        self._reserved_template_kwargs = own | _RENDER_ARGUMENTS
        # Compiling a constraint can take a second (a schema, regex or choice list of megabytes):
        # its own threads, so that it never holds up other requests' tokenization in the default pool.
        self._constraint_threads = ThreadPoolExecutor(CONSTRAINT_THREADS, thread_name_prefix="carpool-constraint")

    async def _in_constraint_thread(self, fn: Any, body: Any) -> Any:
        """``fn(body)`` in one of the constraint threads, with this task's context (as ``asyncio.to_thread``)."""
        call = functools.partial(contextvars.copy_context().run, fn, body)
        return await asyncio.get_running_loop().run_in_executor(self._constraint_threads, call)

    # ---- tokens and sampling parameters ----------------------------------------------------------
    async def completion(
        self, body: CompletionRequest, info: dict[str, Any], lora_request: LoRARequest | None = None
    ) -> Prepared:
        """Tokenize a checked ``/v1/completions`` body (text prompts in a worker thread) and plan
        its choices. ``info`` is the replicas' ``model_info()`` (``max_model_len``, ``vocab_size``,
        ``block_size``);
        ``lora_request`` the adapter the body's ``model`` names (None: the base model).

        Raises:
            OpenAIError: 400 for a prompt that does not fit or cannot be tokenized, or for
                sampling parameters the engine refuses.
        """
        check_generates(info, self.model_name)
        prompts, texts = [], []
        for i, p in enumerate(body.prompt):
            param = "prompt" if len(body.prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                self._check_prompt_chars(p, info, param)
                ids = await asyncio.to_thread(self._encode, p, param, True)
            else:
                ids = list(p)
            self._check_prompt(ids, info, param, scores_prompt_only(body.max_tokens))  # token ids before decoding them
            texts.append(p if isinstance(p, str) else self.tokenizer.decode(ids) if body.echo else "")
            prompts.append(ids)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # echo scores the prompt too
            prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
        default = max(DEFAULT_MAX_TOKENS, body.min_tokens)
        constraint = await self._in_constraint_thread(constraint_of, body) if constrained(body) else None
        return self._prepare(
            "cmpl", body, prompts, texts, body.max_tokens, default, body.logprobs, prompt_logprobs, info, constraint=constraint,
            lora_request=lora_request,
        )

    async def chat(
        self, body: ChatCompletionRequest, info: dict[str, Any], lora_request: LoRARequest | None = None
    ) -> Prepared:
        """Apply the chat template to a checked ``/v1/chat/completions`` body and tokenize it (in
        a worker thread), then plan its choices; ``info`` and ``lora_request`` as in :meth:`completion`.

        Raises:
            OpenAIError: 400 as :meth:`completion`, or when the chat template fails.
        """
        check_generates(info, self.model_name)
        plan, constraint = await self._in_constraint_thread(chat_constraints, body) if constrained(body) else (None, None)
        ids = await asyncio.to_thread(self._apply_chat_template, body, info, plan)
        self._check_prompt(ids, info, "messages", scores_only=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        default = info["max_model_len"]  # all the context leaves
        prepared = self._prepare(
            "chatcmpl", body, [ids], [""], max_tokens, default, logprobs, body.prompt_logprobs, info, param,
            constraint=constraint, lora_request=lora_request,
        )
        prepared.tool_plan, prepared.tool_parser = plan, self.tool_templates.parser
        flags = chat_flags(body)
        prepared.reply_role, prepared.echo_text = flags.role, flags.echo_text
        return prepared

    @staticmethod
    def _check_prompt(ids: list[int], info: dict[str, Any], param: str, scores_only: bool) -> None:
        """The request rules of :mod:`replica.protocol.request_checks` (the engine's own): token
        ids inside the vocabulary and a prompt that leaves room for output (``scores_only``: the
        request only scores it, so it may fill ``max_model_len``). Raises a 400 naming ``param``."""
        try:
            check_token_ids(param, ids, info["vocab_size"])
            check_prompt_fits(len(ids), info["max_model_len"], scores_only, param)
        except RequestError as exc:
            raise request_error(exc) from None

    def _check_prompt_chars(self, text: str, info: dict[str, Any], param: str) -> None:
        """Refuse, without tokenizing it, a text that must be longer than ``max_model_len`` tokens:
        no token decodes to more than ``self._max_token_chars`` characters, so a text of more than
        ``max_model_len × _max_token_chars`` characters has more than ``max_model_len`` tokens.
        Keeps a client's megabytes of prompt from holding the tokenizer for seconds."""
        limit = info["max_model_len"] * self._max_token_chars
        if len(text) > limit:
            raise OpenAIError(
                f"{param}: {len(text)} characters cannot fit in this model's {info['max_model_len']} tokens "
                f"(no text of more than {limit} characters can)",
                param=param,
                code="context_length_exceeded",
            )

    def _apply_chat_template(self, body: ChatCompletionRequest, info: dict[str, Any], plan: ToolPlan | None = None) -> list[int]:
        """Render the model's chat template over ``body.messages`` and tokenize; runs in a worker
        thread (``asyncio.to_thread``) so that the event loop keeps serving other requests.

        Raises:
            OpenAIError: 400 if the client sends its own ``chat_template`` (a template is code:
                the server runs only the model's) or a ``chat_template_kwargs`` key that
                ``apply_chat_template`` or the rendering takes itself, the template fails, the text is too long, or
                it holds control-token text the template cannot keep as plain text.
        """
        flags = chat_flags(body)
        kwargs = template_variables(body.chat_template_kwargs or {})
        if "chat_template" in kwargs:
            raise OpenAIError(
                "chat_template_kwargs.chat_template is not accepted: the server applies the model's own chat template",
                param="chat_template_kwargs", code="unsupported",
            )
        if clash := sorted(self._reserved_template_kwargs & kwargs.keys()):
            raise OpenAIError(
                f"chat_template_kwargs.{clash[0]} is not accepted: the server sets it (use the request's own fields, "
                "such as tools)",
                param="chat_template_kwargs", code="invalid_value",
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for m in messages:
            m.setdefault("content", "")
        if plan is not None and plan.tools:
            kwargs["tools"] = plan.tools  # a template variable: the client's strings in it stay text too
        # The model's template, or the tool template where the model's cannot render tools.
        template = {"chat_template": t} if (t := self.tool_templates.template_for(messages, "tools" in kwargs)) else {}
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, str):
                self._check_prompt_chars(content, info, f"messages.{i}.content")

        def apply(chat: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
            return self.tokenizer.apply_chat_template(
                chat,
                tokenize=False,
                add_generation_prompt=flags.add_generation_prompt,
                continue_final_message=flags.continue_final_message,
                **template,
                **template_kwargs,
            )

        def render(chat: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
            try:
                text = apply(chat, template_kwargs)
            except Exception as exc:  # jinja errors, e.g. a role the template rejects
                # Blame the client's template variables when the template renders without them.
                client = (body.chat_template_kwargs or {}).keys()
                param = "chat_template_kwargs" if client and _renders(apply, chat, {k: v for k, v in template_kwargs.items() if k not in client}) else "messages"
                raise OpenAIError(f"{param}: the chat template failed: {exc}", param=param, code="invalid_value") from None
            self._check_prompt_chars(text, info, "messages")
            return text

        # Control-token text in the client's strings is tokenized as plain text, never parsed.
        return self._chat_encoder.encode(messages, kwargs, render, lambda text: self._encode(text, "messages", add_special_tokens=False))

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
        default_max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        info: dict[str, Any],
        max_tokens_param: str = "max_tokens",
        constraint: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> Prepared:
        """One SamplingParams per choice. An omitted ``max_tokens`` is ``default_max_tokens`` capped
        at what the context leaves after the prompt; an explicit one must fit. ``min_tokens`` must
        fit under both (else 400 naming ``min_tokens``), ``stop_token_ids`` in the vocabulary, and a
        nonzero ``priority`` only where the replicas' ``scheduling_policy`` is ``"priority"``.
        With ``lora_request``, the request runs with that adapter and answers as its model."""
        limit = info["max_model_len"]
        logit_bias = parse_logit_bias(body.logit_bias)  # once, not once per choice
        try:
            check_vocabulary(logit_bias, body.stop_token_ids, info["vocab_size"])
            priority = check_priority(body.priority, info.get("scheduling_policy", "fcfs"))
        except RequestError as exc:
            raise request_error(exc) from None
        # The body's sampling fields it sets; SamplingParams holds the defaults of the others.
        given = {
            name: getattr(body, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids")
            if getattr(body, name) is not None
        }
        params: list[list[SamplingParams]] = []
        for i, ids in enumerate(prompts):
            room = limit - len(ids)
            if max_tokens is None:
                tokens = min(default_max_tokens, room)
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
            if body.min_tokens > tokens:
                bound = f"{max_tokens_param} ({tokens})" if max_tokens is not None else f"the {tokens} tokens the context leaves after the prompt"
                raise OpenAIError(f"min_tokens ({body.min_tokens}) exceeds {bound}", param="min_tokens", code="invalid_value")
            per_prompt = []
            for j in range(body.n):
                try:
                    per_prompt.append(
                        SamplingParams(
                            **given,
                            n=1,
                            max_tokens=tokens,
                            min_tokens=body.min_tokens,
                            seed=None if body.seed is None else body.seed + j,
                            ignore_eos=body.ignore_eos,
                            logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs,
                            include_stop_str_in_output=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens,
                            logit_bias=logit_bias,
                            structured_outputs=constraint,
                        )
                    )
                except ValueError as exc:
                    raise sampling_error(exc) from None
            params.append(per_prompt)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        model = self.model_name if lora_request is None else lora_request.lora_name
        prepared = Prepared(request_id, model, prompts, texts, params, info["block_size"])
        prepared.lora_request = lora_request
        prepared.priority = priority
        return prepared
