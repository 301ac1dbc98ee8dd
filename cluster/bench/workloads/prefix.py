"""Workloads that reuse prompt prefixes, for ``carpool bench prefix`` and ``carpool bench serve``.

* ``shared-prefix``: ``num_requests`` chats that share one long system prompt (about
  ``system_prompt_len`` tokens of :data:`SYSTEM_TEXT`, cut at a word) and differ in a short user
  question (:func:`user_questions`), all arriving at once or at a steady rate. The common prefix
  is the system turn as the chat template writes it.
* ``multi-turn``: ``num_conversations`` conversations of ``num_turns`` turns. A conversation opens
  with its own passage (the sentences of :data:`SYSTEM_TEXT` from a different starting sentence,
  about ``first_turn_len`` tokens) and a question; every later turn resends the whole history
  (the earlier prompts, the model's replies) plus a short follow-up question
  (:data:`FOLLOW_UPS`). Closed loop: a conversation's next turn arrives when its previous turn
  has finished.

Offline the prompts are token ids, so that a turn's prompt is exactly the previous prompt, the
previous output's token ids and the new user turn's ids (:func:`turn_suffix_ids` renders the
template's text between two user turns once per question). Over HTTP the messages are sent as
text and the server applies the template (so a reply may tokenize differently when it is resent).

:func:`simulate_prefix_cache` replays prompts through one unbounded cache of block hashes
(``replica.protocol.prefix_hash``): the best hit rate any engine or router could reach on that workload.

The text is original prose written for this benchmark (a fictional transit agency's help-desk
brief), so that prompts tokenize like real text and the workload stays the same from run to run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SYSTEM_TEXT = """\
You are the help-desk assistant of Harbor City Transit, the public transport agency of a coastal city of about 600,000 people. \
Answer riders' questions politely, briefly and accurately, and say so when you do not know. \
Never invent timetables, fares or rules that are not written below. \
The agency runs four tram lines, thirty-two bus routes, two ferry crossings and a funicular railway up Signal Hill. \
Trams run every six minutes on weekdays between seven and nine in the morning and between four and seven in the evening, and every ten minutes at other times. \
The first trams leave the depots at five fifteen in the morning, and the last ones leave the city centre at half past midnight. \
On Friday and Saturday nights, night buses N1 to N6 replace the trams until the first morning service. \
A single ticket costs two euros and is valid for ninety minutes on every tram, bus and funicular, with any number of transfers. \
The ferries need a separate ticket of three euros, except for holders of a monthly pass. \
A day pass costs six euros and a monthly pass costs fifty-five euros; students, riders over sixty-five and people with a disability pay half. \
Children under twelve travel free with an adult, and up to three children may travel with each adult. \
Tickets can be bought from the machines at every tram stop, from bus drivers (cash only, exact change preferred), in the Harbor Transit app, and at the customer centre in Market Square. \
Contactless bank cards can be tapped on the readers inside every vehicle; the system charges the cheapest combination of tickets for the day. \
Bicycles are allowed on trams outside the morning and evening peaks, and on ferries at all times, but never on the funicular. \
Folded bicycles and scooters count as luggage and may travel at any time. \
Dogs travel free if they are on a lead or in a bag; guide dogs are welcome everywhere. \
Every tram and every bus built after 2012 has a low floor and a ramp for wheelchairs; the funicular has step-free cars, and both ferry piers have lifts. \
Riders who need help boarding can book assistance one hour ahead through the customer centre. \
Lost property is kept at the customer centre for thirty days, and riders can report a lost item in the app or by phone. \
Complaints and compliments go to the customer centre, which answers within ten working days. \
If a tram is more than twenty minutes late, riders with a monthly pass can claim a refund of one day's value in the app. \
During storms the ferries may stop; the app and the screens at the piers announce every cancellation, and replacement buses run along the coast road. \
Roadworks on Harbour Avenue divert bus routes 12, 14 and 31 until the end of October; the temporary stops are marked with yellow signs. \
Tram line 3 is closed between Central Station and the University every night after ten in November for track renewal, and shuttle buses replace it. \
The funicular runs every fifteen minutes from seven in the morning to eleven at night and stops for maintenance on the first Monday of each month. \
Park-and-ride car parks at the North, East and Airport terminals are free for riders who show a valid ticket when they leave. \
Riders must keep their ticket until the end of the journey and show it to an inspector on request. \
Travelling without a valid ticket costs a penalty fare of sixty euros, reduced to forty euros if it is paid within fourteen days. \
Eating is not allowed on trams and buses, but drinks in closed bottles are fine. \
Smoking and vaping are forbidden in vehicles, at stops and on the piers. \
When a rider describes an emergency, tell them to call 112 first and then to tell the driver or the crew. \
When a question is not about Harbor City Transit, say politely that you can only help with travel in the city. \
Keep every answer under one hundred words unless the rider asks for more detail, and end with a short offer of further help.\
"""

# 16 questions × 4 phrasings = 64 distinct short user turns (more requests repeat them with a number).
QUESTIONS = [
    "How much does a day pass cost?",
    "Can I take my bike on the tram at eight in the morning?",
    "When does the last tram leave the city centre?",
    "Is the ferry included in a single ticket?",
    "Where do I report a lost umbrella?",
    "Does the funicular run on the first Monday of the month?",
    "Can my dog come on the bus?",
    "What happens if I forget to buy a ticket?",
    "Which buses are diverted by the roadworks on Harbour Avenue?",
    "Is line 3 running late at night this November?",
    "How do I get a refund when my tram is very late?",
    "Do children need a ticket?",
    "Can I pay with my bank card on the bus?",
    "Is there a lift at the ferry piers?",
    "Where can I park my car for free?",
    "How often do trams run on Sunday afternoon?",
]
PHRASINGS = ["{q}", "Quick question: {q}", "{q} Please answer in one sentence.", "Hello! {q} Thanks."]

FOLLOW_UPS = [
    "Thanks. Can you explain that in more detail?",
    "And what about on weekends?",
    "Does that also apply to students?",
    "What should I do if the ticket machine is broken?",
    "How does that compare with the monthly pass?",
    "Can you summarise what you said in two sentences?",
    "Is there anything else I should know before I travel?",
    "Who do I contact if I have a complaint about this?",
]
OPENING_QUESTION = "Read this notice from the transit agency, then answer my questions about it."


def user_questions(num: int) -> list[str]:
    """``num`` distinct short user turns: 16 questions in 4 phrasings, then numbered repeats."""
    base = [p.format(q=q) for p in PHRASINGS for q in QUESTIONS]
    return [base[i % len(base)] + (f" (question {i + 1})" if i >= len(base) else "") for i in range(num)]


def sentences() -> list[str]:
    return re.split(r"(?<=\.) ", SYSTEM_TEXT)


def text_of_tokens(tokenizer, num_tokens: int, start_sentence: int = 0) -> str:
    """About ``num_tokens`` tokens of the text, from sentence ``start_sentence`` on (cyclically),
    cut at the last word that fits (the text repeats when it is shorter)."""
    parts = sentences()
    words: list[str] = []
    i = start_sentence
    while len(words) < num_tokens + 8:  # every word is at least one token: enough to cut from
        words.extend(parts[i % len(parts)].split())
        i += 1
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose text is at most num_tokens tokens
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False)) <= num_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


# ---- chat rendering as the ingress does it ---------------------------------------------------
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_ids(tokenizer, messages: list[dict], *, chat_template: bool = True) -> list[int]:
    """The prompt ids of a chat as the server computes them: the template rendered as text (the
    generation prompt opened), then encoded without added special tokens (router/request/preparation.py).
    Without a template: ``"Role: content"`` lines and ``"Assistant:"``."""
    if chat_template and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return list(tokenizer.encode(text, add_special_tokens=True))


_REPLY, _USER = "\U000f1000", "\U000f1001"  # private-use sentinels


def turn_suffix_ids(tokenizer, question: str, *, chat_template: bool = True) -> list[int]:
    """The token ids the template writes after an assistant reply to add one user turn and open
    the next reply: end of the reply, the user turn with ``question``, the generation prompt.

    Rendered once with sentinel contents and cut between them, so it works for any template that
    writes messages in order. Without a template: ``"\\nUser: question\\nAssistant:"``.
    """
    if chat_template and has_chat_template(tokenizer):
        chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _REPLY}, {"role": "user", "content": _USER}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        after = text[text.index(_REPLY) + len(_REPLY) :]
        suffix = after.replace(_USER, question)
    else:
        suffix = f"\nUser: {question}\nAssistant:"
    return list(tokenizer.encode(suffix, add_special_tokens=False))


# ---- workloads -------------------------------------------------------------------------------
@dataclass
class PrefixRequest:
    """One request: its prompt ids (filled in for multi-turn turns > 1 when the previous ends),
    exact output length, and where it comes from."""

    id: str
    max_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    conversation: int | None = None
    turn: int | None = None
    messages: list[dict] | None = None


def shared_prefix_messages(tokenizer, num_requests: int, system_prompt_len: int) -> list[list[dict]]:
    """The chats of ``shared-prefix``: one system message of about ``system_prompt_len`` tokens
    (text tokens; the template adds a few), then each request's own question."""
    system = text_of_tokens(tokenizer, system_prompt_len)
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in user_questions(num_requests)]


def shared_prefix(
    tokenizer, num_requests: int = 64, system_prompt_len: int = 512, output_len: int = 32, *, chat_template: bool = True
) -> list[PrefixRequest]:
    """``num_requests`` requests sharing the system prompt, as token ids (see module docstring)."""
    return [
        PrefixRequest(id=str(i), max_tokens=output_len, prompt_token_ids=render_ids(tokenizer, m, chat_template=chat_template), messages=m)
        for i, m in enumerate(shared_prefix_messages(tokenizer, num_requests, system_prompt_len))
    ]


def opening_message(tokenizer, conversation: int, first_turn_len: int) -> str:
    """Conversation ``conversation``'s first user turn: a passage of about ``first_turn_len``
    tokens starting at a different sentence per conversation, then the opening question."""
    passage = text_of_tokens(tokenizer, first_turn_len, start_sentence=conversation * 2)
    return f"{passage}\n\n{OPENING_QUESTION}"


def follow_up(conversation: int, turn: int) -> str:
    """The user's question at ``turn`` (2, 3, ...) of a conversation."""
    return FOLLOW_UPS[(conversation + turn - 2) % len(FOLLOW_UPS)]


def multi_turn_openings(
    tokenizer, num_conversations: int = 16, first_turn_len: int = 256, output_len: int = 32, *, chat_template: bool = True
) -> list[PrefixRequest]:
    """Turn 1 of every conversation, as token ids; later turns come from :func:`next_turn`."""
    out = []
    for c in range(num_conversations):
        messages = [{"role": "user", "content": opening_message(tokenizer, c, first_turn_len)}]
        ids = render_ids(tokenizer, messages, chat_template=chat_template)
        out.append(PrefixRequest(id=f"c{c}t1", max_tokens=output_len, prompt_token_ids=ids, conversation=c, turn=1, messages=messages))
    return out


def next_turn(tokenizer, previous: PrefixRequest, output_token_ids: Sequence[int], *, chat_template: bool = True) -> PrefixRequest:
    """The next turn of ``previous``'s conversation: its prompt, its output, a follow-up question."""
    c, t = previous.conversation, previous.turn + 1
    ids = list(previous.prompt_token_ids) + list(output_token_ids) + turn_suffix_ids(tokenizer, follow_up(c, t), chat_template=chat_template)
    return PrefixRequest(id=f"c{c}t{t}", max_tokens=previous.max_tokens, prompt_token_ids=ids, conversation=c, turn=t)


def common_prefix_len(sequences: Iterable[Sequence[int]]) -> int:
    """Length of the longest prefix all ``sequences`` share."""
    seqs = list(sequences)
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


# ---- the best possible hit rate --------------------------------------------------------------
class PrefixCacheSimulator:
    """One unbounded prefix cache over chained block hashes (nothing is ever evicted).

    :meth:`query` counts like the engine (vLLM's counters): every prompt token is a query, and the
    hits are the tokens of the longest run of its leading full blocks found, leaving at least the
    last prompt token to compute. :meth:`insert` adds a computed sequence's full blocks.
    """

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.blocks: set[bytes] = set()
        self.queries = 0
        self.hits = 0

    def query(self, prompt_ids: Sequence[int]) -> int:
        from replica.protocol.prefix_hash import block_hashes

        hashes = block_hashes(prompt_ids, self.block_size)
        limit = (len(prompt_ids) - 1) // self.block_size
        n = 0
        while n < limit and hashes[n] in self.blocks:
            n += 1
        self.queries += len(prompt_ids)
        self.hits += n * self.block_size
        return n * self.block_size

    def insert(self, token_ids: Sequence[int]) -> None:
        from replica.protocol.prefix_hash import block_hashes

        self.blocks.update(block_hashes(token_ids, self.block_size))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def simulate_prefix_cache(events: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int = 16) -> dict:
    """Replay ``(prompt_ids, computed_ids)`` pairs in arrival order through one unbounded cache:
    look the prompt up, then insert ``computed_ids`` (the prompt and whatever output tokens the
    engine computed K/V for). Returns ``{"queries", "hits", "hit_rate"}`` (tokens)."""
    sim = PrefixCacheSimulator(block_size)
    for prompt, computed in events:
        sim.query(prompt)
        sim.insert(computed)
    return {"queries": sim.queries, "hits": sim.hits, "hit_rate": sim.hit_rate}
