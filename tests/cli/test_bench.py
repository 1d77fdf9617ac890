"""`tangram-jax bench`: every script of the checkout's benchmarks/ is a benchmark by name."""

import sys
from pathlib import Path

from tangram_jax.cli import main
from tangram_jax.commands import bench

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_is_reachable_by_name_with_a_description():
    listed = bench.catalogue()
    on_disk = {p.stem for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    helpers = {name for name in on_disk if name.startswith("_")}   # modules the scripts import
    assert on_disk - helpers and on_disk - helpers <= set(listed) and not helpers & set(listed)
    assert "serve" in listed   # the packaged one
    for name, what in listed.items():
        assert what and "\n" not in what and len(what) < 120, (name, what)


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "soak" in out and "serve" in out


def test_a_python_benchmark_gets_its_arguments_and_its_exit_status_comes_back(tmp_path):
    script = tmp_path / "benchmarks" / "probe.py"
    script.parent.mkdir()
    record = tmp_path / "argv.txt"
    script.write_text('"""A probe. More."""\nimport sys\n'
                      f'open({str(record)!r}, "w").write(" ".join(sys.argv[1:]))\n'
                      'sys.exit(3)\n')
    argv_before = list(sys.argv)
    assert bench.run_script(script, ["--turns", "3"]) == 3
    assert record.read_text() == "--turns 3"
    assert sys.argv == argv_before
    assert bench.catalogue(script.parent)["probe"] == "A probe."


def test_a_shell_benchmark_runs_under_bash_from_the_checkout_root(tmp_path):
    script = tmp_path / "benchmarks" / "probe.sh"
    script.parent.mkdir()
    script.write_text('#!/usr/bin/env bash\n# Writes its arguments. Then exits 4.\n#   usage\n'
                      'echo "$PWD $*" > out.txt; exit 4\n')
    assert bench.run_script(script, ["a", "b"]) == 4
    assert (tmp_path / "out.txt").read_text().split() == [str(tmp_path), "a", "b"]
    assert bench.describe(script) == "Writes its arguments."
