"""Several processes (hosts) through JAX's distributed runtime (`jax.distributed`).

Every process runs the same script (SPMD): it calls `jax.distributed.initialize` (itself, or
through `EngineConfig`'s `distributed_coordinator` / `num_processes` / `process_id`, see
`start`), builds its engines on its own devices (`jax.local_devices()`), and `LLM` splits each
offline batch over all processes' replicas and gathers the outputs back to every process.

The outputs are gathered through the coordination service's key-value store (`exchange`), not
through device collectives (`jax.experimental.multihost_utils.process_allgather`): they are
small Python objects of different sizes (texts, token ids, logprob dicts), the store needs no
cross-process device communication (so it works on CPU, where JAX has no cross-host collectives
by default, and on GPUs without NCCL set-up), and it starts nothing on the devices the replicas
are stepping. The store is the one JAX's own multi-host utilities use for barriers.
"""

from __future__ import annotations

import itertools
import pickle

import jax

from tangram_jax.engine.config import EngineConfig, EngineConfigError

# Seconds one wait on the store lasts before it is retried (a peer's share of a batch can take
# any time; a dead peer ends the job through JAX's heartbeat, and a failing one publishes its
# error, see `exchange`).
_WAIT_S = 10
_exchanges = itertools.count()   # the n-th exchange of every process meets the others' n-th


def requested(config: EngineConfig) -> bool:
    """Whether the config asks for JAX's distributed runtime."""
    return any(v is not None for v in (config.distributed_coordinator, config.num_processes,
                                       config.process_id))


def start(config: EngineConfig) -> None:
    """Initialise JAX's distributed runtime from the config's fields when it asks for it and
    the runtime is not yet up; the fields left None are JAX's to find (its env variable
    JAX_COORDINATOR_ADDRESS, Slurm, Open MPI, Cloud TPU). When the runtime is up (the user
    called `jax.distributed.initialize`), fields that were given must agree with it. Must run
    before anything starts JAX's backend (the engine calls it first)."""
    if not requested(config):
        return
    if config.process_id is not None and config.num_processes is not None \
            and config.process_id >= config.num_processes:
        raise EngineConfigError(f"process_id must lie in [0, num_processes) = [0, "
                                f"{config.num_processes}), got {config.process_id}")
    if jax.distributed.is_initialized():
        for name, value, actual in (("num_processes", config.num_processes, jax.process_count()),
                                    ("process_id", config.process_id, jax.process_index())):
            if value is not None and value != actual:
                raise EngineConfigError(f"{name} {value} disagrees with JAX's distributed runtime, "
                                        f"already initialised with {name} {actual}")
        return
    try:
        jax.distributed.initialize(coordinator_address=config.distributed_coordinator,
                                   num_processes=config.num_processes,
                                   process_id=config.process_id)
    except (RuntimeError, ValueError) as e:
        raise EngineConfigError(
            f"distributed_coordinator {config.distributed_coordinator!r}, num_processes "
            f"{config.num_processes}, process_id {config.process_id}: jax.distributed.initialize "
            f"failed: {e} (it must run before anything starts JAX's backend; fields left None "
            f"need JAX_COORDINATOR_ADDRESS or a cluster JAX detects)") from None


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def exchange(value, *, failed: str | None = None) -> list:
    """All processes' `value`s, in process order (an all-gather of picklable Python objects
    through the coordination service's key-value store). Every process must call it the same
    number of times in the same order (SPMD). failed: this process's error instead of a value;
    every process then raises a RuntimeError naming it (so no process waits for a share that
    will never come). One process: [value] without touching the runtime.

    The values are pickled: the peers are processes of the same job."""
    n, me = process_count(), process_index()
    if n == 1:
        if failed is not None:
            raise RuntimeError(failed)
        return [value]
    from jax._src import distributed as _distributed   # the runtime's client (no public API)
    client = _distributed.global_state.client
    tag = f"tangram_jax/exchange-{next(_exchanges)}"
    payload = ("error", failed) if failed is not None else ("ok", value)
    client.key_value_set_bytes(f"{tag}/{me}", pickle.dumps(payload))
    shares = []
    for p in range(n):
        while True:
            try:
                raw = client.blocking_key_value_get_bytes(f"{tag}/{p}", _WAIT_S * 1000)
                break
            except Exception as e:   # noqa: BLE001 - the client raises XlaRuntimeError on timeout
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        shares.append(pickle.loads(raw))
    # Every process has read every share: each deletes its own (the store lives on process 0).
    client.wait_at_barrier(f"{tag}/read", 600_000)
    client.key_value_delete(f"{tag}/{me}")
    errors = [f"process {p}: {v}" for p, (kind, v) in enumerate(shares) if kind == "error"]
    if errors:
        raise RuntimeError("a batch failed on another process: " + "; ".join(errors)
                           if failed is None else "; ".join(errors))
    return [v for _, v in shares]
