"""The revision recorded with results: `provenance.git_revision`."""

import shutil
import subprocess

import pytest

from tangram_jax import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout.strip()
    return rev


def test_revision_is_head_and_says_when_tracked_files_differ(tmp_path, monkeypatch):
    rev = _repo(tmp_path)
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    monkeypatch.delenv("GIT_REV", raising=False)
    assert provenance.git_revision() == rev
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert provenance.git_revision() == rev
    # A tree copied over an older .git (the GPU machine's case) differs from its HEAD.
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.git_revision() == f"{rev}+modified"
    monkeypatch.setenv("GIT_REV", "abc1234")
    assert provenance.git_revision() == "abc1234"


def test_no_checkout_gives_none(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    monkeypatch.delenv("GIT_REV", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance.git_revision() is None
