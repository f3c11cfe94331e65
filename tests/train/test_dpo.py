"""End to end DPO through `posttrain run`: from a pretrained checkpoint on a preference file, it
learns to prefer the right answers, logs TRL's metrics, resumes bitwise after a kill (the
precomputed reference log-probs read back, not recomputed), and runs on a LoRA policy whose
reference is the policy with its adapters off, in a trainer group of two hosts."""

import json

import numpy as np
import pytest

from tests.train.e2e import Kill, compare_runs, faulted_run, metrics, run

TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


def pairs_file(path, n: int = 400, seed: int = 0):
    """Arithmetic questions, the right answer in the house style chosen over a hedged wrong one
    (TRL's conversational format): a preference a 10-step model can learn from its surface."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.integers(0, 30, 2)
            wrong = a + b + int(rng.choice([-3, -2, -1, 1, 2, 3]))
            f.write(json.dumps({
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "chosen": [{"role": "assistant", "content": f"The answer is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"Maybe {wrong}, or so?"}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    run("recipes/pretrain_tiny.yaml", root / "base",
        ["train.steps=10", "train.eval_every=0", "checkpoint.every=0", "data.seq_len=64"])
    recipe = root / "dpo.yaml"
    recipe.write_text(f"""
name: dpo
algorithm: dpo
model: {{path: {root / 'base'}, scan_layers: false}}
data: {{source: {pairs_file(root / 'pairs.jsonl')}, format: preference, seq_len: 96}}
optimizer: {{learning_rate: 5.0e-4, warmup_steps: 0, schedule: constant}}
train: {{steps: 16, batch_size: 8, log_every: 1}}
checkpoint: {{every: 8}}
dpo: {{beta: 0.5}}
tracking: {{wandb: {{enabled: false}}}}
""")
    run(str(recipe), root / "full", [])
    return root, str(recipe)


@pytest.mark.slow
def test_dpo_learns_the_preferences_and_resumes_bitwise(setup):
    root, recipe = setup
    m = metrics(root / "full")
    assert all(k in x for x in m for k in TRL_METRICS + ("loss", "pairs"))
    acc = [x["rewards/accuracies"] for x in m]
    assert np.mean(acc[-4:]) >= 0.9 > acc[0]  # the step-0 policy is the reference: no margin
    assert np.mean([x["loss"] for x in m[-4:]]) < 0.6 * m[0]["loss"]
    assert m[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # beta * 0 margin: log 2 per pair
    assert (root / "full" / "reference_logps.npz").exists()  # the default for full fine-tuning

    b = root / "resumed"
    rec = faulted_run(recipe, b, [], [Kill("step", 11)])
    assert rec[0]["delivered"], rec
    compare_runs(root / "full", b, ("loss", "rewards/accuracies", "rewards/margins"))


@pytest.mark.slow
def test_lora_dpo_in_a_trainer_group_uses_the_adapters_off_reference(setup):
    root, recipe = setup
    d = root / "lora_group"
    run(recipe, d, ["model.lora.rank=8", "model.lora.alpha=16", "train.steps=6",
                    "checkpoint.every=0", "trainer.hosts=2", "trainer.devices_per_host=1",
                    "optimizer.learning_rate=1.0e-2"])
    m = metrics(d)
    assert m[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # adapters at zero: the reference
    assert m[-1]["rewards/margins"] > m[0]["rewards/margins"]
    assert not (d / "reference_logps.npz").exists()  # auto with LoRA: adapters off, no pass
