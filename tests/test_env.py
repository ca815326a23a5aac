"""How blunb installs on a stock machine: the declarations (torch range, the interpreter's triton, entry
points, environment.yml) and pip's own resolution of both install paths with this machine's pip
configuration switched off. `make check-env` runs this file.

- CPU path: environment.yml's pip block (the CPU index's torch, then blunb[dev,notebook]) and the
  Makefile's first step (torch alone from TORCH_INDEX): a CPU torch, nothing CUDA, the interpreter's triton.
- CUDA path: PyPI's torch (on Linux the CUDA build) with blunb[dev,notebook]: the triton torch pins
  is the one resolved, so blunb never changes the pair a CUDA torch brings.
`pip install --dry-run --report` fetches metadata only; an unreachable index skips, saying which.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import urllib.request

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.distributed import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPI = "https://pypi.org/simple"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
PIP_BLOCK = next(d["pip"] for d in yaml.safe_load((REPO / "environment.yml").read_text())["dependencies"]
                 if isinstance(d, dict))
# The stacks blunb is tested on, with the triton PyPI's CUDA torch pins for Linux (ARCHITECTURE.md, Machines).
TESTED_PAIRS = {"2.11.0": "3.6.0", "2.13.0": "3.7.1"}
SCRIPTS = {"blunb-train": "blunb.train:main", "blunb-data": "blunb.data:main", "blunb-study": "blunb.study:main",
           "blunb-ckpt": "blunb.ckpt_cli:main"}


def makefile_default(name: str) -> str:
    m = re.search(rf"^{name} \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no `{name} ?= ...`"
    return m.group(1)


def requirement(name: str, requirements: list[str]) -> Requirement:
    (req,) = [r for r in map(Requirement, requirements) if canonicalize_name(r.name) == name]
    return req


def active(req: Requirement, environment: dict) -> bool:
    return req.marker is None or req.marker.evaluate({**environment, "extra": ""})


TORCH_RANGE = requirement("torch", PROJECT["dependencies"]).specifier
DEV_TRITON = requirement("triton", PROJECT["optional-dependencies"]["dev"])


# ---------------------------------------------------------------- the declarations (offline)

def test_torch_range_is_the_tested_stacks():
    assert all(v in TORCH_RANGE for v in TESTED_PAIRS) and "2.14.0" not in TORCH_RANGE and "2.10.0" not in TORCH_RANGE


def test_dev_triton_admits_the_pair_every_tested_torch_pins():
    # Satisfied by each pin, pip leaves a CUDA torch's own triton alone ("only if needed").
    assert all(pin in DEV_TRITON.specifier for pin in TESTED_PAIRS.values()), DEV_TRITON


@pytest.mark.parametrize("sys_platform, machine, wanted", [
    ("linux", "x86_64", True), ("linux", "aarch64", False), ("darwin", "arm64", False), ("darwin", "x86_64", False),
    ("win32", "AMD64", False)])
def test_triton_is_asked_for_only_where_it_has_wheels(sys_platform, machine, wanted):
    env = {**default_environment(), "sys_platform": sys_platform, "platform_machine": machine}
    assert active(DEV_TRITON, env) == wanted


def test_makefile_and_environment_yml_install_the_same_cpu_torch():
    version, index = makefile_default("TORCH_VERSION"), makefile_default("TORCH_INDEX")
    assert version in TORCH_RANGE and version in TESTED_PAIRS
    assert PIP_BLOCK == [f"--extra-index-url {index}",
                         f'torch=={version}+cpu; sys_platform == "linux" or sys_platform == "win32"',
                         f'torch=={version}; sys_platform == "darwin"',
                         "-e .[dev,notebook]"]  # everything else comes from pyproject: nothing twice


def test_console_scripts_are_declared_and_resolve_to_callables():
    assert PROJECT["scripts"] == SCRIPTS
    for target in SCRIPTS.values():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
    try:
        installed = {ep.name: ep.value for ep in importlib.metadata.distribution("blunb").entry_points
                     if ep.group == "console_scripts"}
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("blunb is not installed (pip install -e .)")
    assert installed == SCRIPTS, "the installed metadata is stale: pip install -e . again"


@pytest.mark.slow
def test_interpreter_tests_skip_cleanly_without_triton(tmp_path):
    """What a macOS machine sees: no triton, so conftest skips the modules that need it."""
    modules = ["test_fused_kernels.py", "test_flash_attention.py", "test_flash_attention_gpu.py", "test_syrk.py"]
    code = ("import sys; sys.modules['triton'] = None  # import triton now fails, as where it is not installed\n"
            "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider",
                           *(str(REPO / "tests" / m) for m in modules)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: every module skipped
    assert f"{len(modules)} skipped" in proc.stdout and "triton is not installed" in proc.stdout, proc.stdout


# ---------------------------------------------------------------- pip's resolution, as a stock machine sees it

def stock_pip_env() -> dict:
    """This environment without any pip configuration: no PIP_* variables, no config files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def test_the_stock_pip_environment_has_no_configuration():
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          env=stock_pip_env(), timeout=120)
    # The only setting left is the one that switches the files off.
    assert proc.returncode == 0 and proc.stdout.split() == [f":env:.config-file='{os.devnull}'"], proc.stdout


def require_index(url: str) -> None:
    """Skip unless the package index answers within a few seconds (an offline machine skips at once)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/torch/", timeout=10) as reply:
            reply.read(1)
    except OSError as err:
        pytest.skip(f"package index {url} unreachable ({err}): its install path was not checked")


_NETWORK_ERRORS = ("Retrying (", "NewConnectionError", "NameResolutionError", "ReadTimeoutError",
                   "ConnectTimeoutError", "ConnectionResetError", "IncompleteRead")


def resolve(requirements: list[str], tmp_path, name: str) -> dict[str, dict]:
    """pip's dry-run resolution of a fresh environment from `requirements` (requirements-file lines,
    run from the repository like `conda env create` runs environment.yml): {name: its metadata}."""
    req_file, report = tmp_path / f"{name}.txt", tmp_path / f"{name}.json"
    req_file.write_text("\n".join(requirements) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "--timeout", "30", "--retries", "2",
                           "--report", str(report), "-r", str(req_file)],
                          capture_output=True, text=True, env=stock_pip_env(), cwd=REPO, timeout=600)
    if proc.returncode != 0 and any(e in proc.stderr for e in _NETWORK_ERRORS):
        pytest.skip(f"pip lost the package index mid-way ({name}): {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"pip cannot resolve the {name} path:\n{proc.stderr[-6000:]}"
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}


def triton_pinned_by(torch: dict) -> list[Requirement]:
    """The triton requirements the resolved torch itself declares for this interpreter and platform."""
    reqs = [Requirement(r) for r in torch.get("requires_dist", [])]
    return [r for r in reqs if canonicalize_name(r.name) == "triton" and active(r, default_environment())]


def cuda_packages(resolved: dict) -> list[str]:
    return sorted(n for n in resolved if n.startswith(("nvidia-", "cuda-")))


def check_interpreter_triton(resolved: dict) -> None:
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert resolved["triton"]["version"] in DEV_TRITON.specifier
    else:
        assert "triton" not in resolved


@pytest.mark.network
@pytest.mark.slow
def test_cpu_path_resolves_a_cpu_torch_and_the_interpreters_triton(tmp_path):
    index, version = makefile_default("TORCH_INDEX"), makefile_default("TORCH_VERSION")
    require_index(index)
    require_index(PYPI)
    # The Makefile's first step: torch alone, from the CPU index alone.
    first = resolve(["--index-url " + index, f"torch=={version}"], tmp_path, "make-env-torch")
    env_yml = resolve(PIP_BLOCK, tmp_path, "environment-yml")
    for resolved in (first, env_yml):
        torch = resolved["torch"]
        assert Version(torch["version"]).public == version
        if sys.platform != "darwin":
            assert Version(torch["version"]).local == "cpu"
        assert triton_pinned_by(torch) == [] and cuda_packages(resolved) == []
    check_interpreter_triton(env_yml)


@pytest.mark.network
@pytest.mark.slow
def test_cuda_path_keeps_the_triton_torch_pins(tmp_path):
    version = makefile_default("TORCH_VERSION")
    require_index(PYPI)
    resolved = resolve([f"torch=={version}", "-e .[dev,notebook]"], tmp_path, "pypi-torch")
    torch, triton = resolved["torch"], resolved.get("triton")
    assert torch["version"] == version
    pins = triton_pinned_by(torch)
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert cuda_packages(resolved), "PyPI's Linux torch is expected to be the CUDA build"
        assert [str(p.specifier) for p in pins] == [f"=={TESTED_PAIRS[version]}"], pins
    # No downgrade, no second triton: exactly the one torch asks for (or, where it asks for none, ours).
    if pins:
        assert all(triton["version"] in p.specifier for p in pins), (triton, pins)
    else:
        check_interpreter_triton(resolved)
