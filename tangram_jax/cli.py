"""`tangram-jax` command line: one subcommand per module under `tangram_jax.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so `--help` stays fast.

Exit status: 0 done; 2 a user error (bad flag or input, unusable file), reported as one line on
stderr; 130 interrupted (Ctrl-C), with no traceback and no partial output file.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import signal
import sys
import threading

COMMANDS = {
    "run": "tangram_jax.commands.run",
    "generate": "tangram_jax.commands.generate",
    "chat": "tangram_jax.commands.chat",
    "serve": "tangram_jax.commands.serve",
    "calibrate": "tangram_jax.commands.calibrate",
    "bench": "tangram_jax.commands.bench",
}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130   # 128 + SIGINT, what a shell reports for a Ctrl-C'd program


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (`tangram-jax run: error: ...`), exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _available() -> dict[str, str]:
    return {name: mod for name, mod in COMMANDS.items() if importlib.util.find_spec(mod)}


# After Ctrl-C, how long the interrupt may take to unwind before the process leaves anyway.
_INTERRUPT_GRACE_S = 1.0


def _exit_interrupted() -> None:
    # Outputs are written atomically and caches renamed into place (their `finally` blocks
    # ran while the interrupt unwound), so nothing half-written is left. Leave at once:
    # tearing down the interpreter with XLA's threads mid-computation can crash it.
    print("\ntangram-jax: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: raise KeyboardInterrupt so `finally` blocks run, and leave after a grace period
    if it has not unwound by then (code that waits in a library may catch the interrupt and
    carry on: seen as a Ctrl-C during model loading that let the command finish with 0)."""
    timer = threading.Timer(_INTERRUPT_GRACE_S, _exit_interrupted)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _quiet_unraisable(default):
    """`sys.unraisablehook` that says nothing of a KeyboardInterrupt: a Ctrl-C that lands in a
    callback Python cannot propagate from (a gc callback of JAX's) is dropped there with an
    "Exception ignored" traceback, and the grace timer of `_on_sigint` ends the process."""
    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            default(unraisable)
    return hook


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _on_sigint) if in_main_thread else None
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(previous_hook)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _exit_interrupted()
    finally:   # main() called in-process (tests, embedding) leaves the caller's handler
        sys.unraisablehook = previous_hook
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str]) -> int:
    parser = _Parser(
        prog="tangram-jax",
        description="Serve LLMs with non-uniform (head-wise) KV-cache compression on JAX/Pallas.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, mod_name in _available().items():
        # Only the module the user asked for is imported; the others contribute a stub parser
        # with their one-line help so `tangram-jax --help` lists them without importing JAX.
        if argv and argv[0] == name:
            module = importlib.import_module(mod_name)
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(p)
            modules[name] = module
        else:
            sub.add_parser(name, help=_one_line_help(mod_name), add_help=False)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from tangram_jax.commands import UsageError
    try:
        return int(modules[args.command].run(args) or 0)
    except UsageError as e:
        print(f"tangram-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _one_line_help(mod_name: str) -> str:
    """The module's HELP constant, read from its source (importing it would import JAX, which
    `--help` should not wait for); HELP may span lines (implicitly joined string literals)."""
    spec = importlib.util.find_spec(mod_name)
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "HELP" for t in node.targets):
            return ast.literal_eval(node.value)
    return ""

if __name__ == "__main__":
    sys.exit(main())
