"""Recipe schema and CLI user errors: exit status 2 and a one-line message naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import RunConfig, load_recipe
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(recipe):
    # 8 devices: the GPU/TPU recipes' meshes are checked against their own topology elsewhere.
    stages = load_recipe(recipe)
    assert stages and all(isinstance(s, RunConfig) for s in stages)
    r = cli("validate", str(recipe), "--devices", "8")
    assert r.returncode == 0, r.stderr


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_key_suggests_closest(tmp_path):
    p = write(tmp_path, "optimizer:\n  lerning_rate: 1e-3\n")
    r = cli("run", str(p))
    assert r.returncode == 2
    assert "optimizer.lerning_rate: unknown key; did you mean optimizer.learning_rate?" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_top_level_key(tmp_path):
    r = cli("run", str(write(tmp_path, "algoritm: sft\n")))
    assert r.returncode == 2 and "algoritm: unknown key; did you mean algorithm?" in r.stderr


def test_wrong_type_names_key(tmp_path):
    r = cli("run", str(write(tmp_path, "train:\n  steps: many\n")))
    assert r.returncode == 2 and "train.steps:" in r.stderr and "integer" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_literal_names_key(tmp_path):
    r = cli("run", str(write(tmp_path, "algorithm: ppo\n")))
    assert r.returncode == 2 and "algorithm:" in r.stderr and "'pretrain'" in r.stderr


def test_missing_recipe_file(tmp_path):
    r = cli("run", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml: recipe file not found" in r.stderr


def test_missing_data_file(tmp_path):
    r = cli("run", str(write(tmp_path, "data:\n  source: missing/train.jsonl\n")))
    assert r.returncode == 2 and "data.source: missing/train.jsonl: no such file" in r.stderr


def test_malformed_yaml(tmp_path):
    r = cli("run", str(write(tmp_path, "train:\n  steps: [1, 2\n")))
    assert r.returncode == 2 and "malformed YAML" in r.stderr and "line" in r.stderr
    assert "Traceback" not in r.stderr


def test_override_typo_and_type(tmp_path):
    p = write(tmp_path, "train:\n  steps: 3\n")
    r = cli("run", str(p), "train.stpes=5")
    assert r.returncode == 2 and "train.stpes: unknown key; did you mean train.steps?" in r.stderr
    r = cli("run", str(p), "train.steps=-1")
    assert r.returncode == 2 and "train.steps: Input should be greater than 0" in r.stderr


def test_override_values_parse_as_yaml_scalars(tmp_path):
    p = write(tmp_path, "train:\n  steps: 3\n")
    (cfg,) = load_recipe(p, ["optimizer.learning_rate=1e-4", "checkpoint.async_save=false",
                             "tracking.wandb.tags=[a, b]"])
    assert cfg.optimizer.learning_rate == 1e-4 and cfg.checkpoint.async_save is False
    assert cfg.tracking.wandb.tags == ["a", "b"] and cfg.train.steps == 3


def test_batch_not_divisible_by_mesh(tmp_path):
    p = write(tmp_path, "train:\n  batch_size: 6\nmesh:\n  ici:\n    fsdp: 4\n")
    r = cli("validate", str(p), "--devices", "4")
    assert r.returncode == 2 and "train.batch_size" in r.stderr and "data x fsdp" in r.stderr


def test_mesh_product_mismatch(tmp_path):
    p = write(tmp_path, "mesh:\n  ici:\n    fsdp: 2\n    tensor: 2\n")
    r = cli("validate", str(p), "--devices", "8")
    assert r.returncode == 2 and "does not match the 8 devices" in r.stderr


def test_stages_merge_and_error_paths(tmp_path):
    p = write(tmp_path, "run_dir: runs/x\ntrain:\n  steps: 3\nstages:\n"
                        "  - name: a\n  - name: b\n    algorithm: sft\n    train:\n      steps: 5\n")
    a, b = load_recipe(p)
    assert (a.train.steps, b.train.steps) == (3, 5)
    assert b.run_dir == str(Path("runs/x/b")) and b.algorithm == "sft"
    bad = write(tmp_path, "stages:\n  - name: a\n    trian: {}\n", "bad.yaml")
    with pytest.raises(UserError, match=r"stages\.0\.trian: unknown key; did you mean stages\.0\.train\?"):
        load_recipe(bad)


def test_config_is_frozen_and_round_trips(tmp_path):
    (cfg,) = load_recipe(write(tmp_path, "train:\n  steps: 7\n"))
    with pytest.raises(Exception):
        cfg.train.steps = 1
    again = write(tmp_path, cfg.to_yaml(), "again.yaml")
    assert load_recipe(again)[0] == cfg
