"""Multi-turn GRPO with a tool, end to end on CPU: recipes/tools_tiny.yaml runs on the JAX engine
(both engines' episodes are checked turn by turn in tests/rollout/test_episodes.py, both
placements of each engine single-turn in tests/test_grpo_e2e.py). Each run's episodes call the
calculator (the model's call parsed, executed in a tool worker process, its result appended as
context tokens), take more than one turn, and train token in / token out: the trainer's log-probs of the sampled tokens equal the engine's
(the same bounds as single-turn GRPO), and the probe passes after every sync.

The base is the recipe's SFT stage, short, on chats that all call the tool (so the 2 GRPO steps
have tool calls to run on any engine), copied into each run directory.
"""

import shutil

import pytest

from tests.train.e2e import metrics, run

RECIPE = "recipes/tools_tiny.yaml"
BASE = ["stages.0.train.steps=80", "data.generated.tool_share=1.0", "eval.after_stage=false",
        "tracking.wandb.enabled=false"]
GRPO = BASE + ["stages.1.train.steps=2", "stages.1.eval.every=0", "stages.1.checkpoint.every=0",
               "stages.1.grpo.prompts_per_step=4", "stages.1.grpo.group_size=4",
               "stages.1.rollout.num_workers=1", "stages.1.rollout.enforce_eager=true"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_base")
    run(RECIPE, root, BASE + ["--stages", "sft"])  # the GRPO stage is the test's
    return root / "sft"


@pytest.mark.slow
# vLLM's episodes are checked turn by turn in tests/rollout/test_episodes.py and vLLM in Ray
# workers runs GRPO in tests/test_grpo_e2e.py; the whole multi-turn run here on the JAX engine
# (CI time: the vLLM-disaggregated run cost ~2 min)
@pytest.mark.parametrize("engine,placement", [("jax", "colocated")])
def test_multi_turn_grpo_runs_on_every_engine_and_placement(base, tmp_path, engine, placement):
    d = tmp_path / "run"
    shutil.copytree(base, d / "sft")
    run(RECIPE, d, GRPO + [f"stages.1.rollout.engine={engine}",
                           f"stages.1.rollout.placement={placement}"])
    m = [x for x in metrics(d / "grpo") if x.get("reward_mean") is not None]
    assert len(m) == 2
    for x in m:
        assert x["episodes/with_tool_call"] > 0.5, x  # the SFT model calls the tool
        # some episodes go on after the tool's answer (how many depends on the 80-step base:
        # a call whose result leaves no room for another turn ends the episode by max_tokens)
        assert x["episodes/turns"] > 1.0 and x["episodes/env_tokens"] > 0, x
        assert x["tools/calls"] > 0, x
        assert x["mismatch/mean_abs_logp_diff"] < 1e-3 and x["mismatch/kl"] < 1e-4, x
        assert x["sync/probe_gap"] <= (1e-3 if engine == "vllm" else 1e-4), x
    assert m[-1]["tools/calls"] > m[0]["tools/calls"]  # totals since the start
