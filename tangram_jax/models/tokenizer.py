"""Tokenizer (a `tokenizers.Tokenizer` plus special ids) and the model's own chat template.

Built from either a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) or a GGUF's
byte-level BPE vocabulary and merges, or a Gemma GGUF's sentencepiece vocabulary (a BPE with byte
fallback over "▁"-spelled pieces, as Gemma's own tokenizer.json; the file lists no merges, so they
are rebuilt from the vocabulary ranked by the pieces' order in the file, as transformers' GGUF
loader does: Gemma's scores do not follow its merge order). For a GGUF the pre-tokenizer follows llama.cpp's
`tokenizer.ggml.pre` name, because that is how the vocabulary was trained: e.g. "smollm" isolates
every digit before the GPT-2 split (llama.cpp: `"\\p{N}"` then the GPT-2 regex, as SmolLM2's own
tokenizer.json does with `Digits(individual_digits=True)`). transformers' GGUF loader ignores
"smollm" and uses the bare GPT-2 split, so it differs from us (and from llama.cpp and the original
tokenizer) only where whitespace runs precede a digit, e.g. "x  2024" or "\\n\\n1".

Chat formatting renders the model's own Jinja `chat_template` (from `tokenizer_config.json`,
`chat_template.jinja` or the GGUF's `tokenizer.chat_template`) the way transformers'
`apply_chat_template` does: an immutable sandbox (templates come from model hubs: untrusted
code), trim_blocks / lstrip_blocks, loop controls, and the same globals and filters
(`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, `namespace` without
underscore attributes), with the tokenizer's special tokens (`bos_token`, `eos_token`, ...) in
scope. So every template a model ships (ChatML, Llama-3.x with its date preamble, Qwen3 with its
thinking switch, ...) is spelled exactly as its authors wrote it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

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
                 chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None):
        """special_tokens: the strings a chat template sees as `bos_token`, `eos_token`,
        `unk_token`, `pad_token` (transformers' special_tokens_map); by default BOS and the first
        EOS id spelled out."""
        self.backend = backend
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        if special_tokens is None:
            special_tokens = {
                "bos_token": None if bos_token_id is None else backend.id_to_token(bos_token_id),
                "eos_token": backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None}
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self._compiled_template = None

    # ---- construction ----

    @classmethod
    def from_gguf_spec(cls, spec) -> "Tokenizer":
        """From a `gguf_loader.GGUFTokenizerSpec` (byte-level BPE vocabularies, and Gemma's
        sentencepiece vocabulary)."""
        if spec.model == "llama" and str(spec.architecture).startswith("gemma"):
            return cls._with_gguf_specials(_gemma_sentencepiece(spec.tokens), spec)
        if spec.model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {spec.model!r} is not supported (byte-level BPE "
                             f"'gpt2', or a Gemma sentencepiece vocabulary)")
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
        return cls._with_gguf_specials(backend, spec)

    @classmethod
    def _with_gguf_specials(cls, backend: tokenizers.Tokenizer, spec) -> "Tokenizer":
        """`backend` with the GGUF's control tokens (special) and user-defined tokens added,
        and the file's special ids and chat template."""
        types = spec.token_types
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in zip(spec.tokens, types) if ty == _CONTROL])
        # (Only those the vocabulary holds as spelled: one it respelled would get a new id.)
        vocab = backend.get_vocab()
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, ty in zip(spec.tokens, types)
                            if ty == _USER_DEFINED and t in vocab])
        eos = [t for t in (spec.eos_token_id, spec.eot_token_id) if t is not None]
        # What transformers' GGUF loader puts in the template's scope.
        special = {name: spec.tokens[i] if i is not None and 0 <= i < len(spec.tokens) else None
                   for name, i in (("bos_token", spec.bos_token_id), ("eos_token", spec.eos_token_id),
                                   ("pad_token", spec.pad_token_id))}
        return cls(backend, eos_token_ids=eos, bos_token_id=spec.bos_token_id,
                   add_bos_token=spec.add_bos_token, chat_template=spec.chat_template,
                   special_tokens=special)

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

        def token_text(value) -> str | None:   # a string or an AddedToken dict
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else None

        def token_id(value):
            text = token_text(value)
            return backend.token_to_id(text) if text is not None else None

        eos: list[int] = []
        for cfg in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            value = cfg.get("eos_token_id")
            eos += value if isinstance(value, list) else [] if value is None else [value]
        if (t := token_id(tcfg.get("eos_token"))) is not None:
            eos.append(t)
        bos = token_id(tcfg.get("bos_token"))
        # A tokenizer.json whose post-processor adds BOS already does it in `encode`.
        special = {name: token_text(tcfg.get(name))
                   for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(backend, eos_token_ids=eos, bos_token_id=bos,
                   add_bos_token=False, chat_template=template, special_tokens=special)

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

    def use_chat_template(self, source: str) -> None:
        """Format chats with `source` (a Jinja template, as `load_chat_template` returns it) in
        place of the model's own (vLLM's ``--chat-template``). Raises ChatTemplateError when it
        does not parse."""
        self._compiled_template = compile_chat_template(source)
        self.chat_template = source

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """The conversation as the model's chat template spells it (special tokens as text).

        `template_kwargs` reach the template as variables (e.g. `enable_thinking=False` for
        Qwen3, `date_string=...` for Llama-3.1), as with transformers' `apply_chat_template`.
        """
        import jinja2

        validate_messages(messages, add_generation_prompt)
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (none in its "
                                    "tokenizer_config.json, chat_template.jinja or GGUF metadata)")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        context = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the conversation: {e}") from e

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """Token ids of the formatted conversation (the special tokens are matched as such)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs),
                           add_special_tokens=False)


def load_chat_template(value: str | os.PathLike) -> str:
    """A chat template given as vLLM's ``--chat-template`` takes it: the path of a Jinja file,
    or the template itself (text with ``{{`` or ``{%``). Raises ChatTemplateError naming the
    value otherwise."""
    text = os.fspath(value)
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return f.read()
    if "{{" in text or "{%" in text:
        return text
    raise ChatTemplateError(f"chat_template must be a Jinja file or a Jinja template (text "
                            f"with '{{{{' or '{{%'), got {text!r}: no such file")


def compile_chat_template(source: str):
    """A Jinja chat template compiled as transformers compiles it (see the module docstring).

    Raises ChatTemplateError when the template does not parse.
    """
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be a str, got {type(source).__name__}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateNamespace(jinja2.utils.Namespace):
        # No underscore attributes: a namespace must not reach Python internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e} "
                                f"(line {e.lineno})") from e


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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _gemma_sentencepiece(tokens: Sequence[str]) -> tokenizers.Tokenizer:
    """Gemma's tokenizer from a GGUF's sentencepiece pieces: a BPE with byte fallback over
    "▁"-spelled text (spaces become "▁"; words split after each space), as Gemma's tokenizer.json.

    Pieces of two or more spaces are stored as real spaces in the file and respelled "▁..."; the
    merges are every split of a piece into two pieces, ranked by the merged piece's position in
    the file, then longer left halves first (transformers' `generate_merges` with Gemma's
    position scores).
    """
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}   # a respelled duplicate: the later id
    merges = []
    for piece, rank in vocab.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(rank, -len(left), -len(right), left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:3])
    backend = tokenizers.Tokenizer(models.BPE(
        vocab, [(m[3], m[4]) for m in merges], fuse_unk=True, unk_token="<unk>",
        byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend
