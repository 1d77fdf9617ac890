"""A new model's whole path, timed: `tangram-jax calibrate` of a model folder, then its first token.

`tangram-jax calibrate` of a Hugging Face folder, then serving `tangram` with the profile it
wrote (the first token of a first chat request).

The folder stands in for a download: a Llama-3.1-8B-shaped `config.json`, random bf16 weights
generated on the device and written as safetensors shards (not timed), and the tokenizer files
of `--tokenizer` (a folder with tokenizer.json; its ids must fit the model's vocabulary). Then,
each in a fresh process as a user runs them, with an empty JAX compilation cache:

1. `tangram-jax calibrate --model FOLDER --samples N --ratio R --group-size G --out PROFILE`
   (loads the folder, converts and caches it, runs the pilot samples, writes the profile);
2. `LLM(FOLDER, mode="tangram", profile=PROFILE)` and one greedy chat request of
   `--prompt-tokens` tokens: seconds to construct and to the request's first token.

    python benchmarks/new_model_path.py --tokenizer .gpu/tok_smollm2 --out $OUT/new_model_path.json
    # CPU smoke test (a tiny shape):
    python benchmarks/new_model_path.py --tokenizer DIR --shape tiny --samples 2 --lengths 128

Writes a fresh file under benchmarks/results/runs/ unless --out names one (a file git tracks only
with --overwrite); the JSON is rewritten after each step, so a run cut short keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# This process draws the weights on the device and then leaves the card to the steps it times
# (fresh processes): allocate exactly what is asked and free it, no 75% preallocation.
_PARENT_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
_USER_ENV = {k: os.environ.get(k) for k in _PARENT_ENV}
os.environ.update(_PARENT_ENV)

from tangram_jax.benchmarking.models import LLAMA_8B, TINY  # noqa: E402
from tangram_jax.benchmarking.results import resolve_outputs, write_result  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402

SHAPES = {"llama-8b": LLAMA_8B, "tiny": TINY}
SHARD_BYTES = 4 << 30


def hf_config(shape: dict, bos: int, eos: int) -> dict:
    """A Llama-3.1 config.json of `shape` (`benchmarking.models` names)."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama",
                vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                intermediate_size=shape["intermediate_size"],
                num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
                bos_token_id=bos, eos_token_id=eos)


def weight_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape ([out, in] for projections) of a Llama of `shape`."""
    d, f, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_heads"] * hd, shape["num_kv_heads"] * hd
    out = {"model.embed_tokens.weight": (shape["vocab_size"], d), "model.norm.weight": (d,),
           "lm_head.weight": (shape["vocab_size"], d)}
    for i in range(shape["num_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
    return out


def write_folder(folder: Path, shape: dict, tokenizer: Path, seed: int) -> float:
    """The model folder (module docstring); returns its weight bytes. Weights: normal with std
    0.02 (norms 1), drawn on the default JAX device, written in shards of ~4 GiB."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    tok = json.loads((folder / "tokenizer_config.json").read_text()) \
        if (folder / "tokenizer_config.json").is_file() else {}
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    ids = {t: i for t, i in (vocab.items() if isinstance(vocab, dict) else [])}
    bos = ids.get(tok.get("bos_token"), 1)
    eos = ids.get(tok.get("eos_token"), 2)
    # Every id of the tokenizer has a row (the tiny smoke-test shape's 512 would not).
    shape = dict(shape, vocab_size=max(shape["vocab_size"], len(ids) + 256))
    (folder / "config.json").write_text(json.dumps(hf_config(shape, bos, eos), indent=1))
    draw = jax.jit(lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    key, shard, size, index, total = jax.random.key(seed), {}, 0, {}, 0

    def flush():
        nonlocal shard, size
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name))
        index.update({k: name for k in shard})
        shard, size = {}, 0

    for i, (name, s) in enumerate(weight_shapes(shape).items()):
        w = np.ones(s, jnp.bfloat16) if len(s) == 1 else np.asarray(
            draw(jax.random.fold_in(key, i), s))
        shard[name] = w
        size += w.nbytes
        total += w.nbytes
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    return float(total)


SERVE = """
import json, sys, time
t0 = time.perf_counter()
from tangram_jax import LLM, SamplingParams
llm = LLM(sys.argv[1], mode="tangram", profile=sys.argv[2], max_model_len=int(sys.argv[4]))
built = time.perf_counter() - t0
words = ("the quick brown fox jumps over a lazy dog while " * 400).split()
text = " ".join(words[:int(sys.argv[3])])
t1 = time.perf_counter()
out = llm.chat([[{"role": "user", "content": "Summarise: " + text}]],
               SamplingParams(temperature=0.0, max_tokens=1))[0]
first = time.perf_counter() - t1
print(json.dumps(dict(construct_s=built, first_token_s=first, total_s=time.perf_counter() - t0,
                      prompt_tokens=len(out.prompt_token_ids))))
"""


def timed(cmd: list[str], env: dict, log: Path) -> tuple[float, int, str]:
    """(wall seconds, return code, last lines of output) of `cmd`."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    return time.perf_counter() - t0, rc, "\n".join(text.splitlines()[-15:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="folder of tokenizer.json (+ config)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--samples", type=int, default=50, help="pilot samples of the calibration")
    p.add_argument("--ratio", default="0.25")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--lengths", default=None, help="calibrate's --lengths (default: its own)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--workdir", default=None, help="where the folder, caches and profile go "
                   "(default: a fresh temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file under "
                   "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    out = resolve_outputs(p, args, {"out": f"new_model_path_{args.shape}"})[0]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="new_model_"))
    folder, profile = work / "model", work / "profile.json"
    t0 = time.perf_counter()
    nbytes = write_folder(folder, SHAPES[args.shape], Path(args.tokenizer), args.seed)
    import jax
    device = jax.devices()[0]
    result = dict(shape=args.shape, model=dict(SHAPES[args.shape], random_weights=True),
                  weight_bytes=nbytes, folder_write_s=time.perf_counter() - t0,
                  device_kind=device.device_kind, platform=device.platform,
                  what_is_timed="each step in a fresh process with an empty JAX compilation "
                                "cache and an empty model cache: calibrate (load, convert and "
                                "cache the folder, pilot samples, profile), then LLM(...) with "
                                "that profile and one greedy chat request to its first token",
                  steps={})
    write_result(out, "new_model_path", result)
    print(f"folder written: {nbytes / 2**30:.1f} GiB in {result['folder_write_s']:.1f} s",
          flush=True)
    env = {k: v for k, v in os.environ.items() if k not in _PARENT_ENV}
    env.update({k: v for k, v in _USER_ENV.items() if v is not None})
    env = dict(env, TANGRAM_JAX_CACHE=str(work / "model_cache"),
               TANGRAM_JAX_COMPILE_CACHE=str(work / "compile_cache"))
    calibrate = [sys.executable, "-c", "import sys; from tangram_jax.cli import main; "
                 "sys.exit(main())", "calibrate", "--model", str(folder), "--samples",
                 str(args.samples), "--ratio", args.ratio, "--group-size", str(args.group_size),
                 "--out", str(profile)] + (["--lengths", args.lengths] if args.lengths else [])
    seconds, rc, tail = timed(calibrate, env, work / "calibrate.log")
    result["steps"]["calibrate"] = dict(command=" ".join(calibrate[3:]), seconds=seconds, rc=rc,
                                        output_tail=tail)
    write_result(out, "new_model_path", result)
    print(f"calibrate: {seconds:.1f} s (rc {rc})", flush=True)
    if rc == 0:
        serve = [sys.executable, "-c", SERVE, str(folder), str(profile), str(args.prompt_tokens),
                 str(args.max_model_len)]
        seconds, rc, tail = timed(serve, env, work / "serve.log")
        figures = json.loads(tail.splitlines()[-1]) if rc == 0 else {}
        result["steps"]["serve"] = dict(seconds=seconds, rc=rc, **figures,
                                        **({} if rc == 0 else {"output_tail": tail}))
        result["calibrate_then_first_token_s"] = \
            result["steps"]["calibrate"]["seconds"] + seconds
        write_result(out, "new_model_path", result)
        print(f"serve: {seconds:.1f} s (rc {rc}) {figures}", flush=True)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
