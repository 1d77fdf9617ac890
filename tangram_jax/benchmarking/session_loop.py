"""The session loop every engine of `bench serve` is driven by (ours in-process, vLLM in its own
virtual environment through `vllm_driver.py`, which loads this file by path): standard library
only, so both sides run the same loop.

Each session's first turn is sent at the session's arrival time (all at 0 in a closed loop,
Poisson in an open loop); each follow-up is sent the session's think time for it (its
``think_times``, drawn by `workload.make_sessions`) after the previous turn ends, or the moment
it ends where the session has none. Times are taken as a client sees them: TTFT from the turn's
send time to the step that reports its first token, TPOT over the rest of its tokens.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class TurnRecord:
    session_id: str
    turn: int
    request_id: str
    sent: float                 # seconds after the run's start
    new_tokens: int             # tokens this turn adds (context or question)
    prompt_tokens: int          # the whole history it is asked with (resent by stateless engines)
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens the engine did not compute (prefix cache / session)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


class Adapter:
    """What the loop needs of an engine.

    submit(request_id, session_id, turn, history, new): send a turn (`history`: every earlier
    prompt and answer token of the session, `new`: this turn's tokens); stateful engines send
    only `new` to the session. step() -> list of (request_id, output_token_ids, finished,
    cached_tokens) for the requests with news. has_work(): requests are in flight.
    end_session(session_id): the session's last turn ended. close(): the run is over (release
    threads and the like; `contextlib.closing`).
    """

    def submit(self, request_id, session_id, turn, history, new): raise NotImplementedError
    def step(self): raise NotImplementedError
    def has_work(self) -> bool: raise NotImplementedError
    def end_session(self, session_id) -> None: pass
    def close(self) -> None: pass


def drive(sessions: list[dict], adapter: Adapter, clock=time.perf_counter,
          on_step=None) -> tuple[list[TurnRecord], float]:
    """Serve `sessions` (dicts of `workload.sessions_to_json`) to completion through `adapter`.
    `on_step()` is called after every engine step (pool sampling). Returns (records in send
    order, elapsed seconds)."""
    by_id = {s["session_id"]: s for s in sessions}
    history = {s["session_id"]: [] for s in sessions}
    due = sorted((float(s["arrival"]), s["session_id"], 0) for s in sessions)  # (time, sid, turn)
    records: list[TurnRecord] = []
    live: dict[str, TurnRecord] = {}
    total = sum(len(s["turns"]) for s in sessions)
    done = 0
    t0 = clock()
    while done < total:
        now = clock() - t0
        while due and due[0][0] <= now:
            sent, sid, turn = due.pop(0)
            new = list(by_id[sid]["turns"][turn])
            rid = f"{sid}-t{turn}"
            rec = TurnRecord(sid, turn, rid, sent, len(new), len(history[sid]) + len(new))
            adapter.submit(rid, sid, turn, list(history[sid]), new)
            history[sid] += new
            live[rid] = rec
            records.append(rec)
        if not adapter.has_work():
            if due:
                time.sleep(max(0.0, min(0.05, due[0][0] - (clock() - t0))))
                continue
            raise RuntimeError(f"engine idle with {total - done} turns unfinished")
        news = adapter.step()
        now = clock() - t0
        if on_step is not None:
            on_step()
        for rid, token_ids, finished, cached in news:
            rec = live.get(rid)
            if rec is None:
                continue
            if token_ids and rec.first_token is None:
                rec.first_token = now
            rec.output_tokens = len(token_ids)
            if finished:
                rec.finished, rec.cached_tokens = now, int(cached or 0)
                del live[rid]
                done += 1
                session = by_id[rec.session_id]
                history[rec.session_id] += list(token_ids)
                if rec.turn + 1 < len(session["turns"]):
                    think = session.get("think_times") or ()
                    wait = float(think[rec.turn]) if rec.turn < len(think) else 0.0
                    due.append((now + wait, rec.session_id, rec.turn + 1))
                    due.sort()
                else:
                    adapter.end_session(rec.session_id)
    return records, clock() - t0
