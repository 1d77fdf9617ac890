"""Tokenizer (a `tokenizers.Tokenizer` plus special ids) and the chat formats we serve.

Built from either a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) or a GGUF's
byte-level BPE vocabulary and merges. For a GGUF the pre-tokenizer follows llama.cpp's
`tokenizer.ggml.pre` name, because that is how the vocabulary was trained: e.g. "smollm" isolates
every digit before the GPT-2 split (llama.cpp: `"\\p{N}"` then the GPT-2 regex, as SmolLM2's own
tokenizer.json does with `Digits(individual_digits=True)`). transformers' GGUF loader ignores
"smollm" and uses the bare GPT-2 split, so it differs from us (and from llama.cpp and the original
tokenizer) only where whitespace runs precede a digit, e.g. "x  2024" or "\\n\\n1".

Chat formats are written out here rather than run through a Jinja engine: ChatML
(`<|im_start|>role\\ncontent<|im_end|>\\n`, SmolLM2 / Qwen) and Llama-3
(`<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`). Which one, and the default
system prompt a ChatML template inserts when the conversation has none, are read from the
model's own chat template.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

ROLES = ("system", "user", "assistant")

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp pre-tokenizer name -> (isolate single digits first, split regex).
_GGUF_PRE = {
    None: (False, _GPT2_SPLIT),
    "default": (False, _GPT2_SPLIT),
    "gpt-2": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
    "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4


class ChatTemplateError(ValueError):
    """A conversation that cannot be formatted (bad role, content, or turn order)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """Text <-> token ids and chat formatting for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token_ids: Sequence[int],
                 bos_token_id: int | None = None, add_bos_token: bool = False,
                 chat_template: str | None = None):
        self.backend = backend
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.chat_format, self.default_system_prompt = _chat_format_of(chat_template, backend)

    # ---- construction ----

    @classmethod
    def from_gguf_spec(cls, spec) -> "Tokenizer":
        """From a `gguf_loader.GGUFTokenizerSpec` (byte-level BPE vocabularies only)."""
        if spec.model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {spec.model!r} is not supported (byte-level BPE "
                             f"'gpt2' only)")
        if spec.pre not in _GGUF_PRE:
            raise ValueError(f"GGUF pre-tokenizer {spec.pre!r} is not supported; known: "
                             f"{', '.join(str(k) for k in _GGUF_PRE if k)}")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, tok in enumerate(spec.tokens):
            # Tokens written with raw characters (some converters keep added tokens that way)
            # are re-spelled in the byte alphabet, as the BPE model looks them up.
            if not set(tok) <= alphabet:
                tok = "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        merges = [tuple(m.split(" ", 1)) for m in spec.merges]
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        isolate_digits, split = _GGUF_PRE[spec.pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if isolate_digits else []
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types = spec.token_types
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in zip(spec.tokens, types) if ty == _CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, ty in zip(spec.tokens, types) if ty == _USER_DEFINED])
        eos = [t for t in (spec.eos_token_id, spec.eot_token_id) if t is not None]
        return cls(backend, eos_token_ids=eos, bos_token_id=spec.bos_token_id,
                   add_bos_token=spec.add_bos_token, chat_template=spec.chat_template)

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """From `tokenizer.json`, `tokenizer_config.json` and (for EOS ids) the model's configs."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        tcfg = _read_json(path / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        def token_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos: list[int] = []
        for cfg in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            value = cfg.get("eos_token_id")
            eos += value if isinstance(value, list) else [] if value is None else [value]
        if (t := token_id(tcfg.get("eos_token"))) is not None:
            eos.append(t)
        bos = token_id(tcfg.get("bos_token"))
        # A tokenizer.json whose post-processor adds BOS already does it in `encode`.
        return cls(backend, eos_token_ids=eos, bos_token_id=bos,
                   add_bos_token=False, chat_template=template)

    # ---- text ----

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ----

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat format spells it (special tokens as text)."""
        validate_messages(messages, add_generation_prompt)
        if self.chat_format == "chatml":
            parts = []
            if messages[0]["role"] != "system" and self.default_system_prompt is not None:
                parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
            parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
            if add_generation_prompt:
                parts.append("<|im_start|>assistant\n")
            return "".join(parts)
        if self.chat_format == "llama3":
            # Llama-3 strips each message's content and starts with <|begin_of_text|>.
            parts = ["<|begin_of_text|>"]
            parts += [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                      for m in messages]
            if add_generation_prompt:
                parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
            return "".join(parts)
        raise ChatTemplateError("this model has no chat template we can apply "
                                "(supported: ChatML and Llama-3 formats)")

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the formatted conversation (the special tokens are matched as such)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def validate_messages(messages: Sequence[dict], add_generation_prompt: bool = True) -> None:
    """An optional system message, then user/assistant turns alternating from the user.

    Raises ChatTemplateError naming the offending position.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of {{'role', 'content'}} dicts, "
                                f"got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty")
    expected = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                    f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}] has unknown role {role!r}; roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}] ({role}) content must be a str, got "
                                    f"{type(content).__name__}")
        if role == "system":
            if i != 0:
                raise ChatTemplateError(f"messages[{i}]: a system message is only allowed first")
            continue
        if role != expected:
            raise ChatTemplateError(f"messages[{i}] is {role!r} but {expected!r} was expected: turns "
                                    f"must alternate user/assistant, starting with user")
        expected = "assistant" if role == "user" else "user"
    if add_generation_prompt and messages[-1]["role"] != "user":
        raise ChatTemplateError(f"the last message (messages[{len(messages) - 1}]) must be from the "
                                f"user to generate a reply, got {messages[-1]['role']!r}")


def _chat_format_of(template: str | None, backend: tokenizers.Tokenizer) -> tuple[str | None, str | None]:
    """("chatml" | "llama3" | None, default system prompt or None) from a chat template."""
    if template is None:
        # No template: fall back on the special tokens the vocabulary has.
        if backend.token_to_id("<|im_start|>") is not None:
            return "chatml", None
        if backend.token_to_id("<|start_header_id|>") is not None:
            return "llama3", None
        return None, None
    if "<|im_start|>" in template:
        # A ChatML template that injects a system turn when there is none spells it as a
        # literal string, e.g. SmolLM2's and Qwen2.5's.
        # Only a literal (no quotes, no Jinja) counts: `'...system\n' + messages[0]['content']`
        # is the branch for a given system message, not a default.
        default = None
        for m in re.finditer(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", template, re.S):
            body = m.group(1)
            if not any(c in body for c in "'\"{}"):
                default = body.replace("\\n", "\n")
                break
        return "chatml", default
    if "<|start_header_id|>" in template:
        if "Cutting Knowledge Date" in template:
            return None, None  # Llama-3.1+ (date preamble, tools): not written out here
        return "llama3", None
    return None, None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
