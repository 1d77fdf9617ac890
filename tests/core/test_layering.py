"""The package's import layering: a module imports only from below it. The CLI (`cli.py`,
`commands/`) and the package root's API (`LLM`, `Engine`, ...) are the top; the config reads
settings' defaults from leaf modules, not from the scheduler it configures; the scheduler knows
nothing of the engine. Checked on the source (imports inside functions count too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tangram_jax"
TOP = ("tangram_jax.commands", "tangram_jax.cli")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", "."), path


def _imports(path):
    """(module imported, names imported from it) for every import statement in `path`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, tuple(a.name for a in node.names)


def _is_submodule(name):
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file()


def _violations(module, path):
    in_cli = module.startswith(TOP)
    for imported, names in _imports(path):
        if not in_cli and imported.startswith(TOP):
            yield f"{module} imports the CLI ({imported})"
        if imported == "tangram_jax" and module != "tangram_jax":
            api = [n for n in names if not _is_submodule(n)]
            if api:
                yield f"{module} imports {api} from the package root"
        if module == "tangram_jax.engine.config" and imported.startswith("tangram_jax.scheduler"):
            yield f"the config imports the scheduler ({imported})"
        if module.startswith("tangram_jax.scheduler") and \
                imported.startswith(("tangram_jax.engine", "tangram_jax.llm")):
            yield f"{module} imports the engine ({imported})"


def test_every_module_imports_only_from_below_it():
    modules = list(_modules())
    assert len(modules) > 50
    found = [v for module, path in modules for v in _violations(module, path)]
    assert not found, "\n".join(found)
