"""Install requirements one distribution at a time, with no pip cache.

The oldest torch we support (2.6.0) exists on PyPI only as the CUDA build: about 2.7 GB
of wheels that unpack to about 5 GB. A plain ``pip install`` keeps every downloaded
wheel (and a cached copy of each) until the last one is installed, so it needs about
twice the disk the result takes; CI's machine once ran out of disk there. This script
resolves the whole set first (metadata only), then installs each distribution on its
own with ``--no-deps --no-cache-dir``, so at most one wheel lies on disk beside what is
already installed.

The newest torch CI tests (``make test-newest``) is installed the same way: PyPI's
default build of it is the CUDA one too (about 5.5 GB installed).

Run it with the target environment's interpreter::

    .venv-oldest/bin/python .ci/lean_install.py torch==2.6.0
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

PIP = [sys.executable, "-m", "pip"]


def resolve(requirements: list[str]) -> list[str]:
    """``name==version`` for each distribution pip would install for ``requirements``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        dry_run = ["install", "--quiet", "--no-cache-dir", "--dry-run", "--report", str(report)]
        subprocess.run([*PIP, *dry_run, *requirements], check=True)
        plan = json.loads(report.read_text())["install"]
    return [f"{d['metadata']['name']}=={d['metadata']['version']}" for d in plan]


def main(requirements: list[str]) -> None:
    pins = resolve(requirements)
    print(f"lean_install: {len(pins)} distributions, one at a time", flush=True)
    for pin in pins:
        subprocess.run([*PIP, "install", "--quiet", "--no-cache-dir", "--no-deps", pin], check=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python .ci/lean_install.py REQUIREMENT [REQUIREMENT ...]")
    main(sys.argv[1:])
