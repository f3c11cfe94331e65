"""End to end SFT: losses fall, LoRA trains only adapters, a killed run resumes bitwise."""

import numpy as np
import pytest

from tests.train.e2e import Kill, compare_runs, faulted_run, final_params, metrics, run

RECIPE = "recipes/sft_tiny.yaml"
SHORT = ["train.steps=30", "train.eval_every=15", "checkpoint.every=10", "data.seq_len=96",
         "data.generated.num_train=4000"]


@pytest.fixture(scope="module")
def full_sft(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft") / "full"
    run(RECIPE, d, SHORT)
    return d


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A briefly pretrained base (plain text only: the chat format is new to it)."""
    d = tmp_path_factory.mktemp("pre") / "base"
    run("recipes/pretrain_tiny.yaml", d, ["train.steps=10", "train.eval_every=0",
                                         "checkpoint.every=0", "data.seq_len=64",
                                         "model.scan_layers=true"])
    return d


@pytest.mark.slow
def test_sft_tiny_lowers_train_and_eval_loss(full_sft):
    m = metrics(full_sft)
    assert np.mean([x["loss"] for x in m[-5:]]) < 0.5 * np.mean([x["loss"] for x in m[:3]])
    evals = [x["eval_loss"] for x in m if x.get("eval_loss") is not None]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert all(x["learning_rate"] >= 0 and x["grad_norm"] > 0 and x["tokens_per_s"] > 0 for x in m)
    assert list((full_sft / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
@pytest.mark.parametrize("int8_base", [False, True])
def test_lora_trains_only_adapters(pretrained, tmp_path, int8_base):
    d = tmp_path / "lora"
    run(RECIPE, d, ["train.steps=16", "checkpoint.every=0", "train.eval_every=0",
                    "data.seq_len=96", f"model.path={pretrained}", "model.config=null",
                    "model.lora.rank=8", "model.lora.alpha=16", f"model.lora.int8_base={int8_base}",
                    "optimizer.learning_rate=1e-2"])
    _, start = final_params(pretrained)
    _, end = final_params(d)
    lora_keys = [k for k in end if "_lora_" in k]
    assert len(lora_keys) == 2 * 7 * 4  # (A, B) x 7 projections x 4 layers
    assert all(np.abs(np.asarray(end[k])).sum() > 0 for k in lora_keys if k.endswith("lora_b/value"))
    base = {k: v for k, v in end.items() if "_lora_" not in k}
    if int8_base:  # the frozen base is stored int8 and never changes
        assert any(np.asarray(v).dtype == np.int8 for v in base.values())
    else:  # the start checkpoint was scanned, the LoRA run unrolled: compare through HF names
        from posttrain.train.checkpoint import canonical_params
        from posttrain.models.hf import nnx_to_hf
        from posttrain.models import from_pretrained

        cfg = from_pretrained(pretrained).cfg
        want = dict(nnx_to_hf(cfg, canonical_params(start, None)))
        got = dict(nnx_to_hf(cfg.model_copy(update={"scan_layers": False}),
                             canonical_params(base, None)))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    m = metrics(d)
    # the base saw chat transcripts in pretraining, so it starts near 1.3 and falls to ~1.05
    assert np.mean([x["loss"] for x in m[-3:]]) < 0.9 * np.mean([x["loss"] for x in m[:3]])


@pytest.mark.slow
def test_sft_resume_is_bitwise(full_sft, tmp_path):
    """Killed after an update, then while a checkpoint is being written: the same parameters,
    rows and losses as the uninterrupted run."""
    b = tmp_path / "b"
    rec = faulted_run(RECIPE, b, SHORT, [Kill("step", 13), Kill("checkpoint_write", 1)])
    assert [r["delivered"] for r in rec] == [True, True], rec
    compare_runs(full_sft, b, ("loss", "eval_loss"))
