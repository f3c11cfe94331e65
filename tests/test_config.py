"""Recipe schema and CLI user errors: exit status 2 and a one-line message naming the key."""

import math
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


def test_every_shipped_recipe_validates():
    """Each recipe against the device count its mesh names (8 where it has a -1 axis): one
    `posttrain validate` of every recipe of a count (each call pays the CLI's imports, ~3 s)."""
    by_count = {}
    for recipe in RECIPES:
        stages = load_recipe(recipe)
        assert stages and all(isinstance(s, RunConfig) for s in stages), recipe
        ici, dcn = stages[-1].mesh.ici.model_dump(), stages[-1].mesh.dcn.model_dump()
        devices = 8 if -1 in ici.values() else math.prod(ici.values()) * math.prod(dcn.values())
        by_count.setdefault(devices, []).append(str(recipe))
    for devices, recipes in by_count.items():
        r = cli("validate", *recipes, "--devices", str(devices))
        assert r.returncode == 0, r.stderr
        assert all(Path(x).name in r.stdout for x in recipes), r.stdout  # each one checked


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# (recipe text or None for a missing file, extra CLI args, fragments the one-line error must hold)
USER_ERRORS = {
    "unknown_key_suggests_closest": ("optimizer:\n  lerning_rate: 1e-3\n", [],
        ["optimizer.lerning_rate: unknown key; did you mean optimizer.learning_rate?"]),
    "unknown_top_level_key": ("algoritm: sft\n", [],
        ["algoritm: unknown key; did you mean algorithm?"]),
    "wrong_type": ("train:\n  steps: many\n", [], ["train.steps:", "integer"]),
    "bad_literal": ("algorithm: ppo\n", [], ["algorithm:", "'pretrain'"]),
    "missing_recipe_file": (None, [], ["nope.yaml: recipe file not found"]),
    "missing_data_file": ("data:\n  source: missing/train.jsonl\n", [],
        ["data.source: missing/train.jsonl: no such file"]),
    "malformed_yaml": ("train:\n  steps: [1, 2\n", [], ["malformed YAML", "line"]),
    "async_key_typo": ("async:\n  off_policy_step: 1\n", [],  # `async` is an alias (keyword)
        ["async.off_policy_step: unknown key; did you mean async.off_policy_steps?"]),
    "async_out_of_range": ("async:\n  off_policy_steps: 2\n", [],
        ["async.off_policy_steps:", "less than or equal to 1"]),
    "override_typo": ("train:\n  steps: 3\n", ["train.stpes=5"],
        ["train.stpes: unknown key; did you mean train.steps?"]),
    "override_bad_value": ("train:\n  steps: 3\n", ["train.steps=-1"],
        ["train.steps: Input should be greater than 0"]),
    "set_override_typo": ("train:\n  steps: 3\n", ["--set", "train.stpes=5"],
        ["train.stpes: unknown key; did you mean train.steps?"]),
    "two_recipes_to_run": ("train:\n  steps: 3\n", ["recipes/sft_tiny.yaml"],
        ["one recipe expected, got 2", "key.sub=value"]),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_user_error_exits_2_with_one_line_naming_the_key(tmp_path, case):
    text, args, fragments = USER_ERRORS[case]
    recipe = tmp_path / "nope.yaml" if text is None else write(tmp_path, text)
    r = cli("run", str(recipe), *args)
    assert r.returncode == 2, r.stderr
    for fragment in fragments:
        assert fragment in r.stderr, (fragment, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


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
    (cfg,) = load_recipe(write(tmp_path, "train:\n  steps: 7\nasync:\n  off_policy_steps: 1\n"))
    with pytest.raises(Exception):
        cfg.train.steps = 1
    assert "async:\n  off_policy_steps: 1" in cfg.to_yaml()  # written under its YAML name
    again = write(tmp_path, cfg.to_yaml(), "again.yaml")
    assert load_recipe(again)[0] == cfg


@pytest.mark.parametrize("placement,transport,ok", [
    ("colocated", "in_process", True), ("colocated", "object_store", False),
    ("disaggregated", "collective", True), ("disaggregated", "in_process", False),
    ("colocated", "auto", True), ("disaggregated", "auto", True)])
def test_weight_transport_must_reach_the_engines(placement, transport, ok):
    from pydantic import ValidationError

    from posttrain.config import RolloutSection

    if ok:
        assert RolloutSection(placement=placement, transport=transport).transport == transport
    else:
        with pytest.raises(ValidationError, match=f"transport '{transport}' cannot reach"):
            RolloutSection(placement=placement, transport=transport)


@pytest.mark.parametrize("overrides,error", [
    (["rollout.placement=colocated"], "trainer.hosts > 1 needs rollout.placement: disaggregated"),
    (["rollout.placement=disaggregated", "rollout.transport=collective"],
     "a trainer group sends weights through the object store"),
    (["rollout.placement=disaggregated", "mesh.dcn.fsdp=4"], "mesh.dcn: its product"),
    (["rollout.placement=disaggregated"], None)])
def test_a_trainer_group_is_checked_against_placement_transport_and_mesh(tmp_path, overrides, error):
    from posttrain.config import check_recipe

    recipe = write(tmp_path, "algorithm: grpo\nmodel: {path: /tmp}\n"
                   "rewards: {functions: [{fn: math}]}\n")
    over = ["trainer.hosts=2", "trainer.devices_per_host=2", *overrides]
    if error is None:
        (cfg,) = load_recipe(recipe, over)
        check_recipe([cfg], 1)  # the mesh covers the group's 2 x 2 devices, not this process's 1
        assert cfg.trainer.resolved_platform == "cpu"
        return
    with pytest.raises(UserError, match=error):
        check_recipe(load_recipe(recipe, over), 1)


@pytest.mark.parametrize("command", ["run", "validate", "plan"])
def test_run_validate_and_plan_take_overrides_in_the_same_forms(command):
    from posttrain.cli import build_parser
    from posttrain.config import recipes_and_overrides

    args, extra = build_parser().parse_known_args(
        [command, "recipes/sft_tiny.yaml", "train.steps=5", "--set", "seed=2"])
    args.items += extra
    assert recipes_and_overrides(args) == (["recipes/sft_tiny.yaml"], ["train.steps=5", "seed=2"])
    (recipe,), overrides = recipes_and_overrides(args)
    (cfg,) = load_recipe(recipe, overrides)
    assert (cfg.train.steps, cfg.seed) == (5, 2)


def test_validate_takes_positional_overrides_and_several_recipes(tmp_path):
    r = cli("validate", "recipes/sft_tiny.yaml", "recipes/pretrain_tiny.yaml", "train.stpes=5")
    assert r.returncode == 2 and r.stderr.count("train.stpes: unknown key") == 2, r.stderr


def test_validate_checks_a_fixed_mesh_against_the_count_it_names():
    """A GPU/TPU recipe validates on a laptop: its fixed mesh names the devices it targets."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}  # 1 device
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "validate",
                        "recipes/grpo_qwen3_30b.yaml", "recipes/grpo_qwen3_30b_v5p64.yaml",
                        "recipes/sft_tiny.yaml"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "checked against 8 devices" in out[0] and "this machine has 1" in out[0]
    assert "checked against 32 devices" in out[1] and "checked against" not in out[2]
    # the named count is still checked: a batch the 8-way mesh cannot split fails
    r = cli("validate", "recipes/grpo_qwen3_30b.yaml", "grpo.prompts_per_step=3")
    assert r.returncode == 2 and "data x fsdp mesh size (8)" in r.stderr, r.stderr


@pytest.mark.parametrize("rollout,error", [
    (dict(engine="jax", transport="vllm_ipc"), "is vLLM's weight-transfer engine"),
    (dict(engine="vllm", placement="disaggregated", transport="vllm_ipc"),
     "reaches vLLM on the trainer's own GPUs .* use vllm_nccl"),
    (dict(engine="vllm", placement="colocated", transport="vllm_nccl"),
     "reaches vLLM on other GPUs .* use vllm_ipc"),
    (dict(engine="vllm", tensor_parallel_size=2, transport="in_process"),
     "its tensor-parallel ranks are processes of their own; use vllm_ipc"),
    (dict(engine="jax", sleep_level=1), "only a colocated vLLM engine sleeps"),
    (dict(engine="vllm", sleep_level=2, probe=False), "sleep_level needs probe: true"),
    (dict(engine="jax", continuous_batching=True), "needs engine: jax and max_rows > 0"),
    (dict(engine="vllm", continuous_batching=True, max_rows=64), "vLLM batches continuously"),
    (dict(engine="jax", continuous_batching=True, max_rows=64), None),
    (dict(engine="vllm", transport="vllm_ipc", tensor_parallel_size=8), None),
    (dict(engine="vllm", placement="disaggregated", transport="vllm_nccl"), None)])
def test_vllm_transports_must_match_engine_placement_and_parallelism(rollout, error):
    from pydantic import ValidationError

    from posttrain.config import RolloutSection

    if error is None:
        RolloutSection(**rollout)
        return
    with pytest.raises(ValidationError, match=error):
        RolloutSection(**rollout)


@pytest.mark.parametrize("rollout,platform,backend", [
    (dict(engine="vllm"), "gpu", "ipc"), (dict(engine="vllm"), "cpu", None),
    (dict(engine="vllm", tensor_parallel_size=2), "cpu", "ipc"),
    (dict(engine="vllm", placement="disaggregated"), "gpu", "nccl"),
    (dict(engine="vllm", placement="disaggregated"), "cpu", None),
    (dict(engine="vllm", placement="disaggregated", transport="object_store"), "gpu", None),
    (dict(engine="jax"), "gpu", None)])
def test_auto_transport_picks_vllms_engine_where_the_model_is_out_of_reach(rollout, platform, backend):
    from posttrain.config import RolloutSection

    assert RolloutSection(**rollout).weight_transfer(platform) == backend


@pytest.mark.parametrize("overrides,error", [
    (["rollout.gpu_memory_utilization=0.3"],
     r"trainer.memory_fraction \(0.75\) \+ rollout.gpu_memory_utilization \(0.3\) = 1.05"),
    (["rollout.tensor_parallel_size=16", "trainer.memory_fraction=0.6"],
     "tensor_parallel_size: 16 ranks of a colocated vLLM engine need as many of the trainer's "
     "devices; the mesh has 8"),
    (["plan.accelerator=v5p"], "vllm_ipc moves weights between GPUs"),
    (["plan.accelerator=v5p", "rollout.transport=auto"], "vllm colocated with a JAX trainer on TPU"),
    (["rollout.sleep_level=1", "async.off_policy_steps=1"], "it cannot sleep then")])
def test_validate_rejects_impossible_colocated_gpu_configurations(overrides, error):
    """The 30B recipe (8 H200s, vLLM colocated at tensor parallel 8 through CUDA IPC) with one
    setting broken: exit 2 and one line naming it."""
    r = cli("validate", "recipes/grpo_qwen3_30b.yaml", *overrides)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert __import__("re").search(error, r.stderr), r.stderr


def test_the_memory_split_reaches_jax_before_it_starts(tmp_path, monkeypatch):
    from posttrain.config import apply_memory_split

    (cfg,) = load_recipe(ROOT / "recipes/grpo_qwen3_30b.yaml")
    assert cfg.memory_fraction() == 0.75
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    apply_memory_split([cfg])
    assert __import__("os").environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.75"
    # the default beside vLLM leaves the environment's choice alone; an explicit one wins
    (dflt,) = load_recipe(ROOT / "recipes/grpo_qwen3_30b.yaml", ["trainer.memory_fraction=null",
                                                                 "rollout.gpu_memory_utilization=0.3"])
    assert dflt.memory_fraction() == 0.65
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    apply_memory_split([dflt])
    assert __import__("os").environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    apply_memory_split([cfg])
    assert __import__("os").environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.75"


def test_run_stages_runs_the_named_stages_each_from_the_one_before(tmp_path, monkeypatch):
    """`posttrain run --stages`: only the named stages run, a stage left out still hands its
    run directory to the next (so GRPO can run again over a finished SFT), and an unknown name
    is an error naming the recipe's stages."""
    import posttrain.runner as runner

    ran = []
    monkeypatch.setattr(runner, "algorithm_fn", lambda name: lambda cfg, d: ran.append(cfg) or {})
    stages = load_recipe("recipes/quickstart.yaml", [f"run_dir={tmp_path}", "eval.after_stage=false"])
    runner.run_stages(stages, ["grpo"])
    (grpo,) = ran
    assert grpo.name == "grpo" and grpo.model.path == str(tmp_path / "sft" / "checkpoints")
    assert not (tmp_path / "pretrain").exists() and not (tmp_path / "sft").exists()
    with pytest.raises(UserError, match="no stage named rl .*pretrain, sft, grpo"):
        runner.run_stages(stages, ["rl"])


def test_hub_ids_with_dots_are_not_local_paths():
    """`Qwen/Qwen3-0.6B` is a hub id (its ".6B" is no file suffix); a data file in a folder,
    a relative or absolute path, and a bare file name are local paths."""
    from posttrain.config import _looks_like_path

    for hub in ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "meta-llama/Llama-3.2-1B", "openai/gsm8k"):
        assert not _looks_like_path(hub), hub
    for local in ("missing/train.jsonl", "./ckpt", "/data/x", "~/m", "runs/a/checkpoints",
                  "data.parquet", "dir/weights.safetensors"):
        assert _looks_like_path(local), local
