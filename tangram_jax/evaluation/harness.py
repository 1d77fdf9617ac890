"""The accuracy harness: serve the task samples through the engine in every mode, judge them, and
compare each compressed mode with full KV.

One `Engine` per (mode, ratio) serves every sample as a session, many at a time
(`serve_sessions`): all first turns are queued, the engine steps, and a session's next question is
queued as soon as its previous answer is done, continuing the same engine session (its compressed
KV). Sessions are admitted `max_active` at a time, and the pool holds `max_active` full-length
sessions, so nothing is preempted or evicted (both are counted and reported: an evicted session
would lose its context).

Fidelity to full KV:
- agreement: the mode's own greedy answer against full KV's, token by token (`token_agreement`);
- KL: the mode is teacher-forced with full KV's answer tokens (`Engine.add_request(...,
  forced_token_ids=...)`) and returns its log-probabilities (`SamplingParams(logprobs=-1)`);
  KL(full || mode) is taken at every answer position and averaged over positions. Full KV's
  distributions are kept as top-k plus the rest (`scoring.TopKDistribution`).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import time
from collections.abc import Callable

import numpy as np

from tangram_jax.benchmarking.results import duration_words
from tangram_jax.evaluation.scoring import (TopKDistribution, is_correct, kl_from_reference,
                                            token_agreement, wilson_interval)
from tangram_jax.evaluation.tasks import LADDERS, Sample, TaskSizes, generate

MODES = ("full", "tangram", "dynamic", "uniform")
# A task full KV answers less often than this does not test compression (the model cannot do it).
SOLVABLE_ACCURACY = 0.5
# What the size pilot asks of full KV, with a margin over SOLVABLE_ACCURACY for sampling noise.
PILOT_ACCURACY = 0.65
# Pilot samples come from a seed range disjoint from the table's.
PILOT_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """One column of the table: `mode` (full, tangram = the shipped calibrated profile, dynamic =
    per-input Ada-SnapKV, uniform = every head keeps `ratio`) at keep ratio `ratio`, with KV
    pages of `kv_precision` (`EngineConfig.kv_precision`; full KV, the reference, is bf16;
    precision tiers need tangram mode, whose shipped profiles carry tier budgets). On the
    command line a mode names its precision after a ``+``: ``tangram+k8v4-k4v2``."""

    mode: str
    ratio: float
    kv_precision: str = "bf16"

    def __post_init__(self):
        from tangram_jax.engine.config import check_precision
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must lie in (0, 1], got {self.ratio}")
        if self.mode == "full" and self.ratio != 1:
            raise ValueError(f"full KV keeps everything: its ratio is 1, got {self.ratio}")
        # A uniform top-k serves in tangram mode but its profile has no tier budgets: refused
        # with tiers as the other modes are.
        check_precision(self.mode, self.kv_precision, f"mode {self.mode}+{self.kv_precision}")
        if self.mode == "full" and self.kv_precision != "bf16":
            raise ValueError(f"full KV is the bf16 reference every mode is compared with, got "
                             f"full+{self.kv_precision}")

    @classmethod
    def parse(cls, name: str, ratio: float) -> "ModeSpec":
        """``mode`` or ``mode+precision`` at `ratio`."""
        mode, plus, precision = name.partition("+")
        return cls(mode, ratio, precision if plus else "bf16")

    @property
    def mode_name(self) -> str:
        """The mode as the command line and the table name it (``tangram+k8v4-k4v2``)."""
        return self.mode if self.kv_precision == "bf16" else f"{self.mode}+{self.kv_precision}"

    @property
    def label(self) -> str:
        if self.mode == "full":
            return "full"
        suffix = "" if self.kv_precision == "bf16" else f"+{self.kv_precision}"
        return f"{self.mode}{suffix}@{self.ratio:g}"


def mode_specs(modes: list[str], ratios: list[float]) -> list[ModeSpec]:
    """full once (ratio 1), then every other mode at every ratio below 1. A ratio of 1 for a
    compressing mode is kept only for uniform (an equality check against full: the same kernels
    keeping every token); tangram has no profile at 1 and dynamic at 1 keeps everything too."""
    specs = [ModeSpec("full", 1.0)] if "full" in modes else []
    # Lowest ratio first: where compression bites most is measured first if a run is cut short.
    for r in sorted(ratios):
        for mode in modes:
            base = mode.partition("+")[0]
            if base != "full" and (r < 1 or base == "uniform"):
                specs.append(ModeSpec.parse(mode, float(r)))
            elif base == "full" and mode != "full":
                ModeSpec.parse(mode, 1.0)   # full+<precision>: refused with its reason
    return specs


def missing_logprob_api() -> str | None:
    """None when the engine takes `forced_token_ids` and `SamplingParams(logprobs=-1)` (what the
    KL needs), else a sentence saying what is missing."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.sampling import SamplingParams

    missing = []
    if "logprobs" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        missing.append("SamplingParams(logprobs=...)")
    if "forced_token_ids" not in inspect.signature(Engine.add_request).parameters:
        missing.append("Engine.add_request(forced_token_ids=...)")
    if not missing:
        return None
    return (f"this engine lacks {' and '.join(missing)} (per-token log-probabilities and teacher "
            "forcing), so KL to full KV is not measured; accuracy and greedy agreement are")


# ----- serving -------------------------------------------------------------------------------


@dataclasses.dataclass
class TurnOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None


def followup_text(render: Callable[[list[dict], bool], str], question: str) -> tuple[str, str]:
    """What continues a session after the model's answer, as the chat template spells it: the
    end of the assistant turn and the next user turn up to the assistant's prompt. Derived from
    the template by difference (`render(messages, add_generation_prompt)` -> text), so any chat
    format works; the kvpress script uses it with transformers' template."""
    user = {"role": "user", "content": "x"}
    answered = [user, {"role": "assistant", "content": ""}]
    closing = render(answered, False)[len(render([user], True)):]
    opening = render(answered + [{"role": "user", "content": question}], True)[
        len(render(answered, False)):]
    return closing, opening


def followup_token_ids(encode: Callable[[str], list[int]], closing: str, opening: str,
                       previous_tokens: list[int]) -> list[int]:
    """Token ids of `followup_text`, without the end-of-turn token when the answer already
    ended with it (`previous_tokens`: the answer's tokens)."""
    closing_ids = encode(closing)
    if previous_tokens and closing_ids and previous_tokens[-1] == closing_ids[0]:
        closing_ids = closing_ids[1:]
    return closing_ids + encode(opening)


def answer_prefix_ids(encode: Callable[[str], list[int]], prefix: str) -> list[int]:
    """The turn's answer prefix as tokens of its own, appended after the generation prompt
    (tokenised apart so both libraries cut it the same way)."""
    return encode(prefix) if prefix else []


def _followup_token_ids(tokenizer, sample: Sample, turn: int,
                        previous_tokens: list[int]) -> list[int]:
    closing, opening = followup_text(tokenizer.render_chat, sample.turns[turn].question)
    encode = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    return (followup_token_ids(encode, closing, opening, previous_tokens)
            + answer_prefix_ids(encode, sample.turns[turn].answer_prefix))


def first_turn_token_ids(tokenizer, sample: Sample) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": sample.user_message(0)}],
                                        add_generation_prompt=True)
    return list(ids) + answer_prefix_ids(lambda t: tokenizer.encode(t, add_special_tokens=False),
                                         sample.turns[0].answer_prefix)


def session_lengths(tokenizer, samples: list[Sample], max_tokens: int) -> list[int]:
    """Upper bound of each sample's session length in tokens (every answer max_tokens long)."""
    out = []
    for s in samples:
        n = len(first_turn_token_ids(tokenizer, s)) + max_tokens
        for t in range(1, len(s.turns)):
            n += len(_followup_token_ids(tokenizer, s, t, [])) + max_tokens
        out.append(n)
    return out


# The cost model of `estimate_seconds`, measured on a 2-core CPU shared with other work (float32,
# chunk 128, 8 sessions of ~1,250 tokens at once; full KV 190 s, tangram@0.5 148 s served and
# 104 s teacher-forced, builds 7-15 s): seconds a session token costs a configuration's free
# run (full KV's with log-probabilities), its teacher-forced KL pass, and an engine build.
CPU_SERVE_SECONDS_PER_TOKEN = 0.017
CPU_FORCED_SECONDS_PER_TOKEN = 0.010
CPU_BUILD_SECONDS = 10.0
# After full KV, the others' cost relative to its free run (the same measurement).
OTHER_SERVE_OVER_FULL = 0.8
FORCED_OVER_FULL = 0.55


def estimate_seconds(session_tokens: int, num_specs: int, kl: bool) -> float:
    """A CPU run's seconds by the cost model above: `num_specs` configurations (full KV
    first), each serving sessions of `session_tokens` tokens in all (`session_lengths`), each
    but full KV teacher-forced again for the KL when `kl`."""
    per_spec = session_tokens * CPU_SERVE_SECONDS_PER_TOKEN + CPU_BUILD_SECONDS
    forced = session_tokens * CPU_FORCED_SECONDS_PER_TOKEN if kl else 0.0
    return num_specs * per_spec + (num_specs - 1) * forced


def remaining_after_full(full_seconds: float, build_seconds: float, others: int,
                         kl: bool) -> float:
    """Seconds the `others` configurations after full KV will take, from full KV's measured
    free run (`full_seconds`) and build."""
    per_spec = build_seconds + full_seconds * (OTHER_SERVE_OVER_FULL + (FORCED_OVER_FULL if kl
                                                                       else 0.0))
    return others * per_spec


def serve_sessions(engine, samples: list[Sample], *, max_tokens: int, max_active: int,
                   forced: dict[tuple[str, int], list[int]] | None = None,
                   logprobs: bool = False,
                   on_turn: Callable[[Sample, int, object], None] | None = None,
                   progress: Callable[[int], None] | None = None) -> dict[str, list[TurnOutput]]:
    """Serve every sample as one session of `engine`; returns each sample's turn outputs.

    forced: (sample id, turn) -> tokens to teacher-force as that turn's answer (then later turns
    continue after the forced answer). logprobs: ask for full log-probabilities, handed to
    `on_turn(sample, turn, RequestOutput)` as each turn finishes (and not kept here).
    """
    from tangram_jax.sampling import SamplingParams

    queue = collections.deque(samples)
    live: dict[str, tuple[Sample, int]] = {}     # request id -> (sample, turn)
    results: dict[str, list[TurnOutput]] = {s.id: [] for s in samples}
    sessions = 0

    def submit(sample: Sample, turn: int, token_ids: list[int]) -> None:
        kwargs = {}
        params = dict(temperature=0.0, max_tokens=max_tokens)
        if forced is not None:
            tokens = forced[(sample.id, turn)]
            kwargs["forced_token_ids"] = list(tokens)
            params["max_tokens"] = max(1, len(tokens))
        if logprobs:
            params["logprobs"] = -1
        rid = engine.add_request(request_id=f"{sample.id}/t{turn}", prompt_token_ids=token_ids,
                                 sampling_params=SamplingParams(**params),
                                 session_id=sample.id, **kwargs)
        live[rid] = (sample, turn)

    while queue or live:
        while queue and sessions < max_active:
            sample = queue.popleft()
            submit(sample, 0, first_turn_token_ids(engine.tokenizer, sample))
            sessions += 1
        for out in engine.step():
            if not out.finished:
                continue
            sample, turn = live.pop(out.request_id)
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            completion = out.outputs[0]
            results[sample.id].append(TurnOutput(completion.text, list(completion.token_ids),
                                                 completion.finish_reason))
            if on_turn is not None:
                on_turn(sample, turn, out)
            if turn + 1 < len(sample.turns):
                submit(sample, turn + 1, _followup_token_ids(
                    engine.tokenizer, sample, turn + 1, completion.token_ids))
            else:
                engine.end_session(sample.id)
                sessions -= 1
                if progress is not None:
                    progress(1)
    return results


def _progress_log(label: str, total: int, log: Callable[[str], None],
                  every_s: float = 60.0) -> Callable[[int], None]:
    """A `serve_sessions` progress callback that logs sessions done at most once a minute (a
    long column then shows whether it is serving or stuck)."""
    done, started = 0, time.perf_counter()
    last = started

    def progress(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.perf_counter()
        if now - last >= every_s and done < total:
            last = now
            log(f"{label}: {done}/{total} sessions in {now - started:.0f}s")
    return progress


# ----- one table -----------------------------------------------------------------------------


@dataclasses.dataclass
class HarnessConfig:
    model: str | None = None
    max_tokens: int = 16
    max_active: int = 16
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    group_size: int = 1
    # None: the longest session's bound; a fixed value lets engines of different runs (the size
    # pilot's and the table's full KV) compile to the same programs (JAX's compilation cache).
    max_model_len: int | None = None
    kl: bool = True
    kl_top_k: int = 256
    # EngineConfig.scoring_rule of the engines that compress with a static profile (tangram,
    # uniform); None: the engine's default ("auto"). dynamic counts with the window's scores.
    scoring_rule: str | None = None
    # EngineConfig.retention of the same engines (None: "auto"); dynamic compresses per chunk.
    retention: str | None = None
    # Budget profile files the tangram mode serves instead of the shipped ones, each at its own
    # ratio (its rho), e.g. one calibrated with KeyDiff: the engine then scores with KeyDiff.
    profiles: tuple[str, ...] = ()

    def __post_init__(self):
        from tangram_jax.compression.profile import BudgetProfile
        rhos = [BudgetProfile.load(p).rho for p in self.profiles]
        if len(set(rhos)) != len(rhos):
            raise ValueError(f"profiles must have one file per ratio, got rho {rhos} for "
                             f"{list(self.profiles)}")


def harness_tokenizer(cfg: HarnessConfig, loaded=None):
    """The tokenizer the engines of `cfg` format chats with: the model's (`loaded`, else
    loaded now), with `engine_kwargs["chat_template"]` in place of its template if given."""
    from tangram_jax.models.registry import load_model
    from tangram_jax.models.tokenizer import load_chat_template

    tokenizer = (loaded or load_model(cfg.model)).tokenizer
    if cfg.engine_kwargs.get("chat_template") is not None:
        tokenizer.use_chat_template(load_chat_template(cfg.engine_kwargs["chat_template"]))
    return tokenizer


def _engine_config(spec: ModeSpec, cfg: HarnessConfig, max_model_len: int, fingerprint: dict):
    from tangram_jax.compression.profile import BudgetProfile, shipped_profile
    from tangram_jax.engine.config import EngineConfig

    profile = None
    mode = spec.mode
    if spec.mode == "tangram":
        from tangram_jax.kv_layout import PRECISION_TIERS
        tiers = spec.kv_precision if spec.kv_precision in PRECISION_TIERS else None
        given = [BudgetProfile.load(p, expected_fingerprint=fingerprint) for p in cfg.profiles]
        profile = next((p for p in given if p.rho == spec.ratio), None) or shipped_profile(
            spec.ratio, cfg.group_size, expected_fingerprint=fingerprint, tiers=tiers)
    elif spec.mode == "uniform":
        profile = BudgetProfile.uniform(fingerprint, spec.ratio, group_size=cfg.group_size)
        mode = "tangram"
    page = cfg.engine_kwargs.get("page_size", 16)
    kwargs = dict(cfg.engine_kwargs)
    kwargs.setdefault("max_num_seqs", cfg.max_active)
    # The pool holds every admitted session at full length in every mode: no preemption, no
    # eviction, whatever the mode keeps (unless the caller sized it another way).
    if not any(kwargs.get(k) is not None for k in ("num_pages", "kv_cache_memory_bytes")):
        kwargs.setdefault("kv_cache_tokens", cfg.max_active * max_model_len)
    # Offline: compile the step shapes as the sessions meet them. The GPU's default warm-up
    # compiles every flat-token bucket x prefill row count of full KV's whole-row prefill (and
    # its write program): dozens of 30-layer programs, minutes per engine, most never met here.
    kwargs.setdefault("warmup", False)
    if cfg.scoring_rule is not None and spec.mode in ("tangram", "uniform"):
        kwargs["scoring_rule"] = cfg.scoring_rule
    if cfg.retention is not None and spec.mode in ("tangram", "uniform"):
        kwargs["retention"] = cfg.retention
    return EngineConfig(model=cfg.model, mode=mode, ratio=spec.ratio, profile=profile,
                        kv_precision=spec.kv_precision,
                        max_model_len=-(-max_model_len // page) * page, **kwargs)


@dataclasses.dataclass
class _Judged:
    correct: bool
    agreement: float | None = None
    exact: bool | None = None
    kl_sum: float = 0.0
    kl_positions: int = 0
    uncovered_sum: float = 0.0


def run_table(samples: list[Sample], specs: list[ModeSpec], cfg: HarnessConfig,
              log: Callable[[str], None] = print,
              on_partial: Callable[[dict], None] | None = None,
              on_answers: Callable[[str, dict[str, list[TurnOutput]]], None] | None = None
              ) -> dict:
    """Serve `samples` in every spec (full first) and return the table (see `summarise`).
    `on_partial(table)` gets the table of the specs done so far after each one (a run cut short
    by a time limit still leaves its finished columns); `on_answers(label, outputs)` every
    answer of a spec's free run (sample id -> its turns), e.g. to compare runs answer by
    answer."""
    from tangram_jax.engine.llm_engine import Engine
    from tangram_jax.models.registry import load_model

    if not specs or specs[0].mode != "full":
        raise ValueError("the first spec must be full KV: every other mode is compared with it")
    loaded = load_model(cfg.model)
    tokenizer, fingerprint = harness_tokenizer(cfg, loaded), loaded.config.fingerprint()
    del loaded
    max_model_len = max(session_lengths(tokenizer, samples, cfg.max_tokens))
    if cfg.max_model_len is not None:
        if cfg.max_model_len < max_model_len:
            raise ValueError(f"max_model_len {cfg.max_model_len} is below the longest session's "
                             f"{max_model_len} tokens (answers of max_tokens {cfg.max_tokens})")
        max_model_len = cfg.max_model_len
    kl_missing = missing_logprob_api() if cfg.kl else "KL not requested (--no-kl)"
    if kl_missing:
        log(f"note: {kl_missing}")
    reference: dict[tuple[str, int], TurnOutput] = {}
    ref_dist: dict[tuple[str, int], TopKDistribution] = {}
    judged: dict[str, dict[tuple[str, int], _Judged]] = {}
    engines_info = {}
    for spec in specs:
        t0 = time.perf_counter()
        engine = Engine(_engine_config(spec, cfg, max_model_len, fingerprint))
        build_s = time.perf_counter() - t0
        log(f"{spec.label}: built {build_s:.1f}s ({engine.resolved.scoring_rule} scoring), "
            f"serving {len(samples)} sessions")
        want_ref_logprobs = spec.mode == "full" and not kl_missing

        def keep_reference(sample, turn, out):
            ref_dist[(sample.id, turn)] = TopKDistribution.from_logprobs(
                out.outputs[0].full_logprobs, cfg.kl_top_k)

        t0 = time.perf_counter()
        outputs = serve_sessions(engine, samples, max_tokens=cfg.max_tokens,
                                 max_active=cfg.max_active, logprobs=want_ref_logprobs,
                                 on_turn=keep_reference if want_ref_logprobs else None,
                                 progress=_progress_log(spec.label, len(samples), log))
        serve_s = time.perf_counter() - t0
        if on_answers is not None:
            on_answers(spec.label, outputs)
        rows = {}
        for s in samples:
            for t, turn_out in enumerate(outputs[s.id]):
                key = (s.id, t)
                j = _Judged(is_correct(s.turns[t].answer, turn_out.text))
                if spec.mode == "full":
                    reference[key] = turn_out
                else:
                    ref = reference[key].token_ids
                    j.agreement = token_agreement(ref, turn_out.token_ids)
                    j.exact = ref == turn_out.token_ids
                rows[key] = j
        forced_s = None
        if spec.mode != "full" and not kl_missing:
            def add_kl(sample, turn, out, rows=rows):
                key = (sample.id, turn)
                kl = kl_from_reference(ref_dist[key], out.outputs[0].full_logprobs)
                rows[key].kl_sum = float(kl.sum())
                rows[key].kl_positions = int(kl.size)
                rows[key].uncovered_sum = float(ref_dist[key].uncovered_mass().sum())

            t0 = time.perf_counter()
            serve_sessions(engine, samples, max_tokens=cfg.max_tokens, max_active=cfg.max_active,
                           forced={k: v.token_ids for k, v in reference.items()}, logprobs=True,
                           on_turn=add_kl)
            forced_s = time.perf_counter() - t0
        sched = engine.kv_usage()["scheduler"]
        engines_info[spec.label] = dict(
            build_seconds=round(build_s, 2), serve_seconds=round(serve_s, 2),
            forced_seconds=None if forced_s is None else round(forced_s, 2),
            preemptions=int(sched["preemptions"]), evictions=int(sched["evictions"]),
            layout=engine.layout.name, max_model_len=engine.max_model_len,
            scoring_rule=engine.resolved.scoring_rule, method=engine.compression_method,
            retention=engine.layout.retention, turn_view=engine.layout.turn_view,
            chunk_size=engine.layout.chunk_size)
        judged[spec.label] = rows
        if on_partial is not None:
            done = specs[:specs.index(spec) + 1]
            on_partial(dict(summarise(samples, done, judged), engines=dict(engines_info),
                            kl_status="measured" if not kl_missing else kl_missing,
                            max_model_len=max_model_len, complete=spec is specs[-1]))
        log(f"{spec.label}: built {build_s:.1f}s, served {serve_s:.1f}s"
            + (f", forced {forced_s:.1f}s" if forced_s is not None else "")
            + f", preemptions {sched['preemptions']}, evictions {sched['evictions']}")
        if spec.mode == "full" and len(specs) > 1:
            left = remaining_after_full(serve_s, build_s, len(specs) - 1, not kl_missing)
            log(f"the other configurations ({len(specs) - 1}): about {duration_words(left)} "
                f"more (full KV's measured time x the others' cost relative to it)")
        del engine
    table = summarise(samples, specs, judged)
    table["engines"] = engines_info
    table["kl_status"] = "measured" if not kl_missing else kl_missing
    table["max_model_len"] = max_model_len
    table["complete"] = True
    table["reference_answers"] = {f"{sid}/t{t}": o.text for (sid, t), o in
                                  list(reference.items())[:12]}
    return table


def _aggregate(rows: list[_Judged]) -> dict:
    n = len(rows)
    correct = sum(r.correct for r in rows)
    lo, hi = wilson_interval(correct, n)
    out = dict(n=n, correct=correct, accuracy=correct / n if n else None, ci95=[lo, hi])
    agree = [r.agreement for r in rows if r.agreement is not None]
    out["agreement"] = float(np.mean(agree)) if agree else None
    exact = [r.exact for r in rows if r.exact is not None]
    out["exact_match"] = float(np.mean(exact)) if exact else None
    positions = sum(r.kl_positions for r in rows)
    out["kl"] = sum(r.kl_sum for r in rows) / positions if positions else None
    out["kl_positions"] = positions
    out["kl_reference_mass_outside_topk"] = (sum(r.uncovered_sum for r in rows) / positions
                                             if positions else None)
    return out


def summarise(samples: list[Sample], specs: list,
              judged: dict[str, dict[tuple[str, int], _Judged]],
              library: str = "tangram-jax") -> dict:
    """Per task x spec: n, correct, accuracy, Wilson 95% CI, agreement, exact match, KL; for a
    multi-turn task also turn 1 and the follow-up turns separately. Flags tasks that full KV
    answers less than half the time. `specs`: objects with mode, ratio and label (a `ModeSpec`,
    or the kvpress script's press spec); `judged[label][(sample id, turn)]`."""
    tasks = list(dict.fromkeys(s.task for s in samples))
    results, checks = [], []
    for task in tasks:
        task_samples = [s for s in samples if s.task == task]
        multi = any(len(s.turns) > 1 for s in task_samples)
        for spec in specs:
            rows = judged[spec.label]
            all_rows = [rows[(s.id, t)] for s in task_samples for t in range(len(s.turns))]
            entry = dict(library=library, task=task,
                         mode=getattr(spec, "mode_name", spec.mode), ratio=spec.ratio,
                         samples=len(task_samples), **_aggregate(all_rows))
            if multi:
                entry["turn1"] = _aggregate([rows[(s.id, 0)] for s in task_samples])
                entry["followup"] = _aggregate([rows[(s.id, t)] for s in task_samples
                                                for t in range(1, len(s.turns))])
            results.append(entry)
        full = next((r for r in results if r["task"] == task and r["mode"] == "full"), None)
        if full is not None:
            ok = full["accuracy"] >= SOLVABLE_ACCURACY
            checks.append(dict(task=task, full_kv_accuracy=full["accuracy"],
                               solvable=ok, threshold=SOLVABLE_ACCURACY))
    return dict(results=results, checks=checks)


def choose_sizes(tasks: tuple[str, ...], samples_per_size: int, seed: int, cfg: HarnessConfig,
                 base: TaskSizes = TaskSizes(), log: Callable[[str], None] = print
                 ) -> tuple[dict[str, TaskSizes], dict]:
    """Per task, the hardest size of `LADDERS` that full KV answers at least `PILOT_ACCURACY` of
    the time on `samples_per_size` pilot samples (another seed than the table's), else the
    easiest. Returns each task's sizes (`base` with its rung's settings: tasks that share a
    field keep their own value) and the pilot's accuracies."""
    pilot_seed = seed + PILOT_SEED_OFFSET
    samples, where = [], {}
    for task in tasks:
        for rung, override in enumerate(LADDERS[task]):
            sizes = dataclasses.replace(base, **override)
            label = f"{task}#{rung}"
            where[label] = (task, override)
            samples += [dataclasses.replace(generate(task, i, pilot_seed, sizes), task=label,
                                            id=f"{label}-{i:04d}")
                        for i in range(samples_per_size)]
    table = run_table(samples, [ModeSpec("full", 1.0)], dataclasses.replace(cfg, kl=False),
                      log=log)
    accuracy = {r["task"]: r["accuracy"] for r in table["results"]}
    chosen, report = {}, {}
    for task in tasks:
        rungs = [f"{task}#{i}" for i in range(len(LADDERS[task]))]
        pick = next((r for r in rungs if accuracy[r] >= PILOT_ACCURACY), rungs[-1])
        chosen[task] = dataclasses.replace(base, **where[pick][1])
        report[task] = dict(chosen=where[pick][1], threshold=PILOT_ACCURACY,
                            full_kv_accuracy={str(where[r][1]): accuracy[r] for r in rungs})
        log(f"pilot {task}: " + ", ".join(f"{where[r][1]} {100 * accuracy[r]:.0f}%"
                                          for r in rungs) + f" -> {where[pick][1]}")
    return chosen, dict(samples_per_size=samples_per_size, seed=pilot_seed, tasks=report)
