"""Notebook parameters are typed (issue 28 case 7): papermill's CLI passes `-p publish false` as the
string "false", which Python counts as true; every notebook and `blunb.study -p` check each value
against the type of its default instead."""

import json
import os
import subprocess
import sys

import pytest

import blunb.study
from blunb.config import ConfigError
from blunb.study import check_parameters, checked_parameters, notebook_defaults
from tests.distributed import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
DEFAULTS = {"steps": 60, "lr": 1e-3, "publish": False, "study": "quickstart", "extra": [], "seeds": [0, 1],
            "target": None}


@pytest.mark.parametrize("given, expected", [
    ({"publish": "false"}, {"publish": False}),
    ({"publish": "FALSE"}, {"publish": False}),
    ({"publish": " True "}, {"publish": True}),
    ({"publish": True}, {"publish": True}),
    ({"steps": "30", "lr": "3e-3"}, {"steps": 30, "lr": 3e-3}),
    ({"steps": 30.0, "lr": 1}, {"steps": 30, "lr": 1.0}),
    ({"steps": None}, {"steps": None}),
    ({"study": 7}, {"study": "7"}),
    ({"extra": ["max_lr=1e-3"], "seeds": (2, 3.0)}, {"extra": ["max_lr=1e-3"], "seeds": [2, 3]}),
    ({"target": "anything"}, {"target": "anything"}),
])
def test_values_take_their_defaults_types(given, expected):
    out = checked_parameters(DEFAULTS, given)
    assert out == expected and all(type(out[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize("given, match", [
    ({"publish": "maybe"}, "parameter publish: expected true or false"),
    ({"publish": 1}, "parameter publish: expected true or false"),
    ({"publish": "0"}, "parameter publish: expected true or false"),
    ({"steps": "many"}, r"parameter steps: expected a number \(int\)"),
    ({"steps": True}, r"parameter steps: expected a number \(int\)"),
    ({"steps": 2.5}, "parameter steps: expected an integer"),
    ({"lr": "fast"}, r"parameter lr: expected a number \(float\)"),
    ({"extra": "a,b"}, r"parameter extra: expected a list like \[\] \(a string is not a list"),
    ({"seeds": ["a"]}, r"parameter seeds\[0\]: expected a number"),
    ({"study": ["x"]}, "parameter study: expected a string"),
    ({"pubish": True}, "unknown parameter 'pubish' \\(did you mean publish\\?\\)"),
])
def test_bad_values_are_errors(given, match):
    with pytest.raises(ConfigError, match=match):
        checked_parameters(DEFAULTS, given)


def test_every_bad_value_is_named_in_one_error():
    with pytest.raises(ConfigError, match="parameter publish: .*; parameter extra: "):
        checked_parameters(DEFAULTS, {"publish": "maybe", "extra": "a,b"})


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_checks_its_parameters_right_after_them(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    i = next(k for k, c in enumerate(code) if "parameters" in c["metadata"].get("tags", []))
    # The cell after the parameters cell (papermill's injected one goes between them) checks them.
    assert f'check_parameters(globals(), "{notebook.name}")' in "".join(code[i + 1]["source"])
    defaults = notebook_defaults(notebook)
    assert isinstance(defaults.get("publish"), bool) and isinstance(defaults.get("allow_dirty"), bool)
    ns = {**defaults, "publish": "false", "unrelated": object()}
    check_parameters(ns, notebook.name)  # looked up in the repo's notebooks/ from here
    assert ns["publish"] is False and ns.keys() == {*defaults, "unrelated"}


def _notebook(path, parameters: str, after: list[str]):
    """A minimal notebook: a parameters cell, the check line, then `after` cells."""
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": parameters, "outputs": [],
              "execution_count": None},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
              "source": f"from blunb.study import check_parameters\ncheck_parameters(globals(), {str(path)!r})"}]
    cells += [{"cell_type": "code", "metadata": {}, "source": s, "outputs": [], "execution_count": None}
              for s in after]
    for i, cell in enumerate(cells):
        cell["id"] = f"cell{i}"
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


def test_papermill_publish_false_writes_nothing_to_the_published_folder(tmp_path):
    papermill = pytest.importorskip("papermill")
    published, scratch = tmp_path / "published", tmp_path / "scratch"
    nb = _notebook(tmp_path / "nb.ipynb", 'publish = False\nextra = []\n',
                   [f"from pathlib import Path\nout = Path({str(published)!r}) if publish else Path({str(scratch)!r})\n"
                    "out.mkdir()\n(out / 'publish.txt').write_text(repr(publish))"])
    # papermill's own CLI turns `-p publish false` into the string "false" (only True/False are bools there)
    papermill.execute_notebook(str(nb), str(tmp_path / "out.ipynb"), parameters={"publish": "false"},
                               kernel_name="python3", progress_bar=False)
    assert not published.exists() and (scratch / "publish.txt").read_text() == "False"
    for params, match in (({"publish": "maybe"}, "parameter publish: expected true or false"),
                          ({"extra": "a,b"}, "parameter extra: expected a list")):
        with pytest.raises(papermill.PapermillExecutionError, match=match):
            papermill.execute_notebook(str(nb), str(tmp_path / "bad.ipynb"), parameters=params,
                                       kernel_name="python3", progress_bar=False)
    assert not published.exists()


def test_the_quickstart_notebook_stops_at_its_check_before_any_work(tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    monkeypatch.setenv("BLUNB_RESULTS", str(tmp_path))
    with pytest.raises(papermill.PapermillExecutionError, match="parameter publish: expected true or false"):
        papermill.execute_notebook(str(REPO / "notebooks" / "00_quickstart.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"publish": "maybe"}, kernel_name="python3", progress_bar=False,
                                   cwd=str(REPO / "notebooks"))
    assert list(tmp_path.iterdir()) == [tmp_path / "out.ipynb"]  # no study folder was made


@pytest.mark.parametrize("params, match", [
    ({"controlled_seeds": 0}, "controlled_seeds must be in"),
    ({"cost_rounds": 0}, "cost_rounds must be >= 1 where real_batch_steps > 0, got 0")])
def test_the_muon_study_refuses_a_bad_plan_before_any_run(params, match, tmp_path):
    """A value of the right type that plans nothing sensible (no controlled seed, no step-cost round) stops the Muon
    study in its setup cell: no run folder is made."""
    args = [arg for key, value in params.items() for arg in ("-p", key, str(value))]
    proc = subprocess.run([sys.executable, "-m", "blunb.study", "notebooks/13_muon_vs_adamw.ipynb", "--script", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "BLUNB_RESULTS": str(tmp_path)})
    assert proc.returncode != 0 and match in proc.stderr, proc.stderr[-2000:]
    assert not any(tmp_path.rglob("config.json"))   # nothing trained


def test_blunb_study_cli_types_its_parameters_before_papermill_runs(tmp_path, monkeypatch, capsys):
    papermill = pytest.importorskip("papermill")
    calls = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: calls.append(k["parameters"]))
    monkeypatch.setattr(sys, "argv", ["blunb-study"])
    nb = str(REPO / "notebooks" / "00_quickstart.ipynb")
    out = ["-o", str(tmp_path / "out.ipynb")]
    blunb.study.main([nb, "-p", "publish", "false", "-p", "steps", "30", "-p", "extra", "['max_lr=1e-3']", *out])
    assert calls == [{"publish": False, "steps": 30, "extra": ["max_lr=1e-3"]}]
    for bad, match in ((["-p", "publish", "maybe"], "parameter publish: expected true or false"),
                       (["-p", "extra", "a,b"], "parameter extra: expected a list"),
                       (["-p", "pubish", "true"], "unknown parameter 'pubish'")):
        with pytest.raises(SystemExit) as exc:
            blunb.study.main([nb, *bad, *out])
        assert exc.value.code == 2 and match in capsys.readouterr().err
    assert len(calls) == 1


def _other_checkout(tmp_path):
    """A second blunb checkout's layout: its notebooks/ beside its own blunb package."""
    (tmp_path / "blunb").mkdir()
    (tmp_path / "blunb" / "__init__.py").write_text("")
    (tmp_path / "notebooks").mkdir()
    nb = tmp_path / "notebooks" / "00_quickstart.ipynb"
    nb.write_text((REPO / "notebooks" / "00_quickstart.ipynb").read_text())
    return nb


def test_a_notebook_of_another_checkout_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Running clone B's notebook with clone A's installed blunb would write A's committed results/."""
    papermill = pytest.importorskip("papermill")
    calls = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(sys, "argv", ["blunb-study"])
    nb = _other_checkout(tmp_path)
    with pytest.raises(ConfigError, match=f"belongs to the checkout {tmp_path}.*PYTHONPATH={tmp_path}"):
        blunb.study.check_same_checkout(nb)
    with pytest.raises(ConfigError, match="belongs to the checkout"):
        check_parameters({}, str(nb))  # the notebook's own first check: Jupyter opened it from clone B
    for argv in ([str(nb)], [str(nb), "--script"]):
        with pytest.raises(SystemExit) as exc:
            blunb.study.main(argv)
        assert exc.value.code == 2 and "belongs to the checkout" in capsys.readouterr().err
    assert calls == []
    blunb.study.check_same_checkout(REPO / "notebooks" / "00_quickstart.ipynb")  # its own checkout: fine
    loose = tmp_path / "elsewhere.ipynb"                                           # not in a checkout: fine
    loose.write_text(nb.read_text())
    blunb.study.check_same_checkout(loose)


def test_blunb_study_gives_the_kernel_its_own_blunb(tmp_path, monkeypatch):
    """The papermill kernel starts in notebooks/, where an editable install of another checkout would win:
    the CLI puts its own checkout first on the kernel's PYTHONPATH, and puts PYTHONPATH back after."""
    papermill = pytest.importorskip("papermill")
    seen = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: seen.append(os.environ.get("PYTHONPATH")))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    blunb.study.main([str(REPO / "notebooks" / "00_quickstart.ipynb"), "-o", str(tmp_path / "out.ipynb")])
    assert seen == [f"{REPO}{os.pathsep}/somewhere"] and os.environ["PYTHONPATH"] == "/somewhere"
    monkeypatch.delenv("PYTHONPATH")
    blunb.study.main([str(REPO / "notebooks" / "00_quickstart.ipynb"), "-o", str(tmp_path / "out.ipynb")])
    assert seen[-1] == str(REPO) and "PYTHONPATH" not in os.environ
