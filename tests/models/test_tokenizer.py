"""Tokenizer and chat formats: our GGUF tokenizer against transformers', message validation."""

import json
from pathlib import Path

import pytest
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers

from tangram_jax.models.gguf_loader import open_gguf, tokenizer_spec_from_metadata
from tangram_jax.models.registry import default_model_path
from tangram_jax.models.tokenizer import ChatTemplateError, Tokenizer, validate_messages

TEXTS = [
    "Hello world!",
    "The capital of France is",
    "héllo wörld — ünïcode ✓ 日本語のテキスト, Ελληνικά, русский 🙂🚀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text<empty_output> <repo_name>x",
    "def f(x):\n    return x**2  # comment\n\n\tTabs\r\nCRLF",
    "I'm you're we'll they'd DON'T",
    "price: $1,234.56 on 2024-05-01 at 10:30",
    "  leading and trailing  ",
    "",
    "a" * 60,
    "emoji🙂split\u200bzero-width",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a colour. 🙂"}],
    [{"role": "user", "content": "Line one\nline two\n\n  indented"}],
]


@pytest.fixture(scope="module")
def smollm_spec():
    return tokenizer_spec_from_metadata(open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def ours(smollm_spec):
    return Tokenizer.from_gguf_spec(smollm_spec)


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    src = default_model_path()
    folder = tmp_path_factory.mktemp("smollm2_tok")
    (folder / src.name).symlink_to(src)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=src.name)


@pytest.mark.slow
def test_ids_match_transformers(ours, theirs):
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_digits_are_isolated_as_llama_cpp_smollm_does(ours):
    # llama.cpp's "smollm" pre-tokenizer splits every digit off first; transformers' GGUF loader
    # skips that step, so this is the one place the two differ: two spaces before a number
    # stay one "  " token here (id 256), as in SmolLM2's own tokenizer.json, instead of 216, 216.
    assert ours.encode("x  2024") == [104, 256, 34, 32, 34, 36]
    assert ours.encode("a\n\n123\n") == [81, 1116, 33, 34, 35, 198]


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, theirs):
    assert "You are a helpful AI assistant named SmolLM" in ours.chat_template   # the GGUF's own
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == text
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert ours.apply_chat_template(messages) == list(ids)
    no_prompt = CONVERSATIONS[1][:3]
    assert ours.render_chat(no_prompt, add_generation_prompt=False) == theirs.apply_chat_template(
        no_prompt, add_generation_prompt=False, tokenize=False)


def test_special_ids(ours):
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and not ours.add_bos_token
    assert ours.token_to_id("<|im_start|>") == 1 and ours.vocab_size == 49152
    assert ours.decode([1, 4093, 2]) == "user"  # specials skipped by default


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hello", "list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\] has unknown role 'robot'"),
    ([{"role": "user", "content": 5}], r"messages\[0\] \(user\) content must be a str"),
    ([{"role": "user"}], r"messages\[0\] \(user\) content"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], r"messages\[1\] is 'user' but 'assistant'"),
    ([{"role": "assistant", "content": "a"}], r"messages\[0\] is 'assistant' but 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], r"messages\[1\]: a system message"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     r"last message \(messages\[2\]\) must be from the user"),
])
def test_bad_conversations_name_the_position(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        validate_messages(messages, add_generation_prompt=True)


def test_assistant_last_is_fine_without_generation_prompt():
    validate_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                      add_generation_prompt=False)


def _tiny_word_level(specials):
    vocab = {t: i for i, t in enumerate(specials + ["hello", "there", "\n", "a", "b", "Ċ", "ĊĊ"])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    return backend


def test_llama3_format_and_hf_folder(tmp_path):
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]
    backend = _tiny_word_level(specials)
    backend.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 3]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.eos_token_ids == (4, 3) and tok.bos_token_id == 0
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    messages = [{"role": "system", "content": " sys "}, {"role": "user", "content": "hello there\n"}]
    assert tok.render_chat(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>")
    ids = tok.apply_chat_template(messages)
    assert ids[0] == 0 and ids.count(3) == 2 and ids[-1] == 3


def test_model_without_usable_template(tmp_path):
    backend = _tiny_word_level(["<unk>"])
    tok = Tokenizer(backend, eos_token_ids=[0], chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    bad = Tokenizer(backend, eos_token_ids=[0], chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        bad.render_chat([{"role": "user", "content": "hello"}])
    refusing = Tokenizer(backend, eos_token_ids=[0],
                         chat_template="{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        refusing.render_chat([{"role": "user", "content": "hello"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(None)


def test_unsupported_gguf_tokenizers(smollm_spec):
    import dataclasses

    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf_spec(dataclasses.replace(smollm_spec, model="llama"))
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_spec(dataclasses.replace(smollm_spec, pre="mystery"))


TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
TEMPLATE_CONVERSATIONS = CONVERSATIONS + [
    [{"role": "system", "content": "  You answer in French.  "}, {"role": "user", "content": " Bonjour \n"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
     {"role": "user", "content": "Q2 with {{ braces }} and {% tags %} and </script>"}],
]


def _hf_folder(tmp_path, template: str, specials: dict[str, str]):
    """A tokenizer folder (tiny vocabulary holding the special tokens) with `template`."""
    backend = _tiny_word_level(["<unk>"] + sorted(set(specials.values())))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **specials}))
    return tmp_path


@pytest.mark.parametrize("name, specials, kwargs", [
    ("llama-3.1-8b-instruct.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, {}),
    ("llama-3.1-8b-instruct.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
     {"date_string": "01 Jan 2026"}),
    ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, {}),
    ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, {"enable_thinking": False}),
])
def test_shipped_templates_render_as_transformers(tmp_path, name, specials, kwargs):
    folder = _hf_folder(tmp_path, (TEMPLATES / name).read_text(encoding="utf-8"), specials)
    ours_tok = Tokenizer.from_hf_folder(folder)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in TEMPLATE_CONVERSATIONS:
        for gen in (True, False):
            if not gen and messages[-1]["role"] == "user":
                continue
            expected = theirs_tok.apply_chat_template(messages, add_generation_prompt=gen,
                                                      tokenize=False, **kwargs)
            assert ours_tok.render_chat(messages, add_generation_prompt=gen, **kwargs) == expected
    # The date preamble and the thinking switch really came from the template.
    text = ours_tok.render_chat(TEMPLATE_CONVERSATIONS[0], **kwargs)
    if name.startswith("llama"):
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                               "Cutting Knowledge Date: December 2023\nToday Date: "
                               + kwargs.get("date_string", "26 Jul 2024"))
    elif kwargs.get("enable_thinking") is False:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_jinja_file_wins_and_tojson_is_plain(tmp_path):
    folder = _hf_folder(tmp_path, "ignored", {"eos_token": "<|im_end|>"})
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}")
    tok = Tokenizer.from_hf_folder(folder)
    # transformers' tojson: no HTML escaping, non-ASCII kept.
    assert tok.render_chat([{"role": "user", "content": "<a> & 'é'"}]) == \
        '{"role": "user", "content": "<a> & \'é\'"}'


def test_templates_run_sandboxed():
    backend = _tiny_word_level(["<unk>"])
    escape = Tokenizer(backend, eos_token_ids=[0],
                       chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        escape.render_chat([{"role": "user", "content": "a"}])
    underscore = Tokenizer(backend, eos_token_ids=[0],
                           chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(Exception, match="underscore"):
        underscore.render_chat([{"role": "user", "content": "a"}])


@pytest.mark.slow
def test_smollm2_hf_folder_template_matches_transformers(theirs, tmp_path):
    """SmolLM2's tokenizer files as a Hugging Face folder (tokenizer.json, tokenizer_config.json,
    chat_template.jinja, written by transformers): the folder path renders the same text and
    the same ids as transformers' `apply_chat_template` on that folder."""
    theirs.save_pretrained(tmp_path)
    folder_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours_tok = Tokenizer.from_hf_folder(tmp_path)
    assert "You are a helpful AI assistant named SmolLM" in ours_tok.chat_template
    for messages in TEMPLATE_CONVERSATIONS:
        for gen in (True, False):
            if not gen and messages[-1]["role"] == "user":
                continue
            text = folder_tok.apply_chat_template(messages, add_generation_prompt=gen,
                                                  tokenize=False)
            assert ours_tok.render_chat(messages, add_generation_prompt=gen) == text
            ids = folder_tok.apply_chat_template(messages, add_generation_prompt=gen,
                                                 tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert ours_tok.apply_chat_template(messages, add_generation_prompt=gen) == list(ids)


def test_a_chat_template_given_in_place_of_the_models(tmp_path):
    """vLLM's --chat-template: a Jinja file or the template text replaces the model's own (or
    gives one to a model that ships none); anything else is one error naming the value, and a
    template that does not parse is refused when it is given, not at the first chat."""
    from tangram_jax.models.tokenizer import load_chat_template

    backend = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(backend, eos_token_ids=(1,))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<model>"
    path = tmp_path / "template.jinja"
    path.write_text(text, encoding="utf-8")
    for given in (text, str(path), path):
        assert load_chat_template(given) == text
    tok.use_chat_template(load_chat_template(path))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<model>"
    with pytest.raises(ChatTemplateError, match="'no-such-template.jinja'"):
        load_chat_template("no-such-template.jinja")
    with pytest.raises(ChatTemplateError):
        tok.use_chat_template("{% for m in messages %}")
    assert tok.chat_template == text   # a refused template leaves the one in use
