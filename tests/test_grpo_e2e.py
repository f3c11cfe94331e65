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

from tests.train.e2e import Kill, compare_runs, faulted_run, metrics, run, run_together, running

RECIPE = "recipes/grpo_tiny.yaml"
BASE = ["data.generated.max_operand=9", "stages.0.train.steps=150", "tracking.wandb.enabled=false"]
GRPO = BASE + ["stages.1.train.steps=16", "stages.1.eval.every=0", "stages.1.eval.num_problems=20",
               "stages.1.optimizer.learning_rate=1e-4", "stages.1.checkpoint.every=4",
               "stages.1.grpo.prompts_per_step=8", "stages.1.grpo.group_size=8"]
RESUME = GRPO + ["stages.1.train.steps=8"]  # the crash-safety runs: 8 steps


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_base")
    run(RECIPE, root, BASE + ["--stages", "sft"])  # the GRPO stage is each test's
    assert not (root / "grpo").exists()
    return root / "sft"


def with_base(base, run_dir):
    shutil.copytree(base, run_dir / "sft")
    return run_dir


LEARNS = [
    # (plain top_p = 1 colocated runs are the crash-safety tests' and the probe tests'; vLLM in
    # Ray workers serves a trained policy at fp32 level after every sync in the LoRA test
    # below (vllm_nccl) and multi-turn episodes in tests/test_tools_e2e.py: its 16-step
    # learning run here took ~5 min of CI for nothing those and vllm-colocated do not show)
    ("jax", "disaggregated", 1, 1.0),
    # nucleus sampling: the trainer replays the engine's kept set, so the mismatch stays at the
    # fp32 level (it was ~0.05 when the trainer used the full softmax against truncated samples).
    # vLLM's here; the JAX engine's kept sets are replayed through the same GRPO batch in
    # tests/rollout/test_engines.py::test_jax_engine_logprobs_match_trainer_under_truncation
    ("vllm", "colocated", 0, 0.8)]


@pytest.mark.slow
def test_grpo_tiny_learns(base, tmp_path):
    """Each case of LEARNS learns (the JAX engines with continuous batching in their Ray
    workers: `rollout.continuous_batching`); the runs go at the same time (`run_together`: their
    start-up, compiles and Ray overlap: 180 s, against 120 s and 82 s one after the other)."""
    runs = {}
    for engine, placement, off_policy, top_p in LEARNS:
        runs[engine] = (RECIPE, with_base(base, tmp_path / engine), GRPO + [
            f"stages.1.rollout.engine={engine}", f"stages.1.rollout.placement={placement}",
            f"stages.1.async.off_policy_steps={off_policy}", f"stages.1.grpo.top_p={top_p}",
            "stages.1.rollout.num_workers=2",
            # the JAX workers' 32 rows each (4 prompts x 8) through 16 refilled rows
            *(["stages.1.rollout.max_rows=16", "stages.1.rollout.continuous_batching=true"]
              if engine == "jax" else []),
            "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]",
            "stages.1.rollout.enforce_eager=true"])  # quick vLLM start in tests
    run_together(*runs.values())
    for engine, placement, off_policy, top_p in LEARNS:
        assert_learned(runs[engine][1], placement, off_policy, top_p)


def assert_learned(d, placement, off_policy, top_p):
    m = [x for x in metrics(d / "grpo") if x.get("reward_mean") is not None]
    assert len(m) == 16
    if placement == "disaggregated":  # the trainer's programs compile in step 1, never again
        assert m[0]["compile/count"] > 0  # (measured: 4 programs, 9.6 s; the engines compile
        assert [x["compile/count"] for x in m[1:]] == [0] * 15  # in processes of their own)
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
                  "entropy", "clip_fraction", "completion_len/mean", "groups/zero_variance",
                  "compile/count", "compile/seconds", "compile/cache_hits"):
            assert k in x, k


# LoRA over the Ray transports (object store, gloo) into JAX and vLLM workers is covered bucket
# by bucket, with the probe, by tests/rollout/test_transfer.py::test_ray_transports_deliver_bitwise
# (CI time: the merged export a JAX worker loads is the one vLLM's workers load, and vLLM in
# process takes the same merged tensors as views: test_in_process_transport_into_vllm). vllm_nccl: two
# vLLM workers in processes of their own take each sync through vLLM's NCCL engine (NCCL stood
# in by gloo, `rollout.cuda_standins`), the second at the ranks after the first's.
LORA_ENGINES = [("jax", "colocated", "auto"), ("vllm", "disaggregated", "vllm_nccl")]


@pytest.mark.slow
def test_grpo_with_lora_engines_serve_the_policy(base, tmp_path):
    """A LoRA policy (adapters over the SFT weights) trained by GRPO at lr 1e-3: every engine
    samples from W + (alpha / r) B A after each sync (the colocated JAX engine runs the
    trainer's LoRA modules; the others load merged weights), so the log-probs it reports equal
    the trainer's at fp32 level at every step (mean |dlogp| <= 1e-4 JAX, 1e-3 vLLM), and both
    probes pass each step. Before the fix the JAX engine's prefill and the loss's shared-prefix
    pass ran without the adapters: the adapters got no gradient there, and once they moved the
    JAX engine sampled from another policy (6.9e-3 .. 2.6e-2) while the probe passed."""
    runs = {}
    for engine, placement, transport in LORA_ENGINES:
        runs[engine] = with_base(base, tmp_path / engine), GRPO + [
            "stages.1.train.steps=4", "stages.1.checkpoint.every=0",
            "stages.1.model.lora.rank=8", "stages.1.model.lora.alpha=16",
            "stages.1.optimizer.learning_rate=1e-3",
            f"stages.1.rollout.engine={engine}",
            f"stages.1.rollout.placement={placement}",
            f"stages.1.rollout.transport={transport}",
            f"stages.1.rollout.num_workers={2 if transport == 'vllm_nccl' else 1}",
            "stages.1.rollout.bucket_mb=1",
            "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]",
            "stages.1.rollout.enforce_eager=true",
            # one update shape (the TPU's default), so nothing compiles after step 1,
            # and the probe and the held-out set in the rollout's decode program (as
            # on accelerators; 8 problems: the program's 8 prompts)
            *(["stages.1.grpo.shapes=fixed", "stages.1.rollout.reuse_programs=true",
               "stages.1.eval.num_problems=8",
               # two updates per batch: pi_old scored by the trainer's own pass
               # (the mismatch below is that pass against the engine)
               "stages.1.grpo.mini_batches=2"] if engine == "jax" else [])]
    # both at once (`running`: 197 s, against 68 s and 180 s one after the other)
    with running(RECIPE, *runs["vllm"], POSTTRAIN_CUDA_STANDINS="1"):
        run(RECIPE, *runs["jax"])
    for engine, placement, _ in LORA_ENGINES:
        assert_served(runs[engine][0], engine, placement)


def assert_served(d, engine, placement):
    m = [x for x in metrics(d / "grpo") if x.get("reward_mean") is not None]
    assert len(m) == 4
    if engine == "jax":  # the trainer, the engine, the sync and the probe in this process
        assert m[0]["compile/count"] > 0 and [x["compile/count"] for x in m[1:]] == [0] * 3, \
            [x["compile/count"] for x in m]
        # the engine's decode programs: the rollout's (8 prompts x 8) and the stage report's
        # held-out pass before the stage (16 prompts); the probe and the evaluations ride them
        assert [x["rollout/decode_programs"] for x in m] == [2] * 4
    tol = 1e-3 if engine == "vllm" else 1e-4
    for x in m:
        assert x["mismatch/mean_abs_logp_diff"] <= tol and x["mismatch/kl"] < 1e-4, x
        assert x["sync/probe_gap"] <= tol and x["sync/probe_sampled_gap"] <= tol, x
        if placement == "disaggregated":  # 1 MiB buckets: the 13 MB model streams in many
            assert x["sync/buckets"] > 5
    assert [x["sync/version"] for x in m] == [1, 2, 3, 4]  # a checked sync after every update
    # the adapters moved (B starts at 0): the agreement above is between trained LoRA policies
    from posttrain.train.checkpoint import find_checkpoint, restore_params_flat

    saved = restore_params_flat(*find_checkpoint(d / "grpo"))
    b = [np.abs(v).max() for k, v in saved.items() if "lora_b" in k]
    assert b and min(b) > 1e-3, b


# 16 prompts, 8 per step, a checkpoint every 2 steps: every checkpoint is at an epoch boundary,
# so each resume starts an epoch (a peer's resume there ran zero steps)
EPOCH_CHECKPOINTS = ["stages.1.checkpoint.every=2", "stages.1.data.generated.num_train=16"]
# the recipe's correctness reward, plus one that never returns on about a third of the batches
HANGING_REWARD = ["rewards.functions=[{fn: math, name: correct, kwargs: {fallback_last_number: true}}, "
                  "{fn: tests/rewards_for_tests.py:never_returns_sometimes, weight: 0}]",
                  "rewards.timeout_s=3"]


@pytest.mark.slow
def test_grpo_killed_twice_with_a_hung_reward_resumes_bitwise(base, tmp_path):
    """SIGKILL during a weight sync, then while the reward workers score; a reward that never
    returns on some batches. The resumed run ends bitwise the uninterrupted one (parameters,
    prompts of every step, rewards and losses), and the hung calls cost their timeout, no more:
    each is counted and the step's reward time stays bounded."""
    over = RESUME + HANGING_REWARD + EPOCH_CHECKPOINTS
    a = with_base(base, tmp_path / "a")
    b = with_base(base, tmp_path / "b")
    # weight_sync:3 is the sync after step 3 (checkpoint 2 stands); reward:6 the scoring of
    # step 7's rollouts in the second start (1: the dry run; resumed from 2: steps 3..7), when
    # checkpoint 6 may still be being written (then the restart resumes from 4)
    with running(RECIPE, a, over):  # the uninterrupted run, beside the faulted one
        rec = faulted_run(RECIPE, b, over, [Kill("weight_sync", 3), Kill("reward", 6)],
                          stage="grpo")
    assert [r["delivered"] for r in rec] == [True, True] and rec[1]["checkpoint"] >= 4, rec
    assert compare_runs(a / "grpo", b / "grpo", ("reward_mean", "loss"))["steps"] == 8
    m = [x for x in metrics(a / "grpo") if "time/reward" in x]
    assert m[-1]["rewards/never_returns_sometimes/timeouts"] >= 2  # it did hang, and was cut off
    assert max(x["time/reward"] for x in m) < 3 + 10  # timeout_s + slack for the respawn


@pytest.mark.slow
def test_async_grpo_killed_mid_generation_skips_and_repeats_no_prompt(base, tmp_path):
    """One-step off-policy: killed while the background thread scores batch 4 (generated
    during step 3's update); the resumed run regenerates it with the restored weights, so it
    is not bitwise, but every step trains on the prompts of the seeded schedule, the one an
    uninterrupted run follows (computed here from the recipe, no second run needed)."""
    from posttrain.config import load_recipe
    from posttrain.rollouts import PromptIterator, prompt_rows
    from tests.train.e2e import data_order

    over = RESUME + EPOCH_CHECKPOINTS + ["stages.1.async.off_policy_steps=1"]
    b = with_base(base, tmp_path / "b")
    # reward hits: dry run, the step-0 evaluation, batches 1, 2, 3, then 4 (in the background)
    rec = faulted_run(RECIPE, b, over, [Kill("reward", 6)], stage="grpo")
    assert [r["delivered"] for r in rec] == [True], rec
    cfg = load_recipe(RECIPE, [*over, f"run_dir={b}"])[1]
    schedule = PromptIterator(prompt_rows(cfg, "train"), cfg.data.shuffle_seed)
    want = {}
    for step in range(1, 9):
        schedule.take(cfg.grpo.prompts_per_step)
        want[step] = schedule.last_ids
    assert data_order(b / "grpo") == want  # none skipped, none repeated, across two epochs
    assert len(metrics(b / "grpo")) >= 9


@pytest.mark.slow
def test_grpo_on_a_two_host_trainer_group(base, tmp_path):
    """The trainer as 2 Ray actors x 2 CPU devices (one 4-device mesh over gloo) against one
    process with the same 4 devices, same seeds, 4 steps, one rollout worker, both at once: the
    same rewards at every step (the engines sample the same completions: the weights they get
    differ by float rounding only, see tests/train/test_trainer_group.py for why) and parameters
    within 1e-4 (that GRPO learns is test_grpo_tiny_learns'). The weights leave from the group's
    rank 0 into the object store, bucket by bucket (1 MiB), and the probe passes after every
    sync."""
    runs, specs = {}, []
    for name, extra, devices in (("one", [], 4),
                                 ("group", ["stages.1.trainer.hosts=2",
                                            "stages.1.trainer.devices_per_host=2"], None)):
        d = runs[name] = with_base(base, tmp_path / name)
        specs.append((RECIPE, d, GRPO + extra + [
            "stages.1.train.steps=4", "stages.1.rollout.placement=disaggregated",
            "stages.1.rollout.num_workers=1", "stages.1.rollout.bucket_mb=1",
            "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]"], devices))
    run_together(*specs)
    one, group = ([x for x in metrics(runs[k] / "grpo") if x.get("reward_mean") is not None]
                  for k in ("one", "group"))
    assert len(one) == len(group) == 4
    assert [x["reward_mean"] for x in one] == [x["reward_mean"] for x in group]
    np.testing.assert_allclose([x["loss"] for x in one], [x["loss"] for x in group], rtol=0,
                               atol=1e-6)  # the GRPO loss sits near 0: absolute
    for x in group:
        assert x["sync/probe_gap"] <= 1e-4 and x["sync/buckets"] > 5, x
        assert x["mismatch/mean_abs_logp_diff"] < 1e-3
    from posttrain.train.checkpoint import find_checkpoint, restore_params_flat

    pa, pb = (restore_params_flat(*find_checkpoint(runs[k] / "grpo")) for k in ("one", "group"))
    assert pa.keys() == pb.keys()
    assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) <= 1e-4
