"""Validation of one request's inputs at the engine's boundary.

Each check raises TypeError (wrong kind of value) or ValueError (right kind, value not allowed)
with a message naming the argument, the value and what is allowed, and returns the value in the
form the engine keeps (token ids as a list of Python ints). Nothing here touches engine state,
so a batch call can check every item before queuing any.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tangram_jax.sampling import SamplingParams


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_unicode(what: str, text: str) -> None:
    """Refuse lone surrogates: no tokenizer can encode them and no UTF-8 stream can carry them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.object[e.start:e.end]!r} at index "
                         f"{e.start} is a lone surrogate (text decoded with errors="
                         f"'surrogateescape'?)") from None


def check_id(name: str, value) -> str:
    """A request or session id: a non-empty str."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a non-empty str, got {_short(value)} "
                        f"({type(value).__name__})")
    if not value:
        raise ValueError(f"{name} must be a non-empty str, got ''")
    return value


def check_prompt(prompt) -> str:
    """Prompt text: a non-empty str of valid Unicode."""
    if not isinstance(prompt, str):
        hint = " (decode bytes first, or pass token ids as prompt_token_ids)" \
            if isinstance(prompt, (bytes, bytearray)) else ""
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}{hint}")
    if not prompt:
        raise ValueError("prompt is empty")
    check_unicode("prompt", prompt)
    return prompt


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """Token ids: a non-empty 1-D sequence of ints in [0, vocab_size) (numpy ints accepted;
    bools, floats, strings and bytes refused rather than converted)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
        ids = ids.tolist()
    elif isinstance(ids, (str, bytes, bytearray, dict, set, frozenset)) \
            or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a list of token ids (ints), got "
                        f"{type(ids).__name__} {_short(ids)}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be an int token id, got {_short(t)} "
                            f"({type(t).__name__})")
        out.append(int(t))
    if not out:
        raise ValueError(f"{name} is empty")
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return out


def check_messages(messages) -> list[dict]:
    """A conversation: a list of {"role", "content"} dicts (the chat template checks roles and
    order); every content valid Unicode."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                        f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            check_unicode(f"messages[{i}] content", m["content"])
    return list(messages)


def check_sampling_params(params, vocab_size: int,
                          default: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams (None: `default`, the model's generation defaults, else vLLM's), with the
    fields that depend on the model checked against its vocabulary (SamplingParams itself does
    not know the model)."""
    if params is None:
        return default if default is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"sampling_params.stop_token_ids {bad[:5]} are outside the vocabulary "
                         f"[0, {vocab_size})")
    return params
