"""Provenance that names the code (issue 27, section 3): a digest of blunb's sources beside the git
sha, untracked sources count as dirty, and a study does not publish from a dirty tree unless told."""

import json
import shutil
import subprocess

import pytest

import blunb
import blunb.study
from blunb.runs import MetricsWriter, environment, git_state, source_digest
from blunb.study import Study, StudyError, check_publish, publishes
from tests.run_folders import write_completed

PACKAGE = blunb.__file__.rsplit("/", 1)[0]


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_the_source_digest_names_the_code_in_a_copy_without_git(tmp_path):
    copy = tmp_path / "blunb"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notes.txt").write_text("not source")  # only .py files count
    here = source_digest()
    assert here["files"] > 10 and len(here["sha256"]) == 64 and source_digest(copy) == here
    env = environment(1, "cpu")
    assert env["blunb_sources"] == here and "git_sha" in env
    assert env["device"] == "cpu" and env["device_uuid"] is None   # a card's uuid on CUDA only
    (copy / "optim" / "clip.py").write_text((copy / "optim" / "clip.py").read_text() + "\n# edited\n")
    edited = source_digest(copy)
    assert edited["sha256"] != here["sha256"] and edited["files"] == here["files"]
    (copy / "extra.py").write_text("")
    assert source_digest(copy)["files"] == here["files"] + 1


def test_untracked_sources_make_the_tree_dirty(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    for d in ("blunb", "bench", "notebooks", "docs"):
        (tmp_path / d).mkdir()
    (tmp_path / "blunb" / "model.py").write_text("a = 1\n")
    (tmp_path / ".gitignore").write_text("blunb/generated_*.py\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    head = git_state(tmp_path)[0]
    (tmp_path / "scratch.py").write_text("")           # outside the source folders
    (tmp_path / "docs" / "conf.py").write_text("")
    (tmp_path / "blunb" / "generated_x.py").write_text("")  # ignored
    (tmp_path / "blunb" / "notes.txt").write_text("")
    assert git_state(tmp_path) == (head, False, [])
    (tmp_path / "blunb" / "kernels").mkdir()
    (tmp_path / "blunb" / "kernels" / "new_op.py").write_text("")
    (tmp_path / "notebooks" / "spec.py").write_text("")
    sha, dirty, files = git_state(tmp_path)
    assert (sha, dirty) == (head, True) and sorted(files) == ["blunb/kernels/new_op.py", "notebooks/spec.py"]


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A checkout of its own as blunb.study's repo root: committed results/, git-ignored results/scratch/."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    (tmp_path / "results" / "kept").mkdir(parents=True)
    (tmp_path / "results" / "kept" / "README.md").write_text("x")
    (tmp_path / "train.py").write_text("a = 1\n")
    (tmp_path / ".gitignore").write_text("/results/scratch/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    monkeypatch.setattr(blunb.study, "repo_root", lambda: tmp_path)
    return tmp_path


def test_publishing_from_a_dirty_tree_is_refused_unless_allow_dirty(repo, tmp_path_factory):
    committed, scratch = repo / "results" / "s", repo / "results" / "scratch" / "s"
    assert publishes(committed) and not publishes(scratch) and not publishes(tmp_path_factory.mktemp("elsewhere"))
    clean = check_publish(committed)
    assert clean["published"] and clean["git_dirty"] is False and clean["allow_dirty"] is False
    (repo / "train.py").write_text("a = 2\n")
    (repo / "results" / "kept" / "README.md").write_text("y")  # results/ never counts
    with pytest.raises(StudyError, match=rf"refusing to publish into {committed}: the git tree has uncommitted "
                                         r"changes \(train.py\); commit them first, or pass allow_dirty=True"):
        check_publish(committed)
    told = check_publish(committed, allow_dirty=True)
    assert told["allow_dirty"] and told["git_dirty"] and told["git_dirty_files"] == ["train.py"]
    assert told["blunb_sources"] == source_digest()
    assert check_publish(scratch)["published"] is False  # scratch studies go on, dirty or not
    with pytest.raises(ValueError, match="allow_dirty must be True or False"):
        check_publish(committed, allow_dirty="yes")


def _completed_run(study: Study):
    """Make each planned run of `study` look completed with its config (so run() launches nothing)."""
    for plan in study._plan():
        plan.run_dir.mkdir(parents=True)
        (plan.run_dir / "config.json").write_text(json.dumps(plan.config))
        (plan.run_dir / "env.json").write_text(json.dumps({"world_size": 1, "device": "cpu"}))
        w = MetricsWriter(plan.run_dir / "metrics.csv", [])
        for s in range(4):
            w.write({"step": s, "train_loss": 5.0, "val_loss": 4.0, "tok_per_sec": 1.0, "grad_norm": 1.0,
                     "dt_ms": 1.0, "lr": 1e-3, "elapsed_min": 0.0, "mfu": 0.0, "mfu_palm": 0.0,
                     "tflops_per_gpu": 0.0})
        w.close()
        write_completed(plan.run_dir, 4)


def test_a_study_refuses_to_publish_from_a_dirty_tree_and_records_allow_dirty(repo):
    root = repo / "results"
    (repo / "train.py").write_text("a = 2\n")
    study = Study("s", {"a": []}, seeds=[0], steps=4, root=root, progress=False)
    with pytest.raises(StudyError, match="refusing to publish"):
        study.run()
    assert not (root / "s").exists()  # refused before anything was written
    told = Study("s", {"a": []}, seeds=[0], steps=4, root=root, progress=False, allow_dirty=True)
    _completed_run(told)
    summary = told.run()
    assert summary["action"].tolist() == ["cached"]  # nothing trained
    meta = json.loads((root / "s" / "study.json").read_text())
    assert meta["published"] and meta["allow_dirty"] and meta["git_dirty_files"] == ["train.py"]
    assert meta["blunb_sources"] == source_digest() and meta["states"] == {"completed": 1}
