"""End to end: `posttrain run recipes/pretrain_tiny.yaml` learns, and a run killed twice (once
while a checkpoint was being written, its latest complete checkpoint then corrupted; once
during evaluation) resumes to the same parameters, data order and per-step losses, bitwise.
(More kills, at random: benchmarks/faults.py.)"""

import numpy as np
import pytest

from tests.train.e2e import Kill, compare_runs, faulted_run, metrics, running

RECIPE = "recipes/pretrain_tiny.yaml"
SHORT = ["train.steps=12", "checkpoint.every=4", "train.eval_every=6", "data.seq_len=64",
         "data.generated.num_train=3000", "train.log_every=4"]


@pytest.mark.slow
def test_pretrain_tiny_learns_and_resumes_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    kills = [Kill("checkpoint_write", 3, corrupt=True), Kill("eval", 1)]
    with running(RECIPE, a, SHORT):  # the uninterrupted run, beside the faulted one
        rec = faulted_run(RECIPE, b, SHORT + ["checkpoint.every=2", "checkpoint.keep=3"], kills)
    m = metrics(a)
    assert m[-1]["loss"] < 0.5 * m[0]["loss"]
    evals = [x["eval_loss"] for x in m if x.get("eval_loss") is not None]
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert (a / "config.yaml").is_file() and (a / "hf" / "model.safetensors").is_file()
    assert list((a / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
    # from_pretrained on the Orbax run dir and transformers on the HF export agree (1e-4, fp32)
    from transformers import AutoModelForCausalLM

    from posttrain.models import from_pretrained
    from tests.helpers import torch_logits

    ids = np.array([[5, 9, 17, 33, 2, 8, 40, 41]])
    ours = np.asarray(from_pretrained(a)(ids))
    ref = torch_logits(AutoModelForCausalLM.from_pretrained(a / "hf").float().eval(), ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    assert [r["delivered"] for r in rec] == [True, True], rec
    assert rec[0].get("corrupted") and rec[1]["fell_back"], rec  # fell back past the damage
    compare_runs(a, b, ("loss", "eval_loss"))
