"""The peer of `benchmarks.tpu.grpo_step`: Tunix 0.1.7's GRPO on the same workload and chip.

    PYTHONPATH=$TUNIX_PATH:$PYTHONPATH python -m benchmarks.tpu.tunix_grpo [--steps 5] [--out DIR]

Run in a process of its own after ours (only this process gets Tunix on its path; one process
holds the chip at a time). The workload of `recipes/grpo_qwen3_0_6b_v5e.yaml` as grpo_step.py runs
it: the Qwen3-0.6B shape with random weights, LoRA rank 16 (alpha 32) on every projection, the
base frozen, bf16 compute (bf16 parameters: Tunix 0.1.7's LoRA over f32 ones cannot decode, see
below; ours keeps f32 master weights); 64 prompts of the generated arithmetic task per
step (chat template applied, ~20 tokens, left-padded to 32), 8 samples each, temperature 1 over
the whole vocabulary, up to 256 new tokens (a random policy never samples its end token, so
every completion runs to the limit, as in ours); GRPO with beta 0 and one iteration, AdamW
1e-5; 8 optimizer updates per step of 8 prompts' groups (64 rows) each, in micro-batches of 2
prompts' groups (16 rows: our grad_accum 4); rollouts of 8 prompts' groups (64 rows) per call
(our max_rows 64). Tunix as its docs set it up: its own Qwen3 (`tunix.models.qwen3`), its splash
attention (`use_flash_attention`) for the update (no remat: see below), qwix LoRA
(`qwix.apply_lora_to_model`, as `tunix.cli.utils.model` does), `RLCluster` with the "vanilla"
rollout engine (its own JAX sampler) colocated with the actor (shared weights: no sync), the
tokenizer this repo trains for the task (`grpo_step.make_model`'s BPE). Differences kept: its
KV cache is bf16 (Tunix's vanilla sampler has no int8 cache), its update sees rows padded to
32 + 256 = 288 tokens (ours too since 2026-12-07; before, to 384, splash's tile).

Timing: a stamp at the end of every `rl_cluster.update_actor` (Tunix calls it once per
micro-batch); a step ends at its last call (calls per step = all calls / steps); step k = end k - end k-1; median after WARMUP steps.
Prints `@@` + JSON. `--tiny`: a tiny shape and workload on CPU (the dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and workload on CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import qwix
    from transformers import AutoTokenizer
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from benchmarks.peers.tunix_bench import time_cluster
    from benchmarks.tpu.grpo_step import make_model
    from benchmarks.tpu.tunix_sft import tunix_qwen3
    from posttrain.data import generated

    prompts, group, max_new, prompt_len = (4, 4, 16, 32) if args.tiny else (64, 8, 256, 32)
    rank = 4 if args.tiny else 16
    mini, micro, rollout_rows = (2, 1, 2) if args.tiny else (8, 2, 8)  # in prompts' groups
    work = Path(tempfile.mkdtemp(prefix="tunix_grpo_"))
    make_model(work / "model", tiny=True)  # the tokenizer (the model there is not used)
    tok = AutoTokenizer.from_pretrained(str(work / "model"))
    # bf16 parameters: with f32 ones its LoRA path (qwix, f32 adapters) makes f32 values that
    # its vanilla sampler cannot write into its bf16 KV cache; no remat: with it, its sampler's
    # while-loop over a qwix LoRA model fails ("Cannot mutate Param from a different trace
    # level"). Both Tunix 0.1.7; one model config serves its rollout and its update.
    base, cfg, mesh = tunix_qwen3(args.tiny, 4096, jnp.bfloat16, "NONE")
    # its splash path cannot serve its own sampler: a prefill of 32 tokens into the KV cache
    # takes it (seq_len > 1) with 1024-blocks and a (T, T) mask against the cache's 288 keys
    # (the chip: "q_block_size=1024 should divide q_seq_len=32"); the modules read the flag
    # at call time, so XLA attention serves the rollout and the update alike
    cfg.use_flash_attention = False
    with mesh:
        lora = qwix.LoraProvider(module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                                 "down_proj)", rank=rank, alpha=2.0 * rank)
        actor = qwix.apply_lora_to_model(base, lora, **base.get_model_input())

    rows = generated.prompt_completion_rows("train", 4000, 99, 0)
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                     add_generation_prompt=True, tokenize=False) for r in rows]

    def batches():
        for k in range(args.steps):
            idx = [(k * prompts + i) % len(rows) for i in range(prompts)]
            yield {"prompts": np.array([texts[i] for i in idx]),
                   "answer": np.array([rows[i]["answer"] for i in idx])}

    def reward(prompts, completions, answer, **kwargs):  # the cost does not depend on it
        return [0.0 for _ in completions]

    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**9,
        max_steps=args.steps * (prompts // mini), mini_batch_size=mini,
        train_micro_batch_size=micro, rollout_micro_batch_size=rollout_rows,
        compute_logps_micro_batch_size=rollout_rows, checkpoint_root_directory=None,
        metrics_logging_options=None, pbar_description=None)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_new, max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + max_new, temperature=1.0, top_p=1.0, top_k=None,
        data_type=jnp.bfloat16)  # its KV cache (else f32, which its bf16 compute cannot write)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=None, tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR,
                                             rl_cluster_lib.Role.REFERENCE,
                                             rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=rollout))
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=0.0))

    t = time_cluster(cluster)
    ends, rollout_s, lengths = t["ends"], t["rollout_s"], t["lengths"]
    t0 = time.perf_counter()
    learner.train(batches())
    wall = time.perf_counter() - t0
    per_step = len(ends) // args.steps
    if not ends or len(ends) % args.steps:
        raise RuntimeError(f"{len(ends)} updates over {args.steps} steps")
    if cluster.actor_trainer.train_steps != args.steps * (prompts // mini):
        raise RuntimeError(f"{cluster.actor_trainer.train_steps} optimizer steps, expected "
                           f"{args.steps * (prompts // mini)}")
    step_ends = ends[per_step - 1::per_step]
    step_s = [b - a for a, b in zip([t0] + step_ends[:-1], step_ends)]
    timed = step_s[WARMUP:] or step_s[-1:]
    n_rows = prompts * group
    res = {"peer": "tunix", "workload": {"prompts": prompts, "group": group, "max_tokens": max_new,
                                         "prompt_len": prompt_len, "lora_rank": rank,
                                         "rows_per_update": mini * group},
           "steps": args.steps, "step_s": step_s, "median_step_s": statistics.median(timed),
           "rollout_calls_per_step": len(rollout_s) // args.steps,
           "rollout_s_per_step": sum(rollout_s[WARMUP * len(rollout_s) // args.steps:])
           / max(len(timed), 1),
           "update_calls_per_step": per_step,
           "optimizer_steps_per_step": cluster.actor_trainer.train_steps // args.steps,
           "completion_tokens_mean": statistics.median(lengths) if lengths else None,
           "generated_tokens_per_s": n_rows * statistics.median(lengths) / statistics.median(timed)
           if lengths else None,
           "peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
           "splash": cfg.use_flash_attention, "train_wall_s": wall,
           "device": str(jax.devices()[0].device_kind)}
    print("@@" + json.dumps(res), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tunix_grpo.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
