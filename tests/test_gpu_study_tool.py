"""tools/gpu_study.sh: a study started in a session of its own, its finished runs collected once each."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from blunb.runs import write_status

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "gpu_study.sh"


def run_tool(*args, results, timeout=120):
    env = {**os.environ, "BLUNB_RESULTS": str(results), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(TOOL), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def fake_run(folder: Path, name: str, state: str, payload: int = 0) -> None:
    run = folder / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_10.pt").write_bytes(b"\0" * 64)
    write_status(run, state, 10, 20)  # the runner's own writer: the tool reads its format
    (run / "metrics.csv").write_text("step,train_loss\n0,3.5\n")
    (run / "config.json").write_text("{}")
    (run / "env.json").write_text('{"world_size": 1}')
    if payload:
        (run / "console.txt").write_bytes(os.urandom(payload))  # incompressible: its size is the archive's


def unpack(*args):
    return subprocess.run(["bash", str(TOOL), "unpack", *map(str, args)], capture_output=True, text=True, timeout=60)


def test_collect_packs_each_completed_run_once_without_checkpoints(tmp_path):
    folder = tmp_path / "results" / "study"
    fake_run(folder, "a-s0", "completed")
    fake_run(folder, "b-s0", "running")
    out = tmp_path / "out"
    out.mkdir()
    first = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert first.returncode == 0, first.stderr
    assert "a-s0" in first.stdout and "(1 finished in all)" in first.stdout
    [archive] = out.glob("runs-*.tgz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "a-s0/status.json" in names and "a-s0/metrics.csv" in names
    assert not any("checkpoints" in n or n.startswith("b-s0") for n in names)

    archive.unlink()
    write_status(folder / "b-s0", "completed", 20, 20)
    second = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert second.returncode == 0, second.stderr
    [archive] = out.glob("runs-*.tgz")
    with tarfile.open(archive) as tar:
        assert {n.split("/")[0] for n in tar.getnames()} == {"b-s0"}


def test_collect_from_a_study_with_no_run_yet_succeeds(tmp_path):
    (tmp_path / "study").mkdir()
    done = run_tool("collect", tmp_path / "study", tmp_path, 0, results=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "none (0 finished in all)" in done.stdout and not list(tmp_path.glob("runs-*.tgz"))


def test_start_reports_a_bad_parameter_at_once(tmp_path):
    started = run_tool("start", "notebooks/10_clipping.ipynb", "-p", "no_such_parameter", "1", results=tmp_path)
    assert started.returncode == 1
    assert "unknown parameter 'no_such_parameter'" in started.stderr


@pytest.mark.parametrize("args, message", [
    (("start", "notebooks/no_such.ipynb"), "no notebook"),
    (("collect", "/nonexistent/study", "/tmp"), "no study folder"),
    (("collect", "/tmp", "/nonexistent/out"), "no output folder"),
    (("collect", "/tmp", "/tmp", "5m"), "WAIT_S must be whole seconds, got '5m'"),
    (("collect", "/tmp", "/tmp", "5", "all"), "FINISHED must be a number of runs, got 'all'"),
    (("collect", "/tmp", "/tmp", "5", "3", "soon"), "DRAIN_AFTER_S must be whole seconds, got 'soon'"),
    (("launch",), "tools/gpu_study.sh start NOTEBOOK"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, args, message):
    refused = run_tool(*args, results=tmp_path)
    assert refused.returncode != 0
    assert message in refused.stderr


def test_results_folder_must_be_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BLUNB_RESULTS"}
    refused = subprocess.run(["bash", str(TOOL), "collect", tmp_path, tmp_path], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "set BLUNB_RESULTS" in refused.stderr


def test_unpack_extracts_new_runs_and_refuses_to_replace_any(tmp_path):
    """Back home, the collected runs go into the committed study folder; one already there with other bytes (e.g.
    a run the GPU machine re-trained) stops the whole unpack before anything is extracted."""
    remote, out, home = tmp_path / "remote" / "study", tmp_path / "out", tmp_path / "home" / "study"
    out.mkdir()
    fake_run(remote, "a-s0", "completed")
    assert run_tool("collect", remote, out, 0, results=tmp_path / "remote").returncode == 0
    fake_run(remote, "b-s0", "completed")
    assert run_tool("collect", remote, out, 0, results=tmp_path / "remote").returncode == 0
    archives = sorted(out.glob("runs-*.tgz"))
    assert len(archives) == 2  # two collects within one second: the second archive gets a name of its own
    env = {k: v for k, v in os.environ.items() if k != "BLUNB_RESULTS"}  # not needed here
    unpack = subprocess.run(["bash", str(TOOL), "unpack", *archives, home], env=env, capture_output=True, text=True,
                            timeout=60)
    assert unpack.returncode == 0, unpack.stderr
    assert "unpacked 2 run(s)" in unpack.stdout
    assert (home / "a-s0" / "metrics.csv").read_text() == "step,train_loss\n0,3.5\n"
    assert not (home / "a-s0" / "checkpoints").exists()
    # The GPU machine packs the committed runs it was given too: back here those are the same bytes, skipped.
    same = subprocess.run(["bash", str(TOOL), "unpack", *archives, home], env=env, capture_output=True, text=True,
                          timeout=60)
    assert same.returncode == 0 and "unpacked 0 run(s)" in same.stdout and "2 already there, identical" in same.stdout

    (home / "b-s0" / "metrics.csv").write_text("committed\n")
    (home / "a-s0").rename(home / "a-s0.kept")
    again = subprocess.run(["bash", str(TOOL), "unpack", *archives, home], env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "already in" in again.stderr and "b-s0" in again.stderr
    assert not (home / "a-s0").exists()                                   # nothing extracted, not even a-s0
    assert (home / "b-s0" / "metrics.csv").read_text() == "committed\n"
    twice = subprocess.run(["bash", str(TOOL), "unpack", archives[0], archives[0], tmp_path / "new"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert twice.returncode == 1 and "in more than one archive: " in twice.stderr


def test_start_runs_the_study_with_completed_runs_kept(tmp_path):
    """The study folder on the GPU machine holds the committed runs: `start` sets BLUNB_KEEP_COMPLETED=1, under
    which a changed plan stops instead of retraining them (blunb.study.Study)."""
    import nbformat

    seen = tmp_path / "seen.txt"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("study = 'x'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(f"import os\nopen({str(seen)!r}, 'w').write(os.environ['BLUNB_KEEP_COMPLETED'])")])
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    started = run_tool("start", path, results=tmp_path / "results")
    assert started.returncode == 0, started.stderr
    assert seen.read_text() == "1"


def test_collect_drains_the_study_after_drain_after_s_and_start_lifts_it(tmp_path):
    """A lease's last command: after DRAIN_AFTER_S the studies start no more runs (blunb.study.DRAIN_FILE in
    $BLUNB_RESULTS, which every study folder there sees above it); the next start removes it."""
    import nbformat

    from blunb.study import DRAIN_FILE

    results = tmp_path / "results"
    (results / "study").mkdir(parents=True)
    # a stand-in for the study process (collect waits while one is running)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "blunb.study", "x.ipynb",
                                 "--script"])
    try:
        done = run_tool("collect", results / "study", tmp_path, 4, "", 1, results=results)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert done.returncode == 0, done.stderr
    assert "drained after 1 s" in done.stdout and (results / DRAIN_FILE).exists()

    seen = tmp_path / "seen.txt"
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("study = 'x'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(f"import os\nopen({str(seen)!r}, 'w').write(str(os.path.exists("
                                  f"{str(results / DRAIN_FILE)!r})))")])
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    assert run_tool("start", path, results=results).returncode == 0
    assert seen.read_text() == "False"
    drained = run_tool("drain", results=results)
    assert drained.returncode == 0 and (results / DRAIN_FILE).exists(), drained.stderr


def test_collect_fetches_diverged_and_nested_runs_and_names_with_dots(tmp_path):
    """A diverged run is finished (the study reports it); a study inside a study's folder (the Muon study's
    step_cost runs) is collected with it; a run name is matched as it is, not as a pattern."""
    folder, out, home = tmp_path / "results" / "study", tmp_path / "out", tmp_path / "home" / "study"
    out.mkdir()
    fake_run(folder, "lr1e0-s0", "completed")
    fake_run(folder, "div-s0", "diverged")
    fake_run(folder / "step_cost", "adamw-s0", "completed")
    first = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert first.returncode == 0, first.stderr
    assert "(3 finished in all)" in first.stdout
    fake_run(folder, "lr1.0-s0", "completed")  # "lr1.0" read as a regex would match the packed "lr1e0"
    second = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert "finished and not fetched before: lr1.0-s0 (4 finished in all)" in second.stdout
    done = unpack(*sorted(out.glob("runs-*.tgz")), home)
    assert done.returncode == 0, done.stderr
    assert "unpacked 4 run(s)" in done.stdout
    assert (home / "step_cost" / "adamw-s0" / "metrics.csv").exists() and (home / "div-s0" / "status.json").exists()


def test_collect_splits_what_it_packs_into_archives_a_command_can_bring_back(tmp_path):
    """At most 15 MiB of run files per archive and 56 MiB per collect; what is left goes with the next one."""
    folder, out = tmp_path / "results" / "study", tmp_path / "out"
    out.mkdir()
    for k in range(8):
        fake_run(folder, f"big-s{k}", "completed", payload=8 << 20)
    first = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert first.returncode == 0, first.stderr
    archives = sorted(out.glob("runs-*.tgz"))
    assert len(archives) == 6 and all(a.stat().st_size < 16 << 20 for a in archives)  # one 8 MiB run each
    assert "left for the next collect (over this one's 56 MiB): big-s6 big-s7" in first.stdout
    for a in archives:
        a.unlink()
    second = run_tool("collect", folder, out, 0, results=tmp_path / "results")
    assert "finished and not fetched before: big-s6 big-s7" in second.stdout and len(list(out.glob("*.tgz"))) == 2


def test_unpack_refuses_a_damaged_archive_or_an_incomplete_run(tmp_path):
    """A collect or a transfer cut off mid-file leaves a short archive: nothing of it is extracted (a partial
    metrics.csv under a completed status.json would be rendered as if whole)."""
    remote, out, home = tmp_path / "remote" / "study", tmp_path / "out", tmp_path / "home" / "study"
    out.mkdir()
    fake_run(remote, "a-s0", "completed", payload=200_000)
    fake_run(remote, "b-s0", "completed")
    assert run_tool("collect", remote, out, 0, results=tmp_path / "remote").returncode == 0
    [archive] = out.glob("runs-*.tgz")
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    damaged = unpack(cut, home)
    assert damaged.returncode == 1 and "is damaged (cut short?)" in damaged.stderr and not home.exists()
    (remote / "c-s0").mkdir()
    write_status(remote / "c-s0", "completed", 20, 20)   # no config.json, env.json or metrics.csv
    with tarfile.open(tmp_path / "partial.tgz", "w:gz") as tar:
        tar.add(remote / "c-s0", arcname="c-s0")
    partial = unpack(tmp_path / "partial.tgz", home)
    assert partial.returncode == 1 and "run c-s0 in" in partial.stderr and "has no config.json" in partial.stderr
    assert not home.exists()


def test_start_marks_the_runs_copied_from_home_as_fetched(tmp_path):
    """The committed runs copied to the GPU machine are not packed again (their archive alone could pass the size a
    command brings back); runs that finish after the first start are."""
    import nbformat

    results = tmp_path / "results"
    fake_run(results / "study", "home-s0", "completed")
    path = tmp_path / "noop.ipynb"
    cell = nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]})
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    assert run_tool("start", path, results=results).returncode == 0
    fake_run(results / "study", "here-s0", "completed")
    assert run_tool("start", path, results=results).returncode == 0  # a second start marks nothing more
    out = tmp_path / "out"
    out.mkdir()
    collected = run_tool("collect", results / "study", out, 0, results=results)
    assert "finished and not fetched before: here-s0 (2 finished in all)" in collected.stdout
