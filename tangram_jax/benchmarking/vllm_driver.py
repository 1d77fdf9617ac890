"""vLLM's side of `bench serve`: run in vLLM's own virtual environment (its pins clash with
ours), it serves the sessions of a JSON file through vLLM's offline engine
(`LLM(...).llm_engine`: add_request / step) with the same session loop as ours
(`session_loop.py`, loaded by path), and writes each turn's record.

Stateless, as vLLM's API is: every turn sends the session's whole history (earlier prompts and
answers) plus the new tokens; automatic prefix caching finds the history's KV when it is still
cached. The KV memory is `VLLM_CPU_KVCACHE_SPACE` (GiB), set by the caller.

    VLLM_CPU_KVCACHE_SPACE=1 /work/venvs/vllm-cpu/bin/python vllm_driver.py --model FOLDER \
        --sessions sessions.json --max-model-len 4096 --out out.json
"""

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path


def _session_loop():
    path = Path(__file__).with_name("session_loop.py")
    spec = importlib.util.spec_from_file_location("session_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["session_loop"] = module     # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class VLLMAdapter:
    def __init__(self, engine, answer_tokens):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.engine = engine
        self.params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True,
                                     output_kind=RequestOutputKind.CUMULATIVE)
        self.steps = 0
        self.peak_batch = 0

    def submit(self, request_id, session_id, turn, history, new):
        self.engine.add_request(request_id, {"prompt_token_ids": history + new}, self.params)

    def step(self):
        outs = self.engine.step()
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(outs))
        return [(o.request_id, list(o.outputs[0].token_ids), o.finished,
                 o.num_cached_tokens or 0) for o in outs]

    def has_work(self):
        return self.engine.has_unfinished_requests()

    def end_session(self, session_id):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sessions", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import vllm
    from vllm import LLM

    loop = _session_loop()
    spec = json.loads(Path(args.sessions).read_text())
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=True, enable_prefix_caching=True, seed=0)
    engine = llm.llm_engine
    answer = spec["warm"][0]["answer_tokens"]
    loop.drive(spec["warm"], VLLMAdapter(engine, answer))
    build = time.perf_counter() - t0
    results = []
    for w in spec["workloads"]:
        adapter = VLLMAdapter(engine, w["sessions"][0]["answer_tokens"])
        # A fresh prefix cache per workload: nothing of an earlier run's sessions is reused.
        llm.reset_prefix_cache()
        records, seconds = loop.drive(w["sessions"], adapter)
        results.append({"name": w["name"], "seconds": seconds, "steps": adapter.steps,
                        "peak_batch": adapter.peak_batch,
                        "records": [dataclasses.asdict(r) for r in records]})
        print(f"vllm {w['name']}: {len(records)} turns in {seconds:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps({"vllm_version": vllm.__version__,
                                          "build_seconds": build, "workloads": results}))


if __name__ == "__main__":
    main()
