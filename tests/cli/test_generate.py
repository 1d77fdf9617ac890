"""`tangram-jax generate` through the CLI dispatcher."""

import pytest

from tangram_jax.cli import main


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One converted-parameter cache for this module: the first command fills it, later ones reuse it."""
    return tmp_path_factory.mktemp("tangram_cache")


@pytest.fixture
def cached(monkeypatch, model_cache):
    monkeypatch.setenv("TANGRAM_JAX_CACHE", str(model_cache))
    return model_cache


@pytest.mark.slow
def test_capital_of_france(cached, capsys):
    assert main(["generate", "--max-tokens", "8", "The capital of France is"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "generating" in err  # the progress bar goes to stderr
    assert any(cached.iterdir())


@pytest.mark.slow
def test_chat_reply_cut_at_stop_string(cached, capsys):
    code = main(["generate", "--chat", "--max-tokens", "16", "--stop", ".",
                 "What", "is", "the", "capital", "of", "France?"])
    out, _ = capsys.readouterr()
    assert code == 0 and "Paris" in out and "." not in out


@pytest.mark.slow
def test_prompt_longer_than_context(cached, capsys):
    code = main(["generate", "word " * 9000])
    _, err = capsys.readouterr()
    assert code == 2
    assert "context is 8192 tokens" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "1.5", "hi"], "top_p must be in (0, 1]"),
    (["--top-p", "0", "hi"], "top_p must be in (0, 1]"),
    (["--max-tokens", "-3", "hi"], "max_tokens must be >= 1"),
    (["--temperature", "-1", "hi"], "temperature must be"),
    (["--top-k", "-5", "hi"], "top_k must be"),
    (["--system", "be nice", "hi"], "--system needs --chat"),
    (["--model", "no-such-model", "hi"], "unknown model 'no-such-model'"),
    (["--model", "/nonexistent/m.gguf", "hi"], "GGUF file not found"),
])
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err and out == ""


def test_argparse_rejects_non_numbers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--max-tokens", "many", "hi"])
    assert e.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err
