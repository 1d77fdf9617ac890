"""`tangram-jax` command line: one subcommand per module under `tangram_jax.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "run": "tangram_jax.commands.run",
    "generate": "tangram_jax.commands.generate",
    "chat": "tangram_jax.commands.chat",
    "serve": "tangram_jax.commands.serve",
    "calibrate": "tangram_jax.commands.calibrate",
    "bench": "tangram_jax.commands.bench",
}


def _available() -> dict[str, str]:
    return {name: mod for name, mod in COMMANDS.items() if importlib.util.find_spec(mod)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
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
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


def _one_line_help(mod_name: str) -> str:
    spec = importlib.util.find_spec(mod_name)
    # Read the HELP constant from source to avoid importing the module (and JAX) for --help.
    with open(spec.origin, encoding="utf-8") as f:
        for line in f:
            if line.startswith("HELP = "):
                return line[len("HELP = "):].strip().strip("\"'")
    return ""


if __name__ == "__main__":
    sys.exit(main())
