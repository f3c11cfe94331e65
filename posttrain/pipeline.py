"""The RL loop (GRPO, GSPO, DAPO, Dr.GRPO): prompts -> rollouts -> rewards -> advantages ->
updates -> weight sync, coordinated by Ray when engines live in other processes.

    posttrain run recipes/grpo_tiny.yaml

One step, top to bottom:
  1. take `grpo.prompts_per_step` prompts (seeded order, position saved in checkpoints);
  2. the rollout engine samples `grpo.group_size` completions each (token ids + logprobs +
     the policy version that produced them); DAPO dynamic sampling resamples groups with no
     reward variance, up to `max_attempts`;
  3. the reward pool scores them (worker processes, timeouts, fallbacks);
  4. advantages per group; a padded [B, L] batch of prompt + completion tokens;
  5. the trainer computes logp_old (and logp_ref when beta > 0) for the ratio, the mismatch
     metrics and truncated importance sampling, then runs `mu` passes of `mini_batches`
     updates; with one update per batch logp_old comes from the update's own forward;
  6. the new weights go to every engine, which confirms the version and scores a fixed probe
     that the trainer compares with its own log-probs (a gap stops the run: stale weights);
  7. metrics (time split, rewards, clip fraction, entropy, lengths, mismatch) and checkpoints.
The trainer (`posttrain.train.trainer`: in this process, or a `TrainerGroup` of Ray actors over
several hosts) holds the policy's state, its jitted steps and its checkpoints; this loop holds
prompts, rollouts, rewards and advantages and hands the trainer whole batches.
Placement `colocated`: the engine runs in this process on the trainer's devices and receives
weights in memory. `disaggregated`: `rollout.num_workers` engines are Ray actors, weights travel
bucket by bucket over `rollout.transport` (Ray's object store, or a gloo broadcast). `async.off_policy_steps: 1` runs steps 1-3 for batch k+1 in a
background thread while 5 trains on batch k (one policy version stale; truncated importance
sampling against the engine's logprobs corrects it); the engine takes the new weights once that
generation is done. A checkpoint records the data position before batch k+1, so a resumed async
run regenerates that batch with the restored weights: no prompt skipped or repeated, but not
bitwise the uninterrupted run (the synchronous mode is).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from posttrain.algorithms import grpo as G
from posttrain import compile_cache, faults, watchdog
from posttrain.config import RunConfig
from posttrain.errors import warn
from posttrain.rollouts import (
    PromptIterator,
    build_batch,
    build_engines,
    evaluate,
    make_environment,
    prompt_rows,
    sample_groups,
)
from posttrain.train.loop import prepare_tokenizer, resolve_model_config
from posttrain.train.group import make_trainer
from rollout.episodes import episode_metrics
from rollout.jax_engine import JaxEngine


def sync_engine(engine, trainer, model_cfg, version: int, sleep_level: int, sync_opts: dict) -> dict:
    """The new weights to the engine, proven by the probe. An engine put to sleep for the update
    wakes its weights' memory, takes the sync, wakes its KV cache, and only then scores the probe:
    after every wake, whatever the sync reported (an engine that woke with other weights than the
    trainer's would otherwise serve them)."""
    from rollout.weight_sync import check_probe, push

    if not sleep_level:
        return push([engine], trainer, model_cfg, version, **sync_opts)
    engine.wake_up(["weights"])
    sync = push([engine], trainer, model_cfg, version, **{**sync_opts, "probe": None})
    engine.wake_up(["kv_cache"])
    scorer = sync_opts.get("model") or trainer.score
    return sync | check_probe([engine], scorer, sync_opts["probe"], version)


def run_grpo(cfg: RunConfig, run_dir: Path) -> dict:
    from posttrain.tracking import Tracker
    from rewards.pool import RewardPool
    from rollout.engine import SamplingParams
    from rollout.weight_sync import check_probe, probe_sequences, push

    g, t, r = cfg.grpo, cfg.train, cfg.rollout
    tokenizer = prepare_tokenizer(cfg, run_dir)
    model_cfg = resolve_model_config(cfg, tokenizer)
    compile_cache.set_effort(cfg.train.compile_effort, model_cfg)
    trainer = make_trainer(cfg, run_dir, model_cfg)
    engine = None
    with RewardPool(cfg.rewards) as pool:
        prompts = PromptIterator(prompt_rows(cfg, "train"), cfg.data.shuffle_seed)
        eval_rows = prompt_rows(cfg, "eval", cfg.eval.num_problems)
        if cfg.rewards.dry_run:
            r0 = prompts.rows[0]
            pool.dry_run(r0.get("prompt"), {k: v for k, v in r0.items() if k != "prompt"} |
                         {"completion_ids": [0]})
        meta = trainer.restore()
        start = 0
        if meta is not None:
            prompts.restore(meta["data_state"])
            start = meta["step"]
        tracker = None
        executor = None
        env = None
        dog = watchdog.for_run(cfg, run_dir)
        last: dict = {}
        try:
            env = make_environment(cfg)  # multi-turn episodes (tools), or None
            engine = build_engines(cfg, trainer, tokenizer, run_dir)
            # every sync ends with the engines scoring this probe against the trainer
            probe = probe_sequences(model_cfg.vocab_size, seed=cfg.seed) if r.probe else None
            sync_opts = dict(lora_scale=cfg.model.lora.scale, transport=r.transport, probe=probe,
                             bucket_bytes=r.bucket_mb << 20, timeout_s=r.sync_timeout_s)
            if start:
                push([engine], trainer, model_cfg, start, **{**sync_opts, "probe": None})

            row_unit = trainer.row_unit() if g.pack else 0
            fixed = g.fixed_shapes(jax.default_backend())

            def produce(step: int) -> dict:
                """Rollouts, rewards and the training batch of `step` (on the engine's current
                weights); run in a background thread when `async.off_policy_steps` is 1."""
                times: dict = {}
                sp = SamplingParams(n=g.group_size, temperature=g.temperature, top_p=g.top_p,
                                    top_k=g.top_k, max_tokens=g.max_tokens, stop=tuple(g.stop),
                                    logprobs=g.logprob_semantics,
                                    seed=cfg.seed * 1_000_003 + step * 101)
                rollouts, all_rewards, adv_mask, scores, attempts, prompt_ids = sample_groups(
                    cfg, engine, pool, prompts, tokenizer, sp, times, env)
                adv = G.ADVANTAGES[g.advantage](all_rewards, g.group_size) * adv_mask
                return {"rollouts": rollouts, "rewards": all_rewards, "adv_mask": adv_mask,
                        "scores": scores, "attempts": attempts, "times": times,
                        "prompt_ids": prompt_ids,
                        "batch": build_batch(rollouts, adv, cfg.data.seq_len, g.group_size,
                                             row_unit, fixed, cfg.head_window)}

            off_policy = cfg.async_.off_policy_steps > 0
            warned_cut = False
            executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") if off_policy else None
            tracker = Tracker(cfg, run_dir, t.steps, start)
            t0 = time.perf_counter()  # a step's wall time runs from the previous step's log
            with dog.waiting(f"rollouts and rewards for step {start + 1}"):
                job = produce(start) if start < t.steps else None
            if probe is not None:
                # the engine as built or restored (from the trainer's model or its HF export),
                # proven before any update; after the first rollouts, whose decode programs
                # the probe's generation then runs in (`rollout.reuse_programs`)
                check_probe([engine], trainer.score, probe, start)
            if start == 0:  # the initial weights' accuracy, after the first rollouts for the
                # same reason: a held-out set that fits their decode program runs in it (on a
                # TPU, ~100 s less compiling before step 1 at the 0.6B shape)
                te = time.perf_counter()
                with dog.waiting("the evaluation before step 1"):
                    tracker.log(0, evaluate(cfg, engine, tokenizer, pool, eval_rows, env))
                t0 += time.perf_counter() - te  # step 1's time does not count the evaluation
            for step in range(start, t.steps):
                # 1-4. the batch: sampled, scored, advantages (generated before this step)
                rollouts, all_rewards, adv_mask = job["rollouts"], job["rewards"], job["adv_mask"]
                batch, times = job["batch"], dict(job["times"])
                # Async: batch k+1 is generated (with the weights of step k) while this one trains.
                data_state = prompts.state()  # before batch k+1 takes its prompts
                pending = (executor.submit(produce, step + 1)
                           if off_policy and step + 1 < t.steps else None)
                # 5. the update (a sleeping vLLM engine leaves the GPUs to the trainer)
                if r.sleep_level:
                    engine.sleep(r.sleep_level)
                with dog.waiting(f"the update of step {step + 1}"):
                    m, logp_old = trainer.update(batch)
                faults.point("step")
                if pending is not None:  # the engine must be idle before it takes new weights
                    tr = time.perf_counter()
                    with dog.waiting(f"rollouts and rewards for step {step + 2}"):
                        nxt = pending.result()
                    times["time/rollout_wait"] = time.perf_counter() - tr
                # 6. the new weights to every engine, proven by the probe
                tr = time.perf_counter()
                with dog.waiting(f"the weight sync after step {step + 1}"):
                    sync = sync_engine(engine, trainer, model_cfg, step + 1, r.sleep_level, sync_opts)
                times["time/sync"] = time.perf_counter() - tr
                # 7. metrics, evaluation, checkpoint
                m.update(times)
                m.update(job["scores"].metrics)
                m.update(G.mismatch_metrics(logp_old, batch["logp_rollout"], batch["loss_mask"]))
                m.update(step_metrics(rollouts, all_rewards, adv_mask, g.group_size, job["attempts"],
                                      cfg.data.seq_len))
                if m["completion_len/beyond_seq_len"] and not warned_cut:
                    warned_cut = True
                    warn(f"step {step + 1}: {m['completion_len/beyond_seq_len']:.1%} of the "
                         f"completion tokens fall past data.seq_len ({cfg.data.seq_len}: prompt + "
                         "completion longer than a row) and are not trained though their rewards "
                         "count; raise data.seq_len or shorten the prompts "
                         "(completion_len/beyond_seq_len each step)")
                m.update(episode_metrics(rollouts) | (env.metrics() if env is not None else {}))
                m.update({"policy_version": float(step + 1), "time/step": time.perf_counter() - t0,
                          **sync})
                if isinstance(engine, JaxEngine):  # in process: its compiled decode programs
                    m["rollout/decode_programs"] = float(engine.decode_programs)
                if cfg.eval.every and (step + 1) % cfg.eval.every == 0 or step + 1 == t.steps:
                    with dog.waiting(f"evaluation at step {step + 1}"):
                        m.update(evaluate(cfg, engine, tokenizer, pool, eval_rows, env))
                tracker.log(step + 1, m)
                tracker.log_rows(step + 1, job["prompt_ids"])
                t0 = time.perf_counter()
                last = m
                if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or step + 1 == t.steps:
                    with dog.waiting(f"checkpoint {step + 1}"):
                        trainer.save(step + 1, data_state, policy_version=step + 1)
                if step + 1 < t.steps:
                    with dog.waiting(f"rollouts and rewards for step {step + 2}"):
                        job = nxt if off_policy else produce(step + 1)
            with dog.waiting("the last checkpoint write"):
                trainer.wait()
        finally:
            dog.close()
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
            if tracker is not None:
                tracker.close()
            trainer.close()
            if env is not None:
                env.close()
            if hasattr(engine, "shutdown"):
                engine.shutdown()
    from posttrain.models.loading import load_model_from_checkpoint
    from posttrain.train.loop import save_hf_export

    save_hf_export(load_model_from_checkpoint(run_dir / "checkpoints"), run_dir / "hf", tokenizer)
    return {k: v for k, v in last.items() if isinstance(v, float)}


def step_metrics(rollouts, rewards: np.ndarray, adv_mask: np.ndarray, group: int,
                 attempts: int, seq_len: int) -> dict[str, float]:
    """Rewards of the real (not filler) completions, lengths, sampling attempts, versions, and
    the share of completion tokens that fall past `seq_len` (`build_batch` cuts each row there:
    those tokens are scored but never trained, a silent loss unless reported)."""
    lens = np.array([len(r.token_ids) for r in rollouts])
    cut = sum(max(0, len(r.prompt_token_ids) + len(r.token_ids) - seq_len) for r in rollouts)
    real = rewards[adv_mask > 0] if (adv_mask > 0).any() else rewards
    return {"reward_mean": float(real.mean()), "reward_std": float(real.std()),
            "completion_len/mean": float(lens.mean()), "completion_len/max": float(lens.max()),
            "completion_len/clipped": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "completion_len/beyond_seq_len": float(cut / max(1, lens.sum())),
            "sampling/attempts": float(attempts),
            "sampling/filled_groups": float((adv_mask == 0).sum() / group),
            "rollout/policy_version": float(min(r.version for r in rollouts))}
