"""kvpress as the outside reference: the harness's task samples through NVIDIA's kvpress presses.

Runs in kvpress's own environment (`bash benchmarks/kvpress_setup.sh` makes it and the Hugging
Face folder of the embedded SmolLM2 from the same GGUF the engine serves):

    .cache/kvpress-venv/bin/python benchmarks/kvpress_accuracy.py --samples 25
    .cache/kvpress-venv/bin/python benchmarks/kvpress_accuracy.py \
        --tasks-file benchmarks/results/accuracy_tasks_long.jsonl --samples 40 \
        --presses snapkv,snapkv+question,adakv_snapkv,expected_attention,kvzip

Reads the task JSONL that `tangram-jax bench accuracy` wrote (the same samples), and writes
`--out` (default a fresh file under benchmarks/results/runs/; the committed
accuracy_kvpress.json only with --overwrite) in the harness's shape (library "kvpress"), so one
table and one plot hold both libraries (`tangram_jax.evaluation.report`).

How kvpress compresses, and how that differs from the engine:
- kvpress compresses the *context* once, in one prefill, with the press as a forward hook:
  here the context is the chat-templated prompt up to the end of the context text, and the
  question, the answers and every later turn are appended uncompressed afterwards (its default
  question-agnostic mode, as in its own pipeline). SnapKV's observation window is therefore the
  last 64 tokens of the context, not the question.
- `--question-aware` adds each press with the first question inside the compressed prefill
  (mode `<press>+question`; for one press alone, name it `<press>+question` in `--presses`): the
  context and the first turn's question, up to its last token, are compressed together, so
  SnapKV's window holds the question, as the engine's whole-turn chunks (2048 tokens >= every
  first turn here) score it; later turns are appended uncompressed as in the question-agnostic
  mode.
- The engine compresses each turn chunk by chunk (`chunk_size` tokens) as it prefills, scoring
  each chunk with that chunk's last queries; how the current question is kept uncompressed until
  it is answered is the engine's retention rule (see `kv_layout.py`).
- kvpress's AdaKVPress masks the pruned entries (fake keys) instead of shrinking the cache;
  so does KVzipPress, which scores each context entry by the attention it gets while the model
  repeats the context after the prefill (query-agnostic; its budget is spread over layers and
  heads). FastKVzipPress is not offered: it loads gates trained per model from the Hub, and none
  is released for SmolLM2.
- Sessions: this script continues each session turn after turn on one cache (the previous answers
  stay in it, uncompressed) like the engine's sessions; kvpress's pipeline would instead answer
  each question separately after the context.

Teacher forcing for KL: each press is run again from the same compressed context (a copy of the
cache), fed full KV's answer tokens, and KL(full || press) is taken at every answer position over
the whole vocabulary (both distributions are in memory here).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Pure-Python pieces of the harness (no JAX import): the samples, the judging, the table.
from tangram_jax.evaluation.harness import (_Judged, answer_prefix_ids,  # noqa: E402
                                            followup_text, followup_token_ids, summarise)
from tangram_jax.evaluation.scoring import (is_correct, kl_full_vocabulary,  # noqa: E402
                                            token_agreement)
from tangram_jax.benchmarking.results import finish, resolve_outputs, start  # noqa: E402
from tangram_jax.commands import add_overwrite_flag  # noqa: E402
from tangram_jax.evaluation.tasks import read_jsonl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PRESSES = ("snapkv", "adakv_snapkv", "expected_attention", "streaming_llm", "kvzip")
# A press name with this suffix in --presses: that press with the first question compressed too.
QUESTION_SUFFIX = "+question"


class PressSpec:
    def __init__(self, mode: str, ratio: float, question_aware: bool = False):
        self.mode, self.ratio, self.question_aware = mode, ratio, question_aware
        self.mode_name = mode + (QUESTION_SUFFIX if question_aware else "")
        self.label = "full" if mode == "full" else f"{self.mode_name}@{ratio:g}"


def make_press(name: str, keep_ratio: float):
    """kvpress's compression_ratio is the share *removed*."""
    from kvpress import (AdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress,
                         StreamingLLMPress)
    removed = 1.0 - keep_ratio
    if name == "snapkv":
        return SnapKVPress(compression_ratio=removed)
    if name == "adakv_snapkv":
        return AdaKVPress(SnapKVPress(compression_ratio=removed))
    if name == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=removed)
    if name == "streaming_llm":
        return StreamingLLMPress(compression_ratio=removed)
    if name == "kvzip":
        return KVzipPress(compression_ratio=removed)
    raise ValueError(f"unknown press {name!r}; presses: {', '.join(PRESSES)}")


def press_modes(presses: str, question_aware: str) -> list[tuple[str, bool]]:
    """(press, question-aware) pairs from `--presses` (names, each optionally ending in
    `QUESTION_SUFFIX`) and `--question-aware` (the modes of names without the suffix)."""
    aware = {"no": (False,), "yes": (True,), "both": (False, True)}[question_aware]
    plain, suffixed = [], []
    for entry in filter(None, (e.strip() for e in presses.split(","))):
        name = entry.removesuffix(QUESTION_SUFFIX)
        if name not in PRESSES:
            raise ValueError(f"--presses: unknown press {entry!r}; allowed: "
                             f"{', '.join(PRESSES)}, each optionally ending in {QUESTION_SUFFIX}")
        if name == entry:
            plain.append(name)
        else:
            suffixed.append((name, True))
    modes = [(name, qa) for qa in aware for name in plain] + suffixed
    return list(dict.fromkeys(modes))


class Session:
    """One sample's chat on one (possibly compressed) cache; `pos` counts every token fed (the
    position of the next one), whatever the press removed. `context_ids` is what the prefill
    feeds (`open_sessions` runs it); `masks` the entries a head-wise press masks instead of
    removing (kvpress's `masked_key_indices` of each layer, set on the model around every forward
    of this session: they are per session, the model's attribute is shared)."""

    def __init__(self, model, tokenizer, sample, question_aware: bool = False):
        import torch

        self.model, self.tok, self.sample = model, tokenizer, sample
        self.torch = torch
        sep = "\u2063" * 4   # split marker the template leaves untouched, as kvpress does
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context + sep}], add_generation_prompt=True,
            tokenize=False)
        context_text, self.first_suffix = text.split(sep)
        self.pending: list[int] = []   # generated but not yet fed (the last answer token)
        self.first_turn_held: list[int] | None = None
        ids = tokenizer.encode(context_text, add_special_tokens=False)
        if question_aware:   # the first question joins the compressed prefill, but its last token
            self.first_turn_held = []
            first = self.turn_ids(0)
            ids, self.first_turn_held = ids + first[:-1], first[-1:]
        self.context_ids = torch.tensor([ids], device=model.device)
        self.cache, self.masks = None, None
        self.pos = self.context_tokens = len(ids)

    def with_cache(self, cache, masks=None) -> "Session":
        other = copy.copy(self)
        other.cache, other.masks, other.pending = cache, masks, list(self.pending)
        return other

    def clone(self) -> "Session":
        return self.with_cache(copy.deepcopy(self.cache), self.masks)

    def turn_ids(self, turn: int) -> list[int]:
        q = self.sample.turns[turn].question
        encode = lambda t: self.tok.encode(t, add_special_tokens=False)  # noqa: E731
        prefix = answer_prefix_ids(encode, self.sample.turns[turn].answer_prefix)
        if turn == 0:
            if self.first_turn_held is not None and len(self.first_turn_held):
                return list(self.first_turn_held)   # the rest is in the compressed prefill
            return encode("\n\n" + q + self.first_suffix) + prefix
        closing, opening = followup_text(
            lambda m, g: self.tok.apply_chat_template(m, add_generation_prompt=g, tokenize=False),
            q)
        # The pending token (the answer's last, not fed yet) goes first.
        return self.pending + followup_token_ids(encode, closing, opening, self.pending) + prefix

    def _forward(self, ids: list[int]):
        torch = self.torch
        x = torch.tensor([ids], device=self.model.device)
        positions = torch.arange(self.pos, self.pos + len(ids), device=self.model.device)[None]
        set_masks(self.model, self.masks)
        with torch.no_grad():
            out = self.model(input_ids=x, past_key_values=self.cache, position_ids=positions)
        self.pos += len(ids)
        return torch.log_softmax(out.logits[0].float(), dim=-1)

    def answer(self, turn: int, max_tokens: int, eos: set[int], forced: list[int] | None = None):
        """Greedy answer (or the forced tokens); returns (tokens, log-probs [T, V] numpy)."""
        ids = self.turn_ids(turn)
        self.pending = []
        if forced is not None:
            lp = self._forward(ids + forced[:-1])[len(ids) - 1:]
            self.pending = forced[-1:]
            return list(forced), lp.cpu().numpy()
        rows, tokens = [], []
        lp = self._forward(ids)[-1]
        while True:
            rows.append(lp)
            t = int(lp.argmax())
            tokens.append(t)
            if t in eos or len(tokens) >= max_tokens:
                break
            lp = self._forward([t])[-1]
        self.pending = tokens[-1:]
        return tokens, self.torch.stack(rows).cpu().numpy()


def set_masks(model, masks: list | None) -> None:
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.masked_key_indices = None if masks is None else masks[i]


def take_masks(model) -> list | None:
    """The masks a press left on the model after a prefill (cleared there)."""
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    set_masks(model, None)
    return masks if any(m is not None for m in masks) else None


def open_sessions(model, tokenizer, sample, specs: list[PressSpec]) -> dict[str, Session]:
    """Every spec's session on `sample`, its context prefilled and compressed.

    kvpress compresses in a forward hook that runs after each attention layer has computed its
    output, so the prefill's activations do not depend on the press: one prefill (per
    question-aware mode) serves full KV and every press that uses kvpress's standard hook, each
    press's own `forward_hook` compressing its own copy of each layer's keys and values. KVzip
    scores by reconstructing the context after its prefill, whatever the ratio: one run scores,
    and kvpress's eviction is applied at each ratio. Any other press gets its own prefill."""
    import torch
    from kvpress import BasePress
    from transformers import DynamicCache

    sessions = {}
    for aware in dict.fromkeys(spec.question_aware for spec in specs):
        group = [spec for spec in specs if spec.question_aware == aware]
        bare = Session(model, tokenizer, sample, aware)
        hooked, kvzip, own = [], [], []
        for spec in group:
            if spec.mode == "kvzip":
                kvzip.append(spec)
            elif spec.mode != "full":
                press = make_press(spec.mode, spec.ratio)
                (hooked if type(press).__call__ is BasePress.__call__ else own).append(
                    (spec, press))
        with torch.no_grad():
            shared = DynamicCache()
            copies = [(spec, press, DynamicCache(), [None] * len(model.model.layers))
                      for spec, press in hooked]
            with _fan_out(model, [(press, cache, masks) for _, press, cache, masks in copies]):
                model.model(input_ids=bare.context_ids, past_key_values=shared)
            for spec, _, cache, masks in copies:
                sessions[spec.label] = bare.with_cache(
                    cache, masks if any(m is not None for m in masks) else None)
            if any(spec.mode == "full" for spec in group):
                sessions["full"] = bare.with_cache(shared)
            if kvzip:
                press = _kvzip_at_ratios([1.0 - spec.ratio for spec in kvzip])
                cache = DynamicCache()
                with press(model):
                    model.model(input_ids=bare.context_ids, past_key_values=cache)
                for spec in kvzip:
                    sessions[spec.label] = bare.with_cache(copy.deepcopy(cache),
                                                           press.masks[1.0 - spec.ratio])
            for spec, press in own:
                cache = DynamicCache()
                with press(model):
                    model.model(input_ids=bare.context_ids, past_key_values=cache)
                sessions[spec.label] = bare.with_cache(cache, take_masks(model))
    return sessions


@contextlib.contextmanager
def _fan_out(model, targets: list):
    """During one prefill, each (press, cache, masks) of `targets` gets a copy of every layer's
    keys and values in its `cache` and compresses it with its own `forward_hook`, as inside
    `with press(model)` (whose setup, `post_init_from_model` and the layers' `rotary_emb`, is
    repeated here); a head-wise press's masks land in `masks[layer]`."""
    layers = model.model.layers
    for press, _, _ in targets:
        press.post_init_from_model(model)
    for layer in layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb

    def hook(module, args, kwargs, output):
        i = module.layer_idx
        full = kwargs["past_key_values"].layers[i]
        for press, cache, masks in targets:
            cache.update(full.keys.clone(), full.values.clone(), i)
            module.masked_key_indices = None
            press.forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
            masks[i] = getattr(module, "masked_key_indices", None)
        module.masked_key_indices = None
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _kvzip_at_ratios(removed: list[float]):
    """kvpress's KVzipPress, scoring once and evicting at each share `removed`; `press.masks`
    maps each share to its masks after the run."""
    import dataclasses

    from kvpress import KVzipPress

    @dataclasses.dataclass
    class KVzipAtRatios(KVzipPress):
        removed_shares: tuple = ()

        def compress_post(self, model):
            self.masks = {}
            for share in self.removed_shares:
                self.compression_ratio = share
                super().compress_post(model)
                self.masks[share] = take_masks(model)

    return KVzipAtRatios(compression_ratio=max(removed), removed_shares=tuple(removed))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks-file", default=str(RESULTS / "accuracy_tasks.jsonl"))
    p.add_argument("--model-dir", default=str(ROOT / ".cache" / "smollm2-135m-hf"))
    p.add_argument("--samples", type=int, default=100, help="samples per task (first N)")
    p.add_argument("--presses", default=",".join(PRESSES),
                   help=f"comma-separated, of {', '.join(PRESSES)}; a name ending in "
                        f"{QUESTION_SUFFIX} is that press question-aware")
    p.add_argument("--ratios", default="0.5,0.25", help="keep ratios")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-kl", action="store_true")
    p.add_argument("--question-aware", choices=("no", "yes", "both"), default="no",
                   help="presses with the first question inside the compressed prefill: no, "
                        "yes (only those), both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                   help="serve only the samples K, K+N, K+2N, ... of the round robin over the "
                        "tasks (N processes side by side, then --merge)")
    p.add_argument("--merge", nargs="+", metavar="PART", default=None,
                   help="serve nothing: merge the JSONs of one run's processes (presses or "
                        "shards, complete or cut short) into --out, each row over the samples "
                        "its parts finished; full KV must answer alike wherever two parts "
                        "served the same sample")
    p.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(p)
    args = p.parse_args(argv)
    if args.merge:
        outputs = resolve_outputs(p, args, {"out": "kvpress_accuracy"})
        run = start("kvpress_accuracy", outputs, argv)
        try:
            report = merge_parts([json.loads(Path(f).read_text()) for f in args.merge])
        except ValueError as e:
            p.error(str(e))
        report["command"] = " ".join([Path(sys.argv[0]).name] + sys.argv[1:])
        Path(args.out).write_text(json.dumps(report, indent=1))
        from tangram_jax.evaluation.report import markdown_table
        print(markdown_table(report))
        finish(run)
        return 0
    try:
        modes = press_modes(args.presses, args.question_aware)
    except ValueError as e:
        p.error(str(e))
    outputs = resolve_outputs(p, args, {"out": "kvpress_accuracy"})
    run = start("kvpress_accuracy", outputs, argv)

    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"error: --model-dir {model_dir} holds no Hugging Face model; run "
              "benchmarks/kvpress_setup.sh first", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval().to(args.device)
    eos = set(model.generation_config.eos_token_id if isinstance(
        model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])
    eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    everything = read_jsonl(args.tasks_file)
    tasks = list(dict.fromkeys(s.task for s in everything))
    per_task = [[x for x in everything if x.task == t][:args.samples] for t in tasks]
    # Round robin over the tasks: a run stopped by a time limit has covered every task alike.
    samples = [group[i] for i in range(max(map(len, per_task))) for group in per_task
               if i < len(group)][args.shard[0]::args.shard[1]]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    specs = [PressSpec("full", 1.0)] + [PressSpec(name, r, qa) for name, qa in modes
                                        for r in ratios]
    judged = {s.label: {} for s in specs}
    t0 = time.perf_counter()
    for i, sample in enumerate(samples):
        sessions = open_sessions(model, tok, sample, specs)
        ref = sessions["full"]
        ref_tokens, ref_lp = [], []
        for turn in range(len(sample.turns)):
            tokens, lp = ref.answer(turn, args.max_tokens, eos)
            ref_tokens.append(tokens)
            ref_lp.append(lp)
            judged["full"][(sample.id, turn)] = _Judged(
                is_correct(sample.turns[turn].answer, tok.decode(tokens, skip_special_tokens=True)))
        for spec in specs[1:]:
            session = sessions[spec.label]
            forced_session = None if args.no_kl else session.clone()
            for turn in range(len(sample.turns)):
                tokens, _ = session.answer(turn, args.max_tokens, eos)
                j = _Judged(is_correct(sample.turns[turn].answer,
                                       tok.decode(tokens, skip_special_tokens=True)),
                            agreement=token_agreement(ref_tokens[turn], tokens),
                            exact=ref_tokens[turn] == tokens)
                if forced_session is not None:
                    _, lp = forced_session.answer(turn, args.max_tokens, eos,
                                                  forced=ref_tokens[turn])
                    kl = kl_full_vocabulary(ref_lp[turn], lp)
                    j.kl_sum, j.kl_positions = float(kl.sum()), int(kl.size)
                judged[spec.label][(sample.id, turn)] = j
        print(f"[{i + 1}/{len(samples)}] {sample.id} ({time.perf_counter() - t0:.0f}s)",
              flush=True)
        # After every sample: a run stopped early keeps the samples it finished.
        write(summarise(samples[:i + 1], specs, judged, library="kvpress"), args, t0,
              complete=i + 1 == len(samples), specs=specs, judged=judged)
    report = write(summarise(samples, specs, judged, library="kvpress"), args, t0, complete=True,
                   specs=specs, judged=judged)
    from tangram_jax.evaluation.report import markdown_table
    print(markdown_table(report))
    print(f"wrote {args.out}")
    finish(run)
    return 0


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected K/N with 0 <= K < N, "
                                         "e.g. 0/4")
    return k, n


def merge_parts(parts: list[dict]) -> dict:
    """One report from the JSONs of one run's processes (`write` gives each its per-answer
    records): every (press, ratio) row is summarised again over the samples its parts finished,
    in the tasks file's order, so shards add up and a part cut short by a time limit still
    counts what it served. Raises ValueError when the parts are of different runs (device,
    revision, tasks file, answer length) or full KV answered a sample differently in two
    parts (greedy and deterministic: a difference means they did not serve the same thing)."""
    for key in ("device", "git_revision"):
        values = sorted({str(part.get(key)) for part in parts})
        if len(values) > 1:
            raise ValueError(f"--merge: parts disagree on {key}: {values}; merge one run's parts")
    for key in ("tasks_file", "max_tokens", "no_kl"):
        values = sorted({str(part["config"].get(key)) for part in parts})
        if len(values) > 1:
            raise ValueError(f"--merge: parts disagree on {key}: {values}; merge one run's parts")
    if any("answers" not in part for part in parts):
        raise ValueError("--merge: a part holds no per-answer records (written before "
                         "kvpress_accuracy.py kept them); serve it again")
    everything = read_jsonl(parts[0]["config"]["tasks_file"])
    order = {s.id: i for i, s in enumerate(everything)}
    by_id = {s.id: s for s in everything}
    specs: dict[str, PressSpec] = {}
    judged: dict[str, dict[tuple[str, int], _Judged]] = {}
    for part in parts:
        for spec in part["specs"]:
            specs.setdefault(spec["label"], PressSpec(spec["mode"], spec["ratio"],
                                                      spec["question_aware"]))
        for rec in part["answers"]:
            rows = judged.setdefault(rec["label"], {})
            key = (rec["sample"], rec["turn"])
            j = _Judged(**{f.name: rec[f.name] for f in dataclasses.fields(_Judged)})
            if key in rows and rows[key].correct != j.correct:
                raise ValueError(f"--merge: parts disagree on {rec['label']} {key}: correct "
                                 f"{rows[key].correct} vs {j.correct}")
            rows.setdefault(key, j)
    labels = sorted(specs, key=lambda label: label != "full")   # full first, then as served
    results, checks = [], []
    for label in labels:
        ids = sorted({sid for sid, _ in judged.get(label, {})}, key=order.__getitem__)
        done = [by_id[sid] for sid in ids
                if all((sid, t) in judged[label] for t in range(len(by_id[sid].turns)))]
        if not done:
            continue
        table = summarise(done, [specs[label]], judged, library="kvpress")
        results += table["results"]
        if label == "full":
            checks = table["checks"]
    first = parts[0]
    return {**{k: first.get(k) for k in ("benchmark", "device", "git_revision", "kvpress_version",
                                         "transformers_version", "torch_version", "kl_status")},
            "config": {k: v for k, v in first["config"].items()
                       if k not in ("presses", "shard", "out", "merge")},
            "parts": [{"command": part.get("command"), "seconds": part.get("seconds"),
                       "complete": part.get("complete")} for part in parts],
            "seconds": max(part.get("seconds") or 0 for part in parts),
            "complete": all(part.get("complete") for part in parts),
            "results": results, "checks": checks,
            # Every answer kept, so the merged run compares sample by sample with another.
            "specs": list({spec["label"]: spec for part in parts
                           for spec in part["specs"]}.values()),
            "answers": [{"label": label, "sample": sid, "turn": turn, **dataclasses.asdict(j)}
                        for label, rows in judged.items() for (sid, turn), j in rows.items()]}


def write(table: dict, args, t0: float, complete: bool, specs: list[PressSpec],
          judged: dict[str, dict[tuple[str, int], _Judged]]) -> dict:
    import kvpress
    import torch

    from tangram_jax.provenance import git_revision   # pure Python; GIT_REV on a copied tree

    rev = git_revision() or "unknown"
    report = {
        "benchmark": "accuracy_kvpress",
        "device": (f"gpu: {torch.cuda.get_device_name()} (torch {torch.__version__})"
                   if args.device.startswith("cuda") else
                   f"CPU: {platform.processor() or platform.machine()} (torch "
                   f"{torch.__version__}, {args.threads} threads)"),
        "git_revision": rev,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "config": vars(args),
        "kvpress_version": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
        "transformers_version": _dist_version("transformers"),
        "torch_version": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "kl_status": "measured (full vocabulary)" if not args.no_kl else "not requested",
        "complete": complete,
        **table,
        # What --merge needs to add this run to others: every answer's judgement.
        "specs": [{"label": spec.label, "mode": spec.mode, "ratio": spec.ratio,
                   "question_aware": spec.question_aware} for spec in specs],
        "answers": [{"label": label, "sample": sid, "turn": turn, **dataclasses.asdict(j)}
                    for label, rows in judged.items() for (sid, turn), j in rows.items()],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
