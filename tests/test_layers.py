"""The package layering (pyproject.toml's import-linter contracts): it holds, every module has
a layer, and a forbidden import or an import cycle added to a copy of the code breaks it."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("posttrain", "rollout", "rewards", "converters")
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_every_module_has_a_layer():
    """A new module must be placed in a layer (else the contract would not look at it)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    placed = [m.strip() for layer in layers for m in layer.replace("|", ":").split(":")]
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    packages_only = {m for m in graph.modules if any(o.startswith(m + ".") for o in placed)}
    loose = sorted(m for m in graph.modules - packages_only
                   if not any(m == p or m.startswith(p + ".") for p in placed))
    assert loose == []


@pytest.fixture
def copy(tmp_path):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "import_contracts.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint(tmp_path).returncode == 0  # the copy is checked, not the installed tree
    return tmp_path


def add_import(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {line}\n")


def test_an_import_from_a_lower_layer_upwards_breaks_them(copy):
    add_import(copy / "posttrain/models/transformer.py", "from rollout.jax_engine import JaxEngine")
    out = lint(copy)
    assert out.returncode == 1
    assert "posttrain.models is not allowed to import rollout" in out.stdout
    assert "posttrain.models.transformer -> rollout.jax_engine" in out.stdout


def test_an_import_cycle_inside_one_layer_breaks_them(copy):
    add_import(copy / "rollout/engine.py", "from rollout.weight_sync import push")
    out = lint(copy)
    assert out.returncode == 1
    assert "An import cycle through" in out.stdout and "rollout.engine -> " in out.stdout
