"""tools/device_setup.sh: HEAD packed here (its commit object and file list), rebuilt there from the copied files
into a clean checkout of the same sha, other studies' committed results optionally left home."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "device_setup.sh"


def sh(args, cwd, env=None, check=True):
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    assert not check or out.returncode == 0, out.stderr
    return out


def test_pack_here_setup_there_gives_a_clean_checkout_of_head(tmp_path):
    here = tmp_path / "here"
    sh(["git", "clone", "-q", str(REPO), str(here)], tmp_path)
    head = sh(["git", "rev-parse", "HEAD"], here).stdout.strip()
    # A wheel already there is not downloaded again (the test needs no package index).
    (here / ".device" / "wheels").mkdir(parents=True)
    (here / ".device" / "wheels" / "torchao-0.0.0-py3-none-any.whl").write_bytes(b"")
    (here / "README.md").write_text("changed\n")
    refused = sh(["bash", str(TOOL), "pack"], here, check=False)
    assert refused.returncode == 1 and "uncommitted changes" in refused.stderr
    sh(["git", "checkout", "-q", "README.md"], here)
    assert "packed" in sh(["bash", str(TOOL), "pack"], here).stdout
    assert sh(["git", "status", "--porcelain"], here).stdout == ""  # .device is ignored

    # The GPU machine's copy: the working tree without .git, .device carried along (no wheel to install here).
    there = tmp_path / "there"
    shutil.copytree(here, there, ignore=shutil.ignore_patterns(".git"))
    shutil.rmtree(there / ".device" / "wheels")
    (there / "tools" / "device_setup.sh").chmod(0o644)   # a copy that lost an executable bit still rebuilds HEAD
    (there / "README.md").chmod(0o755)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "meta.json").write_text(json.dumps({"sha256": "abc123"}))  # prepared before: not made again
    src = tmp_path / "src"
    out = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, env={"EXTRA_DIR": str(tmp_path / "x")}).stdout
    assert f"at {head} (clean: 0 changed files)" in out and "sha256 abc123" in out
    assert f"export PYTHONPATH={src}:{tmp_path / 'x'}" in out
    assert sh(["git", "rev-parse", "HEAD"], src).stdout.strip() == head
    again = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, env={"EXTRA_DIR": str(tmp_path / "x")})
    assert f"at {head}" in again.stdout  # an existing clone of the same sha is kept
    bare = sh(["bash", str(TOOL), "setup", str(src), "-"], there, env={"EXTRA_DIR": str(tmp_path / "x")}).stdout
    assert f"at {head} (clean: 0 changed files)\nno corpus\n" in bare and "sha256" not in bare  # benchmarks: none
    assert re.search(r"setup took \d+ s: checkout \d+, wheels \d+, corpus \d+ \(none\)", bare)
    assert re.search(r"setup took \d+ s: checkout \d+, wheels \d+, corpus \d+ \(there already\)", out)

    other = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there,
               env={"EXTRA_DIR": str(tmp_path / "x"), "EXPECT_CORPUS_SHA256": "def456"}, check=False)
    assert other.returncode == 1 and "sha256 abc123, not the expected def456" in other.stderr
    shutil.rmtree(src)
    (there / "README.md").write_text("changed after pack\n")
    changed = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, env={"EXTRA_DIR": str(tmp_path / "x")},
                 check=False)
    assert changed.returncode == 1 and "differ from HEAD's" in changed.stderr and "README.md" in changed.stderr
    sh(["git", "checkout", "-q", "README.md"], here)
    shutil.copy(here / "README.md", there / "README.md")

    # Committed results of other studies may stay home (the copy must fit 64 MiB): HEAD's tree and a clean
    # checkout all the same, the absent files marked skip-worktree; a missing source file is refused.
    shutil.rmtree(there / "results" / "clipping")
    thin = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, env={"EXTRA_DIR": str(tmp_path / "x")})
    assert "left home: results/clipping" in thin.stdout and f"at {head} (clean: 0 changed files)" in thin.stdout
    assert sh(["git", "status", "--porcelain"], src).stdout == ""
    assert not (src / "results" / "clipping").exists() and (src / "results" / "precision").is_dir()
    shutil.rmtree(src)
    (there / "blunb" / "stats.py").unlink()
    gone = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, env={"EXTRA_DIR": str(tmp_path / "x")},
              check=False)
    assert gone.returncode == 1 and "only results/ may be left home" in gone.stderr and "blunb/stats.py" in gone.stderr
    bad = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there,
             env={"EXTRA_DIR": str(tmp_path / "site-packages")}, check=False)
    assert bad.returncode == 2 and "would be read as site-packages" in bad.stderr
    shutil.rmtree(there / ".device")
    missing = sh(["bash", str(TOOL), "setup", str(src), str(corpus)], there, check=False)
    assert missing.returncode == 2 and "no .device/head.ids" in missing.stderr
