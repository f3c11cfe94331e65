"""GRPO end to end on CPU: each engine and placement learns (mean reward rises) with small
rollout/trainer mismatch, one-step off-policy (async) trains on batches one version stale, and a
killed run resumes to the same final parameters.

The base is the grpo_tiny SFT stage on single-digit problems (learnable in a minute), copied into
each run directory so that only the GRPO stage runs per test. The learning test rewards a
behaviour the policy can shift on every prompt at once (`tests/rewards_for_tests.py`): with the
recipe's arithmetic reward, 16 steps of a 3M-parameter model move the mean reward by less than
its step-to-step noise (measured: 0.20 -> 0.20 in one run, 0.197 -> 0.204 in another), which
made the test a coin flip; with this reward the mean goes from ~0.06 to ~0.6 in 16 steps.
"""

import shutil

import numpy as np
import pytest

from tests.train.e2e import assert_same_final_params, metrics, run

RECIPE = "recipes/grpo_tiny.yaml"
BASE = ["data.generated.max_operand=9", "stages.0.train.steps=150", "tracking.wandb.enabled=false"]
GRPO = BASE + ["stages.1.train.steps=16", "stages.1.eval.every=0", "stages.1.eval.num_problems=20",
               "stages.1.optimizer.learning_rate=1e-4", "stages.1.checkpoint.every=4",
               "stages.1.grpo.prompts_per_step=8", "stages.1.grpo.group_size=8"]
RESUME = GRPO + ["stages.1.train.steps=8"]  # killed after checkpoint 4, resumed to 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_base")
    run(RECIPE, root, BASE + ["stages.1.train.steps=1"])
    return root / "sft"


def with_base(base, run_dir):
    shutil.copytree(base, run_dir / "sft")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("engine,placement,off_policy,top_p", [
    ("jax", "colocated", 0, 1.0), ("vllm", "colocated", 0, 1.0), ("jax", "disaggregated", 1, 1.0),
    ("vllm", "disaggregated", 0, 1.0),
    # nucleus sampling: the trainer replays each engine's kept set, so the mismatch stays at the
    # fp32 level (it was ~0.05 when the trainer used the full softmax against truncated samples)
    ("jax", "colocated", 0, 0.8), ("vllm", "colocated", 0, 0.8)])
def test_grpo_tiny_learns(base, tmp_path, engine, placement, off_policy, top_p):
    d = with_base(base, tmp_path / "run")
    run(RECIPE, d, GRPO + [f"stages.1.rollout.engine={engine}",
                           f"stages.1.rollout.placement={placement}",
                           f"stages.1.async.off_policy_steps={off_policy}",
                           f"stages.1.grpo.top_p={top_p}",
                           "stages.1.rollout.num_workers=2",
                           "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]",
                           "stages.1.rollout.enforce_eager=true"])  # quick vLLM start in tests
    m = [x for x in metrics(d / "grpo") if x.get("reward_mean") is not None]
    assert len(m) == 16
    first = np.mean([x["reward_mean"] for x in m[:4]])
    last = np.mean([x["reward_mean"] for x in m[-4:]])
    assert last > first + 0.1, (first, last)
    for x in m:
        assert x["policy_version"] == x["step"]
        # batch k comes from the weights after k updates, or k - 1 when generated during update k - 1
        assert x["rollout/policy_version"] == max(0, x["step"] - 1 - off_policy)
        if not off_policy:  # the mismatch metrics are logged and small (fp32)
            assert x["mismatch/mean_abs_logp_diff"] < 1e-3
            assert x["mismatch/kl"] < 1e-4
        elif x["step"] > 2:  # one update stale: the trainer's log-probs moved, TIS corrects it
            assert x["mismatch/mean_abs_logp_diff"] > 1e-4
        if top_p < 1:  # what the truncation leaves of the policy is reported
            assert 0 < x["sampling/kept_mass"] < 1
        for k in ("time/rollout", "time/reward", "time/logprob", "time/update", "time/sync",
                  *(["time/rollout_wait"] if off_policy and x["step"] < len(m) else []),
                  "entropy", "clip_fraction", "completion_len/mean", "groups/zero_variance"):
            assert k in x, k


@pytest.mark.slow
@pytest.mark.parametrize("engine,placement,transport", [
    ("jax", "colocated", "auto"), ("vllm", "colocated", "auto"),
    ("jax", "disaggregated", "collective"), ("vllm", "disaggregated", "object_store")])
def test_grpo_with_lora_engines_serve_the_policy(base, tmp_path, engine, placement, transport):
    """A LoRA policy (adapters over the SFT weights) trained by GRPO: every engine serves
    W + (alpha / r) B A after each sync, so its log-probs equal the trainer's as closely as
    without LoRA (same bounds as `test_grpo_tiny_learns`), and the probe passes each step."""
    d = with_base(base, tmp_path / "run")
    run(RECIPE, d, GRPO + ["stages.1.train.steps=3", "stages.1.checkpoint.every=0",
                           "stages.1.model.lora.rank=8", "stages.1.model.lora.alpha=16",
                           "stages.1.optimizer.learning_rate=1e-3",
                           f"stages.1.rollout.engine={engine}",
                           f"stages.1.rollout.placement={placement}",
                           f"stages.1.rollout.transport={transport}",
                           "stages.1.rollout.num_workers=1", "stages.1.rollout.bucket_mb=1",
                           "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]",
                           "stages.1.rollout.enforce_eager=true"])
    m = [x for x in metrics(d / "grpo") if x.get("reward_mean") is not None]
    assert len(m) == 3
    for x in m:
        assert x["mismatch/mean_abs_logp_diff"] < 1e-3 and x["mismatch/kl"] < 1e-4, x
        assert x["sync/probe_gap"] <= (1e-3 if engine == "vllm" else 1e-4), x
        if placement == "disaggregated":  # 1 MiB buckets: the 13 MB model streams in many
            assert x["sync/buckets"] > 5
    assert [x["sync/version"] for x in m] == [1, 2, 3]  # a checked sync after every update


@pytest.mark.slow
def test_grpo_resume_is_exact(base, tmp_path):
    a = with_base(base, tmp_path / "a")
    run(RECIPE, a, RESUME)
    b = with_base(base, tmp_path / "b")
    _kill_grpo_and_resume(b)
    assert_same_final_params(a / "grpo", b / "grpo")
    # same prompts, same order
    ra = [x["reward_mean"] for x in metrics(a / "grpo") if "reward_mean" in x]
    rb = {x["step"]: x["reward_mean"] for x in metrics(b / "grpo") if "reward_mean" in x}
    assert ra == [rb[s] for s in sorted(rb)]


def _kill_grpo_and_resume(run_dir):
    import signal
    import subprocess
    import time

    from tests.train.e2e import ROOT, cmd, env

    p = subprocess.Popen(cmd(RECIPE, run_dir, RESUME), cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = run_dir / "grpo" / "checkpoints"
    deadline = time.time() + 600
    while not (ck / "4").is_dir() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = max(int(x.name) for x in ck.iterdir() if x.name.isdigit())
    assert done < 8, "the run finished before it could be killed"
    run(RECIPE, run_dir, RESUME)


@pytest.mark.slow
def test_grpo_on_a_two_host_trainer_group(base, tmp_path):
    """The trainer as 2 Ray actors x 2 CPU devices (one 4-device mesh over gloo) against one
    process with the same 4 devices, same seeds, 12 steps, one rollout worker: the same rewards at every step (the engines
    sample the same completions: the weights they get differ by float rounding only, see
    tests/train/test_trainer_group.py for why), parameters within 1e-4, and it learns. The
    weights leave from the group's rank 0 into the object store, bucket by bucket (1 MiB), and
    the probe passes after every sync."""
    runs = {}
    for name, extra, devices in (("one", [], 4),
                                 ("group", ["stages.1.trainer.hosts=2",
                                            "stages.1.trainer.devices_per_host=2"], None)):
        d = runs[name] = with_base(base, tmp_path / name)
        run(RECIPE, d, GRPO + extra + ["stages.1.train.steps=12",
                                       "stages.1.rollout.placement=disaggregated",
                                       "stages.1.rollout.num_workers=1",
                                       "stages.1.rollout.bucket_mb=1",
                                       "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]"],
            devices=devices)
    one, group = ([x for x in metrics(runs[k] / "grpo") if x.get("reward_mean") is not None]
                  for k in ("one", "group"))
    assert len(one) == len(group) == 12
    assert [x["reward_mean"] for x in one] == [x["reward_mean"] for x in group]
    np.testing.assert_allclose([x["loss"] for x in one], [x["loss"] for x in group], rtol=0,
                               atol=1e-6)  # the GRPO loss sits near 0: absolute
    for x in group:
        assert x["sync/probe_gap"] <= 1e-4 and x["sync/buckets"] > 5, x
        assert x["mismatch/mean_abs_logp_diff"] < 1e-3
    first = np.mean([x["reward_mean"] for x in group[:4]])
    last = np.mean([x["reward_mean"] for x in group[-4:]])
    assert last > first + 0.1, (first, last)
    from posttrain.train.checkpoint import find_checkpoint, restore_params_flat

    pa, pb = (restore_params_flat(*find_checkpoint(runs[k] / "grpo")) for k in ("one", "group"))
    assert pa.keys() == pb.keys()
    assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) <= 1e-4
