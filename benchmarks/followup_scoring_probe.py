"""Which scoring rule keeps the facts a follow-up turn asks (offline probe, CPU, no engine).

The facts turn 1 does not ask, measured with the pure-JAX model.

For multi-turn samples of a task file, turn 1 (context + question, tokenised as the harness does:
chat template, then the answer prefix) runs through the embedded model; per (layer, KV head) the
tokens a rule keeps at the shipped tangram budgets (G = 1, rho 0.25 / 0.5; the turn's last
`--tail` tokens protected, `kv_layout`'s count ``ceil(r * u)`` of the u unprotected ones) are
compared with the facts' token spans. Reported per rule and rho: the share of heads (every layer
weighs the same: 3 KV heads each) that keep ALL of a fact's room-number tokens / name tokens, for
the fact turn 1 asks and the two asked later.

    PYTHONPATH=$PWD python3 benchmarks/followup_scoring_probe.py --samples 40 \
        --out benchmarks/results/followup_scoring_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tangram_jax.compression.profile import BudgetProfile
from tangram_jax.compression.scorers import expected_attention, keydiff, pool1d
from tangram_jax.evaluation.harness import first_turn_token_ids
from tangram_jax.evaluation.tasks import read_jsonl
from tangram_jax.models.registry import load_model
from tangram_jax.models.decoder import dense_attention
from tangram_jax.benchmarking.results import finish, resolve_outputs, start
from tangram_jax.commands import add_overwrite_flag
from tangram_jax.models.rope import inverse_frequencies

PROFILES = "tangram_jax/compression/profiles/smollm2-135m_snapkv_rho{:.2f}_g1.json"


def forward_qkv(model, tokens: np.ndarray):
    """q [L, T, Hq, D], k/v [L, T, Hkv, D] of every layer, dense causal attention."""
    @nnx.jit
    def run(model, tokens):
        t = tokens.shape[0]
        pos = jnp.arange(t)[None]
        mask = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
        h = model.embed(tokens[None])
        qs, ks, vs = [], [], []
        for layer in model.layers:
            q, k, v = layer.qkv(h, pos)
            qs.append(q[0]), ks.append(k[0]), vs.append(v[0])
            h = layer.finish(h, dense_attention(q, k, v, mask))
        return jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)
    return run(model, jnp.asarray(tokens, jnp.int32))


@jax.jit
def attention_probs(q, k):
    """[L, Hq, T, T] causal softmax of every query (float32)."""
    qpk = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k, qpk, axis=2)
    logits = jnp.einsum("lqhd,lkhd->lhqk", q, kk) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)


def kv_mean(x, qpk):   # [L, Hq, T] -> [L, Hkv, T]
    return x.reshape(x.shape[0], -1, qpk, x.shape[-1]).mean(axis=2)


def token_spans(tokenizer, ids):
    """Character [start, end) of every token in the decoded text."""
    ends, text = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[:i + 1], skip_special_tokens=False)
        ends.append(len(text))
    starts = [0] + ends[:-1]
    return text, np.array(starts), np.array(ends)


def fact_tokens(text, starts, ends, person, room):
    m = re.search(rf"{person} lives in room {room}\.", text)
    if m is None:
        raise ValueError(f"fact of {person} not found")
    def covering(a, b):
        return np.nonzero((starts < b) & (ends > a))[0]
    name = covering(m.start(), m.start() + len(person))
    r0 = m.start() + len(f"{person} lives in room ")
    return name, covering(r0, r0 + len(room))


def rank_of(scores):
    """Rank (0 = best) of every token per head, along the last axis."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(scores.shape[-1])[None, None], axis=-1)
    return ranks


def rules(probs, q, k, v, n, tail, inv_freq, qpk):
    """name -> scores [L, Hkv, u] over the unprotected tokens 0 .. u-1 (higher kept first)."""
    u = n - tail
    out = {}
    def snap(rows, kernel=7, weight=None):
        p = probs[:, :, rows, :]                       # [L, Hq, R, T]
        if weight is not None:
            p = p * weight[None, None, :, None]
        s = kv_mean(p.sum(axis=2), qpk)
        return np.asarray(pool1d(jnp.asarray(s), kernel, "max"))[..., :u]
    for w in (32, 64, 128):
        out[f"snapkv_w{w}"] = snap(np.arange(n - w, n))
    for kern in (15, 31):
        out[f"snapkv_w32_k{kern}"] = snap(np.arange(n - 32, n), kernel=kern)
    # Question-agnostic parts.
    agn = {}
    for stride in (1, 8, 16, 32, 64):
        rows = np.arange(stride - 1, u, stride)
        agn[f"spread{stride}"] = snap(rows)
        agn[f"spread{stride}n"] = snap(rows, weight=(rows + 1).astype(np.float32))
    heads = lambda x: jnp.moveaxis(x, 0, 1)   # noqa: E731
    kd, ea = [], []
    for layer in range(q.shape[0]):
        ql, kl, vl = heads(q[layer, :n]), heads(k[layer, :n]), heads(v[layer, :n])
        kd.append(np.asarray(keydiff(ql, kl, vl, q_per_kv=qpk)))
        ea.append(np.asarray(expected_attention(ql, kl, vl, q_per_kv=qpk, inv_freq=inv_freq)))
    agn["keydiff"] = np.stack(kd)[..., :u]
    agn["expected_attention"] = np.stack(ea)[..., :u]
    out.update(agn)
    question = out["snapkv_w32"]
    rq = rank_of(question)
    for name, a in agn.items():
        ra = rank_of(a)
        for share in (0.25, 0.5, 0.75):
            # Union by rank: a token's place is its better rank, each list scaled by its share.
            out[f"union_{name}_q{share}"] = -np.minimum(rq / share, ra / (1 - share))
        # Sum of max-normalised scores.
        out[f"sum_{name}"] = (question / question.max(-1, keepdims=True)
                              + (a - a.min(-1, keepdims=True))
                              / np.ptp(a, -1, keepdims=True).clip(1e-12))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks-in", default="benchmarks/results/accuracy_tasks.jsonl")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--tail", type=int, default=32, help="protected tail (obs_window)")
    ap.add_argument("--oracle", choices=("window", "answer"), default="window",
                    help="whose attention weighs a fact's tokens: its own question's window "
                         "(as turn 1's question), or the queries that produce its answer")
    ap.add_argument("--rules", default=None, help="comma-separated subset of the rules")
    ap.add_argument(
        "--out", default=None, help="result JSON (default: a fresh file under "
        "benchmarks/results/runs/; a file git tracks only with --overwrite)")
    add_overwrite_flag(ap)
    args = ap.parse_args()
    outputs = resolve_outputs(ap, args, {"out": "followup_scoring_probe"})
    run = start("followup_scoring_probe", outputs)

    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    qpk = loaded.config.q_per_kv
    inv_freq = jnp.asarray(inverse_frequencies(loaded.config), jnp.float32)
    budgets = {rho: BudgetProfile.load(PROFILES.format(rho)).budget for rho in (0.25, 0.5)}
    samples = [s for s in read_jsonl(args.tasks_in) if s.task == "multi_turn"][:args.samples]
    # tallies[rule][rho][which][part] -> list of per-sample [L, Hkv] bool
    tallies: dict = {}
    t0 = time.time()
    for idx, sample in enumerate(samples):
        ids = first_turn_token_ids(tok, sample)
        n = len(ids)
        text, starts, ends = token_spans(tok, ids)
        q, k, v = forward_qkv(model, np.array(ids))
        probs = np.asarray(attention_probs(q, k))
        scored = rules(probs, np.asarray(q), np.asarray(k), np.asarray(v), n, args.tail,
                       inv_freq, qpk)
        u = n - args.tail
        facts = []
        for turn, t in enumerate(sample.turns):
            person = re.search(r"does (\w+) live", t.question).group(1)
            name, room = fact_tokens(text, starts, ends, person, t.answer)
            # Oracle: the attention this fact's own question window pays the context when it
            # is asked (the same context with this question as turn 1's), per (layer, KV head).
            # With --oracle answer: the attention of the queries that produce the answer (the
            # turn's last token and the answer's tokens but its last, teacher-forced).
            alone = dataclasses.replace(sample, turns=(t,))
            oids = first_turn_token_ids(tok, alone)
            assert oids[:u] == ids[:u], "context tokens differ between questions"
            on = len(oids)
            if args.oracle == "answer":
                answer = tok.encode(" " + t.answer if t.answer_prefix else t.answer,
                                    add_special_tokens=False)
                oids = oids + answer
                rows = slice(on - 1, on - 1 + len(answer))
            else:
                rows = slice(on - args.tail, on)
            if turn == 0 and args.oracle == "window":
                oprobs = probs
            else:
                oq, ok, _ = forward_qkv(model, np.array(oids))
                oprobs = np.asarray(attention_probs(oq, ok))
            oracle = kv_mean(oprobs[:, :, rows, :u].sum(axis=2), qpk)  # [L, H, u]
            facts.append(("asked" if turn == 0 else "later", name, room, oracle))
        for rule, s in scored.items():
            if args.rules and rule not in args.rules.split(","):
                continue
            ranks = rank_of(s)
            for rho, b in budgets.items():
                keep = np.minimum(u, np.ceil(b * u - 1e-6)).astype(int)   # [L, Hkv]
                kept = ranks < keep[..., None]
                for which, name, room, oracle in facts:
                    d = tallies.setdefault(rule, {}).setdefault(rho, {}).setdefault(
                        which, {"room": [], "name": [], "both": [], "room_mass": [],
                                "fact_mass": [], "context_mass": []})
                    kr, kn = kept[..., room].all(-1), kept[..., name].all(-1)
                    d["room"].append(kr.mean()), d["name"].append(kn.mean())
                    d["both"].append((kr & kn).mean())
                    both = np.concatenate([name, room])
                    d["room_mass"].append((oracle[..., room] * kept[..., room]).sum()
                                          / oracle[..., room].sum())
                    d["fact_mass"].append((oracle[..., both] * kept[..., both]).sum()
                                          / oracle[..., both].sum())
                    d["context_mass"].append((oracle * kept).sum() / oracle.sum())
        print(f"sample {idx} n={n} {time.time() - t0:.0f}s", flush=True)
    summary = {rule: {str(rho): {which: {part: float(np.mean(v)) for part, v in parts.items()}
                                 for which, parts in per.items()}
                      for rho, per in per_rho.items()}
               for rule, per_rho in tallies.items()}
    for metric in ("room", "name", "room_mass", "fact_mass", "context_mass"):
        print(f"\n{metric}: {'rule':34s} " + " ".join(f"{f'{rho} {w}':>12s}" for rho in (0.25, 0.5)
                                                   for w in ("asked", "later")))
        for rule, per in summary.items():
            cells = [f"{per[str(rho)][w][metric]:.3f}" for rho in (0.25, 0.5)
                     for w in ("asked", "later")]
            print(f"{rule:42s} " + " ".join(f"{c:>12s}" for c in cells))
    with open(args.out, "w") as f:
        json.dump({"samples": len(samples), "tail": args.tail, "oracle": args.oracle,
                   "tasks_in": args.tasks_in, "summary": summary}, f, indent=1)
    finish(run)


if __name__ == "__main__":
    main()
