"""A tiny random-weight Llama in a Hugging Face folder, for engine tests that need many steps.

Real tokenizer machinery (a byte-level BPE `tokenizer.json` with ChatML special tokens and a
chat template), real loader (`load_model` on the folder), random weights: a decode step costs
milliseconds on a CPU, so fuzz and soak tests can run thousands of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.models.tokenizer import _bytes_to_unicode

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256 + len(SPECIAL), max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
              hidden_act="silu", eos_token_id=256 + SPECIAL.index(EOS_TOKEN))


def _byte_vocab() -> dict[str, int]:
    """One token per byte, spelled in ByteLevel's alphabet (GPT-2's byte-to-unicode table)."""
    return {char: byte for byte, char in _bytes_to_unicode().items()}


def build_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = CONFIG
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim

    def linear(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{p}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
            f"{p}.self_attn.q_proj.weight": linear(hidden, hidden),
            f"{p}.self_attn.k_proj.weight": linear(kv, hidden),
            f"{p}.self_attn.v_proj.weight": linear(kv, hidden),
            f"{p}.self_attn.o_proj.weight": linear(hidden, hidden),
            f"{p}.mlp.gate_proj.weight": linear(inter, hidden),
            f"{p}.mlp.up_proj.weight": linear(inter, hidden),
            f"{p}.mlp.down_proj.weight": linear(hidden, inter),
        })
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c), encoding="utf-8")

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        dict(chat_template=CHAT_TEMPLATE, eos_token=EOS_TOKEN, bos_token=None)), encoding="utf-8")
    return folder


def tiny_profile(name: str, seed: int = 0, group_size: int = 1) -> BudgetProfile:
    """A tangram budget profile for the tiny model: random per-head budgets in [0.3, 1], heads
    sorted by budget into groups of `group_size` (a group's budget is its largest head's)."""
    c = CONFIG
    layers, heads = c["num_hidden_layers"], c["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    budget = rng.uniform(0.3, 1.0, (layers, heads))
    perm = np.argsort(-budget, axis=1)
    sorted_budget = np.take_along_axis(budget, perm, axis=1)
    return BudgetProfile(
        model=dict(architecture="llama", num_layers=layers, num_kv_heads=heads,
                   head_dim=c["hidden_size"] // c["num_attention_heads"], name=name),
        method="snapkv", rho=float(budget.mean()), lambda_=2.0, mean=budget,
        std=np.zeros_like(budget), budget=budget, group_size=group_size, grouping="budget",
        head_perm=perm,
        group_budgets=sorted_budget.reshape(layers, heads // group_size, group_size).max(-1))


# Engine settings small enough for thousands of CPU steps. One decode bucket: a row's arithmetic
# is the same whatever else is in the batch (a greedy request's tokens in a batch equal its
# tokens alone), and one shape to compile.
SMALL = dict(max_num_seqs=4, num_pages=160, max_model_len=256, chunk_size=16, page_size=8,
             max_num_batched_tokens=64, decode_buckets=(4,), num_programs=8)


def tiny_engine_config(folder: str | Path, mode: str, **overrides):
    from tangram_jax.engine.config import EngineConfig
    kwargs = dict(SMALL, model=str(folder), mode=mode, **overrides)
    if mode == "tangram":
        kwargs.setdefault("profile", tiny_profile(str(folder)))
    elif mode == "dynamic":
        kwargs.setdefault("ratio", 0.5)
    return EngineConfig(**kwargs)


def prefill_then_decode(runner, manager, layout, tokens, *, as_one_turn: bool = False,
                        chunk: int = 16, decode_steps: int = 3):
    """Reserve a slot for `tokens`, prefill them through `runner` in `chunk`-token pieces and
    decode `decode_steps` greedy tokens. With `as_one_turn` the pieces are one turn (the layout's
    protected tail, `commit_prefill` told the turn, the retained counts checked against the
    layout's); otherwise each piece is committed alone.
    Returns (each piece's last logits [pieces, vocab], [first sampled token, decoded ...], the
    slot)."""
    slot = manager.allocate_slot()
    assert manager.reserve(slot, len(tokens))
    runner.update_block_tables(*manager.take_table_updates())
    logits = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        protected = layout.chunk_protected(len(tokens), start, len(piece)) if as_one_turn else 0
        out, kept = runner.prefill_chunk(piece, start, slot, manager.lengths[slot], protected)
        np.testing.assert_array_equal(kept, layout.chunk_keep_counts(len(piece), protected))
        if as_one_turn:
            manager.commit_prefill(slot, len(piece), start=start, turn_len=len(tokens))
        else:
            manager.commit_prefill(slot, len(piece))
        logits.append(np.asarray(out))
    if as_one_turn:   # the turn's pieces together retain what the layout's rule says
        np.testing.assert_array_equal(manager.lengths[slot], layout.retained_counts(len(tokens)))
    greedy = (np.zeros(1, np.float32), np.full(1, -1, np.int32), np.ones(1, np.float32),
              np.zeros(1, np.uint32), np.zeros(1, np.int32))
    decoded = [int(runner.sample(logits[-1:], [slot], *greedy)[0])]
    for step in range(decode_steps):
        assert manager.grow_for_decode(np.array([slot])).all()
        runner.update_block_tables(*manager.take_table_updates())
        out = runner.decode(np.array([len(tokens) + step]), np.array([slot]),
                            manager.decode_write_lengths(np.array([slot])), *greedy)
        decoded.append(int(out[0]))
    return np.stack(logits), decoded, slot


def child_xla_flags(devices: int | None) -> str:
    """This process's XLA_FLAGS (the suite's compile settings, conftest.py) for a child process
    on `devices` CPU devices (None: XLA's default of one)."""
    import os
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
            if not flag.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + ([f"--xla_force_host_platform_device_count={devices}"] if devices
                            else []))


def report_of_child(code: str, folder: str | Path, devices: int = 2, timeout: int = 900) -> dict:
    """Run `code` in a fresh Python process on `devices` CPU devices (JAX fixes its device count
    when it starts; the suite runs with one) with argv ``[folder, tests folder]``, and return the
    JSON it prints on its ``REPORT `` line. The process must exit 0."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(devices))
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(Path(__file__).parent)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])
