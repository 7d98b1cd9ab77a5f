"""funcensemble installs like a library: ``python -m build`` makes a wheel and an sdist,
the wheel installed into a fresh virtual environment (no ``-e``, no repository on the
path) runs the README's quickstart, and a type checker on a user's file reads the
package's annotations (``py.typed``), from the wheel and from an editable install.

The project is copied to a temporary directory first, so that building writes nothing
into the repository. The fresh environments get no packages but funcensemble: the
dependencies (torch, optree, numpy, jaxtyping, safetensors) come from the running
environment's site-packages, appended to their ``sys.path`` by a ``.pth`` file (nothing
is downloaded).
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# A user's file: the functional face, the optimizer and one deliberate type error.
USER_FILE = """\
from torch import nn

import funcensemble as fe

heads = [nn.Linear(2, 3) for _ in range(4)]
fmodel, params, buffers = fe.stack(heads)
opt = fe.optim.adam(lr=1e-3)
state = opt.init(params)
batched = fe.vmap(fmodel, in_dims=(0, 0, None))
reveal_type(fe.stack)
ens = fe.Ensemble.from_factory(lambda: nn.Linear(2, 3), "four")
"""


def _env() -> dict[str, str]:
    """The environment of a subprocess that must not see the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("packaging")


@pytest.fixture(scope="module")
def project(work) -> Path:
    """A copy of what the build reads: pyproject.toml, README.md and the package."""
    dest = work / "project"
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "funcensemble", dest / "funcensemble", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


@pytest.fixture(scope="module")
def dist(work, project) -> Path:
    """``python -m build`` (the running environment's setuptools: no download)."""
    out = work / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, project], cwd=work)
    return out


def _fresh_venv(path: Path) -> Path:
    """A new virtual environment whose ``sys.path`` ends with our site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = path / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path)
    deps = sysconfig.get_path("purelib")
    Path(purelib.stdout.strip(), "zz_dependencies.pth").write_text(deps + "\n")
    return python


def _pip_install(python: Path, *args) -> None:
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            *list(args),
        ],
        cwd=python.parent,
    )


@pytest.fixture(scope="module")
def wheel_python(work, dist) -> Path:
    """The python of a fresh environment with the built wheel installed (not editable)."""
    python = _fresh_venv(work / "venv-wheel")
    (wheel,) = dist.glob("funcensemble-*.whl")
    _pip_install(python, wheel)
    return python


def _readme_quickstart() -> str:
    """The ```python blocks of the README's Usage section, in order."""
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", usage, flags=re.DOTALL)
    assert len(blocks) >= 2, "the README's Usage section lost its quickstart blocks"
    return "\n".join(blocks)


def test_build_makes_a_wheel_and_an_sdist_with_the_package_and_py_typed(dist):
    (wheel,) = dist.glob("funcensemble-*-py3-none-any.whl")
    (sdist,) = dist.glob("funcensemble-*.tar.gz")
    wheel_names = set(zipfile.ZipFile(wheel).namelist())
    assert {"funcensemble/__init__.py", "funcensemble/py.typed"} <= wheel_names
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in wheel_names)
    with tarfile.open(sdist) as tar:
        sdist_names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {
        "pyproject.toml",
        "README.md",
        "funcensemble/__init__.py",
        "funcensemble/py.typed",
    } <= sdist_names
    metadata = next(n for n in wheel_names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    torch_requirement = re.search(r"^Requires-Dist: torch(.*)$", text, re.M)[1].strip()
    assert sorted(torch_requirement.split(",")) == ["<2.16", ">=2.6.0"], torch_requirement
    assert "Classifier: Typing :: Typed" in text
    assert "Requires-Python: >=3.10" in text


def test_the_wheel_in_a_fresh_venv_runs_the_readme_quickstart(work, wheel_python, tmp_path):
    venv = wheel_python.parent.parent
    code = _readme_quickstart() + textwrap.dedent(
        """
        import funcensemble
        assert losses.shape == (128,) and params["0.weight"].shape == (128, 32, 8)
        print("FILE", funcensemble.__file__)
        """
    )
    # -I: no PYTHONPATH, no user site, no current directory on the path.
    proc = _run([wheel_python, "-I", "-c", code], cwd=tmp_path)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("FILE ")]
    file = Path(line.removeprefix("FILE "))
    assert file.is_relative_to(venv), f"funcensemble came from {file}, not from {venv}"
    assert not file.is_relative_to(ROOT)


def _mypy(python: Path, cwd: Path, cache: Path) -> str:
    (cwd / "user.py").write_text(USER_FILE)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            python,
            "--cache-dir",
            cache,
            "--no-error-summary",
            "user.py",
        ],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
    )
    return proc.stdout + proc.stderr


def _assert_types_resolved(report: str) -> None:
    assert "import-not-found" not in report and "import-untyped" not in report, report
    assert "missing library stubs or py.typed marker" not in report, report
    # The annotations are read: fe.stack's signature, and the str passed for an int.
    assert re.search(r'Revealed type is "def \(modules: .*FunctionalModule', report), report
    assert re.search(
        r'Argument 2 to "from_factory" of "Ensemble" has incompatible type "str"; '
        r'expected "int"',
        report,
    ), report


@pytest.fixture(scope="module")
def mypy_cache(work) -> Path:
    return work / "mypy-cache"  # shared: torch's own types are analysed once


def test_mypy_reads_the_types_of_the_installed_wheel(wheel_python, mypy_cache, tmp_path):
    _assert_types_resolved(_mypy(wheel_python, tmp_path, mypy_cache))


def test_mypy_reads_the_types_of_a_compat_editable_install(work, project, mypy_cache, tmp_path):
    """README: ``pip install -e . --config-settings editable_mode=compat`` for type checkers."""
    python = _fresh_venv(work / "venv-editable")
    _pip_install(
        python, "--no-build-isolation", "--config-settings", "editable_mode=compat", "-e", project
    )
    _assert_types_resolved(_mypy(python, tmp_path, mypy_cache))


def test_mypy_cannot_see_a_default_editable_install(work, project, mypy_cache, tmp_path):
    """Why the README names editable_mode=compat: setuptools' default editable install of
    this flat layout is an import hook, which type checkers do not run."""
    python = _fresh_venv(work / "venv-editable-default")
    _pip_install(python, "--no-build-isolation", "-e", project)
    report = _mypy(python, tmp_path, mypy_cache)
    assert 'Cannot find implementation or library stub for module named "funcensemble"' in report
