"""Request bodies of the OpenAI API subset the server speaks (pydantic), and their mapping onto
`SamplingParams`.

Fields follow OpenAI's names and defaults, plus the vLLM extensions its clients send (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `prompt_logprobs`). A field the engine cannot honour (`echo`,
`best_of` > n, `logit_bias`) is refused with a 400 naming it, never silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tangram_jax.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI clients send many (user, metadata, ...).
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something the engine cannot do."""
        return ["logit_bias"] if self.logit_bias else []

    def logprobs_asked(self) -> int | None:
        """SamplingParams.logprobs: how many top alternatives per generated token (None: off)."""
        return None

    def sampling_params(self, max_tokens: int | None,
                        defaults: SamplingParams | None = None) -> SamplingParams:
        """The request's SamplingParams; a sampler field it leaves out takes `defaults`' (the
        model's generation config, as vLLM's server does), else vLLM's default. Raises
        ValueError / TypeError (from SamplingParams) for out-of-range values."""
        defaults = defaults if defaults is not None else SamplingParams()

        def given(name):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        return SamplingParams(
            temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"),
            max_tokens=16 if max_tokens is None else max_tokens,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty"), min_p=given("min_p"),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs_asked(), prompt_logprobs=getattr(self, "prompt_logprobs", None))


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, self.n):
            bad.append(f"best_of={self.best_of} (only best_of == n)")
        return bad

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[dict]:
        """One engine input per prompt: {"prompt": str} or {"prompt_token_ids": [int]}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if p and all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if p and all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a "
                         "list of token-id lists, and not empty")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None

    def as_engine_message(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ValueError(f"messages[{index}]: only text content parts are supported")
            content = "".join(part.text for part in content)
        if content is None:
            raise ValueError(f"messages[{index}] ({self.role}) has no content")
        # OpenAI's "developer" role is the system prompt of newer models.
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.top_logprobs and not self.logprobs:
            bad.append("top_logprobs without logprobs=true")
        return bad

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict]:
        return [m.as_engine_message(i) for i, m in enumerate(self.messages)]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
