"""End to end: `posttrain run recipes/pretrain_tiny.yaml` learns, and a killed run resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from posttrain.train.checkpoint import find_checkpoint, restore_params_flat

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["train.steps=12", "checkpoint.every=4", "train.eval_every=6", "data.seq_len=64",
         "data.generated.num_train=3000", "checkpoint.async_save=true", "train.log_every=4"]


def cmd(run_dir, *extra):
    return [sys.executable, "-m", "posttrain.cli", "run", "recipes/pretrain_tiny.yaml",
            f"run_dir={run_dir}", *SHORT, *extra]


def env():
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)  # one device, as a user's laptop
    e["WANDB_MODE"] = "offline"
    return e


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir):
    ckpt_dir, step = find_checkpoint(run_dir)
    return step, restore_params_flat(ckpt_dir, step)


def data_order(run_dir):
    order = {}
    for line in (Path(run_dir) / "data_order.jsonl").read_text().splitlines():
        row = json.loads(line)
        order[row["step"]] = row["rows"]  # a step replayed after resume overwrites its first try
    return order


@pytest.mark.slow
def test_pretrain_tiny_learns_and_resumes_bitwise(tmp_path):
    a = tmp_path / "a"
    r = subprocess.run(cmd(a), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(a)
    assert m[-1]["loss"] < 0.5 * m[0]["loss"]
    evals = [x["eval_loss"] for x in m if x.get("eval_loss") is not None]
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert (a / "config.yaml").is_file() and (a / "hf" / "model.safetensors").is_file()
    assert list((a / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
    # from_pretrained on the Orbax run dir and transformers on the HF export agree (1e-4, fp32)
    from posttrain.models import from_pretrained
    from tests.helpers import torch_logits
    from transformers import AutoModelForCausalLM

    ids = np.array([[5, 9, 17, 33, 2, 8, 40, 41]])
    ours = np.asarray(from_pretrained(a)(ids))
    ref = torch_logits(AutoModelForCausalLM.from_pretrained(a / "hf").float().eval(), ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)

    # Same command, killed (SIGKILL) right after its first checkpoint, then started again.
    b = tmp_path / "b"
    p = subprocess.Popen(cmd(b), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (b / "checkpoints" / "4").is_dir() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(int(x.name) for x in (b / "checkpoints").iterdir() if x.name.isdigit())
    assert killed_at < 12, "the run finished before it could be killed"
    r = subprocess.run(cmd(b), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]

    step_a, pa = final_params(a)
    step_b, pb = final_params(b)
    assert step_a == step_b == 12
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)
    assert data_order(a) == data_order(b)
