"""The layout's rules, checked on every run: import contracts (pyproject.toml) and module size (issue 21).

The contracts are checked by running `lint-imports`, as CI does (so e2e: a subprocess); how
many there are is read from pyproject.toml, so a contract added there is one this test expects kept.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 350


def declared_contracts() -> list[str]:
    return [c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]


@pytest.mark.e2e
def test_every_import_contract_declared_in_pyproject_is_kept():
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is part of the dev extra: pip install -e '.[dev]'"
    r = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False, env={**os.environ, "COLUMNS": "1000"})  # a name per line
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    declared = declared_contracts()
    assert declared, "pyproject.toml declares no [[tool.importlinter.contracts]]"
    summary = re.search(r"Contracts: (\d+) kept, (\d+) broken", r.stdout)
    assert summary and summary.groups() == (str(len(declared)), "0"), r.stdout[-3000:]
    kept = {line.removesuffix(" KEPT").strip() for line in r.stdout.splitlines() if line.endswith(" KEPT")}
    assert kept == set(declared), r.stdout[-3000:]


@pytest.mark.unit
def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "ramjet").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules along their concerns: {long}"
