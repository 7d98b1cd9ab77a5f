"""What the examples' command lines share: an output folder, a progress bar, optional imports.

Not an example itself. Every script in this folder imports it (Python puts a script's
own folder on ``sys.path``), so that each one:

* writes its files only under ``--out`` (default ``./out/<example>/``), never into the
  repository's ``docs/img/`` unless told to (``make figures`` does);
* shows a tqdm progress bar, which ``--quiet`` turns off;
* imports matplotlib, tqdm, gymnasium and scikit-learn only when it runs, so that
  ``--help`` works without them, and stops with one line naming the extra to install
  when one it needs is missing.
"""

import argparse
import importlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

INSTALL = "pip install '.[examples]'"
# Import name -> the distribution that provides it, for the message.
DISTRIBUTIONS = {"sklearn": "scikit-learn"}


def add_common_options(parser: argparse.ArgumentParser, name: str, *, out: bool = True) -> None:
    """``--quiet`` and, for an example that writes files, ``--out DIR``."""
    if out:
        parser.add_argument(
            "--out",
            type=Path,
            default=Path("out") / name,
            metavar="DIR",
            help=f"folder for the files this example writes (default: ./out/{name}/; "
            "`make figures` passes docs/img)",
        )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def require(prog: str, *modules: str) -> None:
    """Stop with one line naming the extra to install if any of ``modules`` is missing.

    Called right after the arguments are parsed, before any work, so that a run never
    fails at its end for want of a plotting library.
    """
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(DISTRIBUTIONS.get(module, module))
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if missing[1:] else missing)
        raise SystemExit(
            f"{prog}: needs {names}, not installed; install the examples' extra: {INSTALL}"
        )


def apply_quick(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    settings: dict[str, Any],
) -> None:
    """Under ``--quick``, set each of ``settings`` the command line did not give.

    An option given (``--quick --steps 500``) is kept, even where its value is the
    default: the smoke run is a starting point, not a cage.
    """
    if not args.quick:
        return
    given = given_options(parser, argv)
    for name, value in settings.items():
        if name not in given:
            setattr(args, name, value)


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the options ``argv`` gives (``None``: this process's arguments)."""
    not_given = object()  # a default no command line can produce
    dests = {action.dest for action in parser._actions if action.dest != argparse.SUPPRESS}
    saved = {dest: parser.get_default(dest) for dest in dests}
    parser.set_defaults(**dict.fromkeys(dests, not_given))
    try:
        parsed = vars(parser.parse_args(argv))
    finally:
        parser.set_defaults(**saved)
    return {dest for dest, value in parsed.items() if value is not not_given}


def needs(*, quiet: bool, plot: bool, also: Iterable[str] = ()) -> list[str]:
    """The optional modules a run needs: tqdm for the bar, matplotlib for a plot."""
    return [*also, *(["tqdm"] if not quiet else []), *(["matplotlib"] if plot else [])]


class _Silent:
    """A progress bar's interface that shows nothing (``--quiet``)."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable or ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, line: str) -> None:
        print(line)


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    quiet: bool,
    total: int | None = None,
    desc: str | None = None,
    unit: str = "step",
) -> Any:
    """A tqdm bar over ``iterable`` (steps per second on the right), or a silent one.

    ``bar.write(line)`` prints a line without breaking the bar; ``bar.set_postfix``
    shows the current loss.
    """
    if quiet:
        return _Silent(iterable)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True)


def output_file(out: Path, name: str) -> Path:
    """``out / name``, creating the folder ``out`` first."""
    out.mkdir(parents=True, exist_ok=True)
    return out / name
