"""SFT tokens/s: ours vs Tunix's PeftTrainer and TRL's SFTTrainer, side by side.

    python -m benchmarks.sft_throughput [--steps 30] [--rounds 2] [--peers tunix,trl]

Workload (ENVIRONMENT.md): the 3.3M-parameter Qwen3-architecture model, batch 16 x 256 packed,
AdamW, fp32, on generated arithmetic chats with a locally trained BPE tokenizer. Every contender
runs as a separate process, alternating (ours, Tunix, TRL, ours, ...) so that machine noise hits
all; Tunix runs under its own venv (`benchmarks/peers/tunix_bench.py`: it does not pack, so its rows
are packed by hand, every position a real token). Each
reports non-padding tokens per second of wall time over its steps after warm-up. Ours is the real
`posttrain run` SFT path (data pipeline, jitted step, metrics), full fine-tuning and LoRA; the
matmul peak is measured in this script for MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5


def ours(steps: int, workdir: Path, lora: bool) -> float:
    run_dir = workdir / f"ours_{'lora' if lora else 'full'}_{time.time_ns()}"
    cmd = [sys.executable, "-m", "posttrain.cli", "run", "recipes/sft_tiny.yaml", f"run_dir={run_dir}",
           f"train.steps={steps}", "train.batch_size=16", "data.seq_len=256", "train.eval_every=0",
           "checkpoint.every=0", "tracking.wandb.enabled=false", "tracking.console=false",
           "optimizer.grad_clip=null"]
    if lora:
        cmd += ["model.lora.rank=16"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP:]
    dt = timed[-1]["time"] - rows[WARMUP - 1]["time"]
    return sum(r["batch_tokens"] for r in timed) / dt


TRL_SCRIPT = r'''
import json, sys, time, torch
from pathlib import Path
torch.set_num_threads(2)
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from trl import SFTConfig, SFTTrainer
sys.path.insert(0, ".")
from posttrain.data import generated
steps, tok_dir = int(sys.argv[1]), sys.argv[2]
tok = AutoTokenizer.from_pretrained(tok_dir)
cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  tie_word_embeddings=True, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
model = Qwen3ForCausalLM(cfg)
ds = Dataset.from_list([{"messages": r["messages"]} for r in generated.chat_rows("train", 20000, 99, 0)])
class Timer(TrainerCallback):
    def __init__(self): self.t, self.tokens = [], []
    def on_step_end(self, args, state, control, **kw): self.t.append(time.perf_counter())
timer = Timer()
args = SFTConfig(output_dir="/tmp/trl_sft_bench", per_device_train_batch_size=16, max_length=256,
                 packing=True, max_steps=steps, learning_rate=2e-3, logging_steps=1000,
                 report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                 assistant_only_loss=False, max_grad_norm=0.0,
                 # TRL >= 1.x defaults to bf16 autocast and gradient checkpointing; fp32 without
                 # remat is the workload everyone else runs (bf16 matmuls on a CPU without
                 # AVX512_BF16 run ~170x slower than fp32: that was TRL's slowness here)
                 bf16=False, gradient_checkpointing=False)
trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[timer])
# count real tokens per packed batch from the collator's output
orig = trainer.compute_loss
def counting(model, inputs, *a, **k):
    mask = inputs.get("attention_mask")
    n = int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
    timer.tokens.append(n)
    return orig(model, inputs, *a, **k)
trainer.compute_loss = counting
trainer.train()
w = %d
dt = timer.t[-1] - timer.t[w - 1]
print(json.dumps({"tokens_per_s": sum(timer.tokens[w:]) / dt}))
''' % WARMUP


def trl(steps: int, tok_dir: Path, keep_freed_memory: bool = False) -> float:
    from benchmarks.common import peer_environ

    r = subprocess.run([sys.executable, "-c", TRL_SCRIPT, str(steps), str(tok_dir)], cwd=ROOT,
                       check=True, capture_output=True, text=True,
                       env=peer_environ(keep_freed_memory))
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]


def tunix(steps: int, model_dir: Path, keep_freed_memory: bool = False) -> float:
    from benchmarks.common import run_tunix

    return run_tunix(ROOT, "sft", model_dir, steps, keep_freed_memory)["tokens_per_s_mean"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peers", default="tunix,trl",
                    help="comma-separated: tunix (its own venv, benchmarks/peers/setup_tunix.sh), trl")
    ap.add_argument("--peers-keep-freed-memory", action="store_true",
                    help="run the peers with the glibc malloc settings posttrain gives itself "
                         "(posttrain/host_memory.py) instead of as they ship")
    args = ap.parse_args()
    keep = args.peers_keep_freed_memory
    peers = [p for p in args.peers.split(",") if p]
    from benchmarks.common import (REFERENCE, matmul_peak_gflops, train_flops_per_token, tunix_python,
                                   steal_report, with_steal)
    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe
    from tests.helpers import save_tiny_model_with_tokenizer

    if "tunix" in peers:
        tunix_python(ROOT)
    work = Path(tempfile.mkdtemp(prefix="sft_bench_"))
    tok_dir = work / "tok"
    train_bpe(generated.corpus_for_tokenizer(99), 512, tok_dir)
    model_dir = work / "model"  # Tunix loads the reference model from an HF directory
    save_tiny_model_with_tokenizer(model_dir, "qwen3", hidden=256, inter=768, layers=4, heads=4,
                                   kv=2, head_dim=64)
    peak = matmul_peak_gflops()
    runs = {"ours": lambda: ours(args.steps, work, lora=False),
            "tunix": lambda: tunix(args.steps, model_dir, keep),
            "trl": lambda: trl(args.steps, tok_dir, keep),
            "ours_lora": lambda: ours(args.steps, work, lora=True)}
    order = ["ours"] + peers + ["ours_lora"]
    res = {k: [] for k in order}
    stolen = {k: [] for k in order}
    for _ in range(args.rounds):
        for k in order:
            r, st = with_steal(runs[k])
            res[k].append(r)
            stolen[k].append(st)
    best = {k: max(v) for k, v in res.items()}
    fpt = train_flops_per_token(REFERENCE, 256)
    labels = {"ours": "posttrain full FT", "ours_lora": "posttrain LoRA r16",
              "tunix": "Tunix PeftTrainer", "trl": "TRL SFTTrainer"}
    print(f"matmul peak measured now: {peak:.0f} GFLOP/s (f32); peers' host malloc: "
          + ("posttrain's settings" if keep else "glibc's defaults, as they ship"))
    print(f"{'run':<22}{'tokens/s (best of ' + str(args.rounds) + ')':>26}{'MFU':>8}"
          + "".join(f"{'vs ' + p:>10}" for p in peers))
    for k in order:
        mfu = best[k] * fpt / 1e9 / peak
        print(f"{labels[k]:<22}{best[k]:>26.0f}{mfu:>8.1%}"
              + "".join(f"{best[k] / best[p]:>9.2f}x" for p in peers))
    print(f"all rounds: {json.dumps({k: [round(x) for x in v] for k, v in res.items()})}")
    print(steal_report(stolen))


if __name__ == "__main__":
    main()
