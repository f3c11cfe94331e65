"""`posttrain generate` prints one JSON line per completion."""

import json
import subprocess
import sys

from tests.helpers import save_tiny_model_with_tokenizer


def test_generate_jax_json_lines(tmp_path):
    save_tiny_model_with_tokenizer(tmp_path, "qwen3")
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 1 + 2?\nWhat is 3 - 1?\n")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "generate", "--model", str(tmp_path),
                        "--engine", "jax", "--prompts", str(prompts), "--n", "2", "--max-tokens", "8",
                        "--seed", "0", "--chat"], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 4 and [x["prompt"] for x in rows] == ["What is 1 + 2?"] * 2 + ["What is 3 - 1?"] * 2
    assert all(len(x["token_ids"]) == len(x["logprobs"]) == len(x["kept_counts"]) <= 8 for x in rows)
    # nucleus sampling, the full-softmax log-probs: the same draws, each token's log-prob lower
    # than its renormalised one by the log of the kept mass
    nucleus = ["--top-p", "0.5", "--temperature", "0.5"]
    rows = [[json.loads(x) for x in subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "generate", "--model", str(tmp_path), "--engine",
         "jax", "--prompts", str(prompts), "--max-tokens", "8", "--seed", "0", *nucleus, *extra],
        check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()]
        for extra in ([], ["--logprobs", "full"])]
    sampled, full = rows
    assert [x["token_ids"] for x in sampled] == [x["token_ids"] for x in full]
    for s, f in zip(sampled, full):
        assert s["kept_counts"] == f["kept_counts"] and max(s["kept_counts"]) < 512
        assert all(lf < ls for ls, lf in zip(s["logprobs"], f["logprobs"]))
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "generate", "--model",
                        str(tmp_path / "nope"), "--prompt", "x"], check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "no such model directory" in r.stderr


def test_eval_prints_pass_and_maj(tmp_path):
    save_tiny_model_with_tokenizer(tmp_path, "qwen3")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "eval", str(tmp_path), "--dataset",
                        "generated", "--n", "4", "--limit", "6", "--max-tokens", "6"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["problems"] == 6 and res["n"] == 4
    assert 0 <= res["pass@1"] <= res["pass@4"] <= 1 and 0 <= res["maj@4"] <= 1


def test_eval_on_generated_uses_the_runs_task(tmp_path):
    """A run's config.yaml next to the model sets the generated task (operands, held-out split),
    so `--dataset generated` scores the problems that run held out, not the defaults."""
    from posttrain.data import generated

    model = tmp_path / "run" / "hf"
    save_tiny_model_with_tokenizer(model, "qwen3")
    (tmp_path / "run" / "config.yaml").write_text(
        "data: {source: generated, generated: {max_operand: 7, eval_fraction: 0.5, seed: 3}}\n")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "eval", str(model), "--dataset",
                        "generated", "--limit", "500", "--max-tokens", "2"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "max_operand 7, eval_fraction 0.5, seed 3" in r.stderr
    held_out = generated.problems("eval", 500, 7, 3, 0.5)
    assert json.loads(r.stdout.strip().splitlines()[-1])["problems"] == len(held_out) < 500
    bad = tmp_path / "run" / "config.yaml"
    bad.write_text("data: {generated: {max_operand: -1}}\n")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "eval", str(model), "--dataset",
                        "generated"], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and str(bad) in r.stderr and "data.generated.max_operand" in r.stderr
