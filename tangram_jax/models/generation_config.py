"""The model's default sampling parameters: vLLM's ``generation_config="auto"``.

A request that brings no `SamplingParams` (``LLM.generate(prompts)``, ``Engine.add_request(...,
sampling_params=None)``, an OpenAI request that leaves a field out) is sampled with the model
creator's recommendation where the model carries one, as vLLM does:

- a Hugging Face folder: its ``generation_config.json``, read as vLLM reads it (transformers'
  ``GenerationConfig.to_diff_dict``: only values that differ from transformers' own defaults,
  of ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
  ``max_new_tokens``, the last as ``max_tokens``; ``do_sample`` is not read, as in vLLM);
- a GGUF file: the sampler keys llama.cpp's converters write (``general.sampling.temp``,
  ``.top_k``, ``.top_p``, ``.min_p``, ``.penalty_repeat``; vLLM reads none from a GGUF);
- neither, or ``generation_config="vllm"``: vLLM's neutral defaults (``SamplingParams()``).

``generation_config`` may also name a folder holding a ``generation_config.json`` (vLLM's third
form), e.g. the Hugging Face repository's of a model served from a GGUF.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tangram_jax.sampling import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys vLLM takes (`ModelConfig.get_diff_sampling_param`), and the
# SamplingParams field each sets.
HF_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                    "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults of those keys: `to_diff_dict` drops values equal to
# them, so vLLM never sees them (a file's "top_k": 50 leaves vLLM's top_k 0).
HF_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
               "min_p": None, "max_new_tokens": None}
# llama.cpp's GGUF sampler metadata (`LLM_KV_SAMPLING_*`) the engine has a field for.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
MODES = ("auto", "vllm")   # besides a folder path


class GenerationConfigError(ValueError):
    """A generation config the engine cannot use; the message names the file, key and value."""


def sampling_overrides(generation_config: str | os.PathLike,
                       source: Path | None) -> tuple[dict, str]:
    """(SamplingParams fields that differ from vLLM's defaults, where they came from) for the
    model loaded from `source` (a HF folder, a .gguf file, or None for a model built in memory)
    under `generation_config` ("auto", "vllm" or a folder path)."""
    if isinstance(generation_config, str) and generation_config == "vllm":
        return {}, "vLLM's defaults (generation_config='vllm')"
    if not (isinstance(generation_config, str) and generation_config == "auto"):
        folder = Path(generation_config).expanduser()
        path = folder / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise GenerationConfigError(f"generation_config {str(generation_config)!r}: no "
                                        f"{GENERATION_CONFIG_FILE} in that folder")
        return _from_hf_file(path), str(path)
    if source is not None and Path(source).is_dir():
        path = Path(source) / GENERATION_CONFIG_FILE
        if path.is_file():
            return _from_hf_file(path), str(path)
    elif source is not None and Path(source).suffix.lower() == ".gguf" and Path(source).is_file():
        found = _from_gguf(Path(source))
        if found:
            return found, f"{Path(source).name}'s general.sampling.* metadata"
    return {}, "vLLM's defaults (the model carries no generation config)"


def default_sampling_params(generation_config, source: Path | None) -> tuple[SamplingParams, str]:
    """The `SamplingParams` a request without its own is served with, and where they came
    from. Raises GenerationConfigError naming the file when its values are out of range."""
    overrides, origin = sampling_overrides(generation_config, source)
    try:
        params = SamplingParams(**overrides)
    except (TypeError, ValueError) as e:
        raise GenerationConfigError(f"{origin}: {e} (pass generation_config='vllm' to ignore "
                                    f"it)") from None
    if overrides:
        log.info("default sampling parameters from %s: %s", origin,
                 ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())))
    return params, origin


def describe(params: SamplingParams) -> str:
    """The sampling fields a generation config can set, as one line (for logs and CLIs)."""
    top_k = "off" if params.top_k <= 0 else params.top_k
    return (f"temperature {params.temperature:g}, top_p {params.top_p:g}, top_k {top_k}, "
            f"min_p {params.min_p:g}, repetition_penalty {params.repetition_penalty:g}")


def _from_hf_file(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object, got "
                                    f"{type(config).__name__}")
    return {field: config[key] for key, field in HF_SAMPLING_KEYS.items()
            if config.get(key) is not None and config[key] != HF_DEFAULTS[key]}


def _from_gguf(path: Path) -> dict:
    from tangram_jax.models.gguf_loader import gguf_summary

    fields = gguf_summary(path)["sampling"]
    return {name: int(fields[key]) if name == "top_k" else float(fields[key])
            for key, name in GGUF_SAMPLING_KEYS.items() if key in fields}
