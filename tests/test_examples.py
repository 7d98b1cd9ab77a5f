"""The examples run, in quick mode, and check what they claim; their command lines work
without the optional dependencies and write nowhere but ``--out``."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
from helpers import load_example

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
OPTIONAL = ["matplotlib", "tqdm", "gymnasium", "sklearn"]  # what the examples extra brings
INSTALL = "pip install '.[examples]'"


def load(name: str) -> ModuleType:
    return load_example(name)


def test_multihead_quick_agrees_with_the_loop(capsys):
    multihead = load("multihead")
    results = multihead.main(["--quick"])
    out = capsys.readouterr().out
    assert len(results) == len(multihead.variants()) >= 2
    for r in results:
        assert r.losses.shape == (16,)
        assert r.steps_per_s > 0
        assert r.name in out
    assert "end at the same loss in every variant" in out


def test_multihead_options():
    multihead = load("multihead")
    results = multihead.main(["--heads", "3", "--steps", "2", "--batch", "5"])
    assert [r.losses.shape for r in results] == [(3,)] * len(results)
    with pytest.raises(SystemExit):  # it writes nothing: no --out (docs/examples.md)
        multihead.main(["--out", "somewhere"])


def test_multihead_fails_when_a_variant_disagrees(monkeypatch):
    multihead = load("multihead")
    loop = multihead.loop_variant

    def off_by_a_step(heads, x, y):
        step, trained = loop(heads, x, y)
        step()  # one extra step: different final losses
        return step, trained

    found = multihead.variants()
    monkeypatch.setattr(multihead, "variants", lambda: {**found, "broken": off_by_a_step})
    with pytest.raises(AssertionError, match="broken: per-head final losses differ"):
        multihead.main(["--heads", "4", "--steps", "3"])


def test_multihead_rejects_bad_options():
    multihead = load("multihead")
    with pytest.raises(SystemExit):
        multihead.main(["--heads", "0"])


def test_every_example_is_tested():
    tests = Path(__file__).resolve().parent
    sources = "\n".join(p.read_text() for p in tests.glob("test_*.py"))
    untested = [name for name in SCRIPTS if name not in sources]
    assert not untested, f"examples without a test running them: {untested}"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_keeps_the_options_given(name, monkeypatch):
    # Found by an audit: --quick overwrote --members, --steps and the like when given
    # with it. Options given are kept, even at their default value.
    ex = load(name)
    first, second, *rest = ex.QUICK
    given = {first: ex.QUICK[first] + 1, second: ex.build_parser().get_default(second)}
    assert given[second] != ex.QUICK[second]
    real, seen = ex._cli.apply_quick, {}

    def apply_and_stop(parser, args, argv, settings):
        real(parser, args, argv, settings)
        seen["args"] = args
        raise _Stop

    monkeypatch.setattr(ex._cli, "apply_quick", apply_and_stop)
    argv = ["--quick"]
    for key, value in given.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    with pytest.raises(_Stop):
        ex.main(argv)
    values = vars(seen["args"])
    assert {key: values[key] for key in given} == given
    assert {key: values[key] for key in rest} == {key: ex.QUICK[key] for key in rest}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_a_help_text(name):
    parser = load(name).build_parser()
    options = [a for a in parser._actions if a.option_strings]
    assert len(options) > 2
    silent = [a.option_strings[0] for a in options if not a.help]
    assert not silent, f"{name}: options without a help text: {silent}"
    quiet = [a for a in options if "--quiet" in a.option_strings]
    assert quiet and quiet[0].default is False


# Runs every example's --help, then its --quick run, in one interpreter in
# which the optional packages cannot be imported (None in sys.modules), as a script
# (run_path as __main__, its folder on sys.path). Prints what each did as JSON.
_BLOCKED_RUNS = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    blocked, examples, names = sys.argv[1].split(","), *sys.argv[2:4]
    for module in blocked:
        sys.modules[module] = None
    sys.path.insert(0, examples)
    results = {}
    for name in names.split(","):
        for case, argv in (("help", ["--help"]), ("run", ["--quick"])):
            sys.argv = [name + ".py", *argv]
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    runpy.run_path(f"{examples}/{name}.py", run_name="__main__")
                    code = "finished"
                except SystemExit as exit:
                    code = exit.code
            results[f"{name} {case}"] = [code, out.getvalue(), err.getvalue()]
    print(json.dumps(results))
    """
)


def run_blocked(names: list[str], out: Path) -> dict[str, list]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [",".join(OPTIONAL), str(EXAMPLES), ",".join(names)]
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUNS, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,  # where a run would write ./out/<example>/
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_help_and_a_missing_dependency_without_the_optional_packages(tmp_path):
    results = run_blocked(SCRIPTS, tmp_path)
    for name in SCRIPTS:
        code, out, err = results[f"{name} help"]
        assert code == 0, (name, code, err)
        assert out.startswith(f"usage: {name}.py") and "--quiet" in out, (name, out)
        code, out, err = results[f"{name} run"]
        # One line naming what is missing and the extra to install; no traceback.
        assert isinstance(code, str) and "\n" not in code, (name, code, err)
        assert code.startswith(f"{name}.py: needs ") and code.endswith(INSTALL), code
        assert "Traceback" not in out + err
    assert not list(tmp_path.iterdir()), "a refused run wrote files"
    assert "needs scikit-learn, tqdm and matplotlib," in results["digits_ensemble run"][0]
    assert "needs gymnasium, tqdm and matplotlib," in results["rl_q_ensemble run"][0]
    assert "needs tqdm," in results["multihead run"][0]


def test_a_missing_dependency_is_one_line_on_stderr(tmp_path):
    # The real thing: `python examples/x.py` with tqdm unimportable (a sitecustomize
    # puts None in sys.modules), so Python itself prints the SystemExit message.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['tqdm'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "multihead.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert (
        done.stderr
        == f"multihead.py: needs tqdm, not installed; install the examples' extra: {INSTALL}\n"
    )


def test_quiet_needs_no_progress_bar_package(monkeypatch, capsys):
    import _cli

    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(SystemExit, match=r"needs tqdm, not installed"):
        _cli.require("x.py", *_cli.needs(quiet=False, plot=False))
    _cli.require("x.py", *_cli.needs(quiet=True, plot=False))  # nothing missing
    bar = _cli.progress(range(3), quiet=True)
    assert list(bar) == [0, 1, 2]
    bar.set_postfix(loss="1.0")
    bar.write("a line")
    assert capsys.readouterr().out == "a line\n"


def test_outputs_go_to_a_fresh_out_folder_not_to_the_docs(tmp_path, monkeypatch):
    docs_img = ROOT / "docs" / "img"
    before = {p.name: p.read_bytes() for p in docs_img.iterdir()}
    monkeypatch.chdir(tmp_path)
    load("lr_sweep").main(["--members", "2", "--steps", "3", "--samples", "16", "--quiet"])
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == [
        "out",
        "out/lr_sweep",
        "out/lr_sweep/lr_sweep.png",
    ]
    assert {p.name: p.read_bytes() for p in docs_img.iterdir()} == before


def test_the_examples_extra_brings_what_the_examples_import():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    names = {req.split(">")[0].split("<")[0].split("[")[0].strip() for req in extras["examples"]}
    dist = {"sklearn": "scikit-learn"}
    assert {dist.get(m, m) for m in OPTIONAL} <= names
    assert "funcensemble[examples]" in extras["dev"]
    assert {"gymnasium", "tqdm"} <= {req.split(">")[0].strip() for req in extras["rl"]}
    # The message names that extra, and no example imports an optional package early.
    for name in SCRIPTS:
        source = (EXAMPLES / f"{name}.py").read_text()
        top = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in top if line.split()[1].split(".")[0] in OPTIONAL], name
