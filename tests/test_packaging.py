"""ember as a wheel: built from the checkout, installed in a fresh virtual environment, it compiles and runs
the demo, and the runtime `ember package` gathers from it loads the artifact with TVM's runtime library alone.

The virtual environment is a newcomer's: it borrows nothing from the system's site-packages, and the wheel's own
dependencies (and its `serve` extra's) are installed into it by pip, so a dependency the wheel forgets to declare
fails here. The test also checks that it imports the installed wheel's ember, not the editable checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from helpers import REPO_ROOT
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow  # a wheel build, a virtual environment and a compile: over a minute on 2 cores

RUNTIME_REQUIREMENTS = REPO_ROOT / "runtime" / "requirements.txt"
# What the wheel is built from; never the checkout's own build/ or egg-info, which the shared tree keeps.
NOT_SOURCES = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".pytest_cache", "artifacts",
                                     ".venv", "dist")


def check(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output if it fails."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result


def requirements(lines: list[str]) -> dict[str, Requirement]:
    """Requirement lines (comments and blanks skipped) by normalized project name."""
    parsed = [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    return {req.name.lower().replace("_", "-"): req for req in parsed}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment, without the system's site-packages, holding ember's wheel (built from a copy of
    the checkout) with its dependencies and the `serve` extra's, installed by pip as a newcomer's would be."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCES, symlinks=True)
    check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist",
           source])
    (wheel,) = (root / "dist").glob("ember-*.whl")
    check([sys.executable, "-m", "venv", root / "venv"])
    check([root / "venv" / "bin" / "python", "-m", "pip", "install", "-q", f"ember[serve] @ {wheel.as_uri()}"])
    return root / "venv"


def test_the_venv_borrows_nothing_from_the_system(venv):
    """TVM and numpy come from the venv's own site-packages: a package the wheel does not declare is missing."""
    script = ("import numpy, tvm, sysconfig; print(numpy.__file__); print(tvm.__file__); "
              "print(sysconfig.get_paths()['purelib'])")
    numpy_file, tvm_file, site_packages = check([venv / "bin" / "python", "-c", script], cwd=venv).stdout.split()
    assert Path(numpy_file).is_relative_to(site_packages) and Path(tvm_file).is_relative_to(site_packages)


def test_the_venv_imports_the_installed_wheel_not_the_checkout(venv):
    found = check([venv / "bin" / "python", "-c", "import ember; print(ember.__file__)"], cwd=venv).stdout.strip()
    site_packages = check([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          cwd=venv).stdout.strip()
    assert Path(found).is_relative_to(site_packages), found
    assert not Path(found).is_relative_to(REPO_ROOT), found


def test_the_wheel_compiles_runs_and_packages_the_demo(venv, tmp_path):
    """From the wheel's `ember` command: compile the demo, generate from it, and package it; then the package
    alone (PYTHONPATH=PKG, TVM's runtime library only) loads the artifact, generates the same greedy text, and
    reports the wheel's version."""
    ember = venv / "bin" / "ember"
    check([ember, "compile", "demo", "-o", "art", "--no-progress"], cwd=tmp_path)
    generated = check([ember, "generate", "art", "--prompt", "And the LORD said", "--max-new-tokens", "4",
                       "--temperature", "0"], cwd=tmp_path)
    check([ember, "package", "art", "-o", "pkg"], cwd=tmp_path)
    wheel_version = check([venv / "bin" / "python", "-c", "from importlib import metadata; "
                           "print(metadata.version('ember'))"], cwd=tmp_path).stdout.strip()

    script = (
        "import json\n"
        "import ember\n"
        "from ember.runtime import Engine, SamplingParams, generate, load_artifact\n"
        "from importlib import metadata\n"
        "engine = Engine(load_artifact('pkg/artifact'))\n"
        "text = ''.join(generate(engine, 'And the LORD said', SamplingParams(temperature=0, max_new_tokens=4)))\n"
        "print(ember.__file__)\n"
        "print(ember.__version__, metadata.version('ember'))\n"
        "print(json.dumps(text))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "TVM_USE_RUNTIME_LIB": "1"}
    lines = check([sys.executable, "-c", script], cwd=tmp_path, env=env).stdout.splitlines()
    module_file, versions, text = lines[-3:]
    assert Path(module_file).is_relative_to(tmp_path / "pkg"), module_file
    assert versions.split() == [wheel_version, wheel_version], versions
    assert wheel_version == tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert json.loads(text) and json.loads(text) in generated.stdout, (text, generated.stdout)
    packaged = (tmp_path / "pkg" / "requirements-runtime.txt").read_text().splitlines()
    assert requirements(packaged) == requirements(RUNTIME_REQUIREMENTS.read_text().splitlines())


def test_from_the_checkouts_root_the_wheel_is_what_runs(venv, tmp_path):
    """In a checkout's root (a copy, its own files and links as Git has them), the non-editable install's ember is
    the one imported, by this process and by TVM's tuning workers it starts there: `import ember.runtime`, the
    README's Python snippet, and `ember tune` with its worker processes all work."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT, root, ignore=NOT_SOURCES, symlinks=True)
    python, ember = venv / "bin" / "python", venv / "bin" / "ember"
    found = check([python, "-c", "import ember.runtime; print(ember.runtime.__file__)"], cwd=root).stdout.strip()
    assert not Path(found).is_relative_to(root), found
    check([ember, "compile", "demo", "-o", "demo-cpu", "--no-progress"], cwd=root)
    snippet = README_SNIPPET.search((REPO_ROOT / "README.md").read_text()).group(1)
    assert "load_artifact" in snippet, snippet
    assert check([python, "-c", snippet], cwd=root).stdout.strip()
    check([ember, "tune", "demo", "--db", "tuning-db", "--trials", "4", "--budget", "1", "--kernels", "1"], cwd=root)


# The README's Python snippet that runs an artifact without a server.
README_SNIPPET = re.compile(r"```python\n(from ember\.runtime import .*?)```", re.DOTALL)


def test_the_wheel_analyzes_and_serves_with_its_data_files(venv, tmp_path):
    """The wheel's hardware presets, chat page and server: `ember analyze` on a board preset, and `ember serve` of
    a demo compiled with --embeddings answering / (the chat page) and /v1/embeddings; stopped by its own PID."""
    ember = venv / "bin" / "ember"
    analysis = check([ember, "analyze", "demo", "--hardware", "raspberry-pi-5"], cwd=tmp_path).stdout
    assert "on raspberry-pi-5: Raspberry Pi 5" in analysis, analysis
    serve_help = check([ember, "serve", "--help"], cwd=tmp_path).stdout
    assert all(option in serve_help for option in ("--ray", "--chat-template", "--pooling")), serve_help
    check([ember, "compile", "demo", "-o", "art", "--embeddings", "--no-progress"], cwd=tmp_path)
    server = subprocess.Popen([ember, "serve", "art", "--port", "0", "--threads", "1"], cwd=tmp_path,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()  # once it listens, or when it ends
        match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        assert match, line
        base = match.group(1)
        with urllib.request.urlopen(base + "/", timeout=60) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
        request = urllib.request.Request(base + "/v1/embeddings", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "art", "input": "And the LORD said"}).encode())
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert len(json.load(answer)["data"][0]["embedding"]) == 256  # the demo's hidden size
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_runtime_requirements_pin_what_pyproject_pins():
    """runtime/requirements.txt (the device's requirements) names each package with pyproject.toml's pin."""
    runtime = requirements(RUNTIME_REQUIREMENTS.read_text().splitlines())
    project = requirements(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert {"apache-tvm", "apache-tvm-ffi", "numpy", "tokenizers", "jinja2"} <= runtime.keys()
    for name, requirement in runtime.items():
        assert name in project, f"{name}: in runtime/requirements.txt, not in pyproject.toml's dependencies"
        assert requirement.specifier == project[name].specifier, (name, str(requirement), str(project[name]))
