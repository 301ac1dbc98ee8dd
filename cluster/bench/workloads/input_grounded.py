"""The ``input-grounded`` workload: prompts whose answer largely repeats or edits the prompt itself.

The case speculative decoding by prompt lookup (``speculative_config={"method": "ngram", ...}``)
is for: each prompt holds a document, a paragraph or a Python function from the small corpus
below, and asks for it back, whole, with at most a small edit, so most of the answer's n-grams
are in the prompt:

* ``repeat``: "Repeat the following text exactly" and a paragraph;
* ``fix-typo``: a paragraph with one typo (two adjacent letters of one word swapped), to be
  returned whole and corrected;
* ``rename``: a Python function, to be returned with one variable (or the function itself)
  renamed.

:func:`input_grounded_prompts` draws the task, document, edit and output length of each request
from ``random.Random(seed)``, so a seed gives the same prompts in every process. Prompts are about
150 to 400 tokens with the chat template (SmolLM2's tokenizer), and every document's answer is
longer than the largest output length drawn (``max_tokens`` from 128 to 200), so a request stops
while the model is still copying. The text is original, written for this benchmark (no
download).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from cluster.bench.workloads.base import BenchRequest

MAX_TOKENS_RANGE = (128, 200)  # inclusive; the output length of each request is drawn from it
TASKS = ("repeat", "fix-typo", "rename")

PARAGRAPHS = [
    "The first lighthouses were simple fires lit on hilltops near harbours, tended by watchmen who "
    "kept them burning through the night. Later, towers of stone raised the flames higher, so that "
    "ships could see them from farther out at sea. In the eighteenth century, oil lamps with polished "
    "reflectors replaced open fires, and in the nineteenth century the Fresnel lens, a ring of glass "
    "prisms, gathered the light of a single lamp into a beam that could be seen more than twenty miles "
    "away. Each lighthouse was given its own pattern of flashes, so that a navigator who counted the "
    "seconds between them could tell which coast he was passing. Keepers lived at the station with "
    "their families, trimming wicks, winding the clockwork that turned the lens, and writing the "
    "weather in a logbook every few hours. Today most lights are automatic, powered by electricity or "
    "by the sun, and the keepers' cottages have become museums, guest houses and homes for birds. The oldest lighthouse "
    "still in use, the Tower of Hercules in Spain, was built by the Romans almost two thousand years ago.",
    "Bread rises because of yeast, a tiny fungus that feeds on the sugars in flour. When the dough is "
    "mixed and left in a warm place, the yeast breaks those sugars down and releases carbon dioxide "
    "and a little alcohol. The gas forms small bubbles, and the gluten in the dough, a network of "
    "proteins that grows stronger as the dough is kneaded, stretches around the bubbles and traps "
    "them. This is why a well kneaded dough can double in size in an hour or two. In the oven the "
    "bubbles expand once more in the heat, the alcohol evaporates, and the yeast dies when the inside "
    "of the loaf reaches about sixty degrees. The starches set, the crust browns as its sugars and "
    "proteins react, and the holes left by the gas become the soft crumb of the bread. Bakers who "
    "want a slower rise and a deeper flavour keep the dough cold overnight, which gives the yeast and "
    "the bacteria around it more time to work. A spoonful of sugar speeds the yeast up, while too much "
    "salt slows it down.",
    "Honeybees tell each other where to find food by dancing. A forager that has found a good patch "
    "of flowers returns to the hive and walks a figure of eight on the vertical face of the comb, "
    "shaking her body during the straight run in the middle. The angle of that run, measured from the "
    "vertical, matches the angle between the sun and the flowers as seen from the hive, and the "
    "length of the run tells how far away they are: the longer the waggle, the longer the flight. "
    "Other workers follow the dancer closely, touching her with their antennae and tasting the nectar "
    "she brings, and then fly out in the direction she showed them. Because the sun moves across the "
    "sky during the day, the bees adjust the angle of the dance as the hours pass, even when they have "
    "been inside the dark hive for a long time. A colony can shift its foragers to a new field within "
    "an hour of its flowers opening. Scientists first decoded the dance by marking foragers with dots of "
    "paint and watching them through the glass wall of an observation hive.",
    "Before the railways, every town kept its own time, set by the sun at noon, so that clocks in two "
    "cities only a hundred miles apart could differ by several minutes. This mattered little while "
    "travel was slow, but once trains ran on fixed timetables across whole countries, the differences "
    "caused missed connections and even collisions on single tracks. The railway companies answered "
    "by adopting one standard time along their lines, usually the time of the capital, and sending it "
    "to the stations by telegraph every morning. Station clocks sometimes showed two minute hands, one "
    "for local time and one for railway time. In the years that followed, governments made railway "
    "time the legal time of the whole country, and later the world was divided into time zones, each "
    "one hour wide, measured from the meridian that passes through Greenwich. The timetable, more than "
    "the clock, is what taught people to live by the same minute. Some towns resisted for years and kept their own "
    "noon, arguing that the sun, not a railway company, should decide when it was midday, but the "
    "convenience of a shared timetable won in the end.",
]

# Python functions, each with the names a request may rename (variables and the function's own).
FUNCTIONS = [
    (
        '''def moving_average(values, window):
    """Return the averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages


def print_averages(path, window):
    with open(path) as handle:
        values = [float(line) for line in handle if line.strip()]
    if len(values) < window:
        print(f"only {len(values)} values, fewer than the window of {window}")
        return
    for position, average in enumerate(moving_average(values, window)):
        print(f"{position:>5} {average:10.3f}")''',
        ("values", "window", "averages", "total", "index", "value", "moving_average"),
    ),
    (
        '''def merge_intervals(intervals):
    """Merge overlapping (start, end) intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    """The length of the union of the intervals."""
    covered = 0
    for start, end in merge_intervals(intervals):
        covered += end - start
    return covered


def overlaps(first, second):
    return first[0] < second[1] and second[0] < first[1]''',
        ("intervals", "ordered", "merged", "last", "start", "end", "covered", "merge_intervals"),
    ),
    (
        '''def word_frequencies(text, stop_words=(), limit=10):
    """Count the words of `text`, skipping stop words, and return the most common ones."""
    counts = {}
    for raw in text.lower().split():
        word = raw.strip(".,;:!?\\"'()[]")
        if not word or word in stop_words:
            continue
        counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]


def report(path, limit=10):
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    for word, count in word_frequencies(text, {"the", "a", "and", "of"}, limit):
        print(f"{word:<20}{count:>6}")''',
        ("text", "counts", "raw", "word", "ranked", "limit", "word_frequencies"),
    ),
    (
        '''import time


def retry(call, attempts=3, delay=0.5, backoff=2.0, exceptions=(OSError,)):
    """Call `call()` until it succeeds, waiting longer after each failure."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    wait = delay
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except exceptions as error:
            if attempt == attempts:
                raise
            print(f"attempt {attempt} failed ({error}); retrying in {wait:.1f} s")
            time.sleep(wait)
            wait *= backoff
    return None


def fetch_with_retry(url, fetch, attempts=5):
    """Fetch `url`, trying up to `attempts` times."""
    return retry(lambda: fetch(url), attempts=attempts, delay=1.0)''',
        ("call", "attempts", "delay", "wait", "attempt", "error", "retry"),
    ),
]

REPEAT_ASKS = (
    "Repeat the following text exactly, word for word, and add nothing else:",
    "Copy this paragraph out exactly as it is written:",
    "Write the text below out again, unchanged:",
)
NEW_NAMES = ("count", "result", "accumulator", "current", "buffer", "item", "entry", "amount", "step_size", "helper")


@dataclass(frozen=True)
class GroundedPrompt:
    """One request of the workload: its ``task``, the ``document`` it is built on (the paragraph or
    function before any edit), the ``prompt``, the ``expected`` answer (the document as asked for)
    and its output length."""

    task: str
    document: str
    prompt: str
    expected: str
    max_tokens: int


def rename(code: str, old: str, new: str) -> str:
    """``code`` with the identifier ``old`` replaced by ``new`` wherever it is a whole word."""
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def add_typo(paragraph: str, rng: random.Random) -> str:
    """``paragraph`` with two adjacent letters of one word (of 5+ letters) swapped, inside the word
    and only where that changes it."""
    words = list(re.finditer(r"\b[a-z]{5,}\b", paragraph))
    while True:
        match = rng.choice(words)
        word = match.group()
        i = rng.randrange(1, len(word) - 2)  # keep the first and last letters
        if word[i] != word[i + 1]:
            typo = word[:i] + word[i + 1] + word[i] + word[i + 2:]
            return paragraph[: match.start()] + typo + paragraph[match.end():]


def _prompt(task: str, rng: random.Random) -> tuple[str, str, str]:
    """(document, prompt, expected) of one request of ``task``."""
    if task == "rename":
        code, names = rng.choice(FUNCTIONS)
        old = rng.choice(names)
        new = rng.choice([n for n in NEW_NAMES if not re.search(rf"\b{n}\b", code)])
        what = "function" if code.count(f"def {old}(") else "variable"
        prompt = (f"Rewrite this Python code with the {what} `{old}` renamed to `{new}`. Return the whole code "
                  f"and nothing else.\n\n```python\n{code}\n```")
        return code, prompt, f"```python\n{rename(code, old, new)}\n```"
    paragraph = rng.choice(PARAGRAPHS)
    if task == "repeat":
        return paragraph, f"{rng.choice(REPEAT_ASKS)}\n\n{paragraph}", paragraph
    if task == "fix-typo":
        prompt = ("The paragraph below has one typo. Return the whole paragraph with the typo fixed and "
                  f"everything else unchanged:\n\n{add_typo(paragraph, rng)}")
        return paragraph, prompt, paragraph
    raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")


def input_grounded_prompts(num_requests: int = 100, seed: int = 0) -> list[GroundedPrompt]:
    """``num_requests`` prompts (see the module docstring), the same for the same ``seed``; the tasks
    in turn (repeat, fix-typo, rename, repeat, ...), the rest drawn."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        task = TASKS[i % len(TASKS)]
        document, prompt, expected = _prompt(task, rng)
        prompts.append(GroundedPrompt(task, document, prompt, expected, rng.randint(*MAX_TOKENS_RANGE)))
    return prompts


def input_grounded(num_requests: int = 100, seed: int = 0) -> list[BenchRequest]:
    """The workload as bench requests, all arriving at the start (ids ``0``, ``1``, ...)."""
    return [
        BenchRequest(id=str(i), max_tokens=p.max_tokens, prompt=p.prompt)
        for i, p in enumerate(input_grounded_prompts(num_requests, seed))
    ]
