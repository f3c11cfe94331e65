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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.algorithms import grpo as G
from posttrain.config import RunConfig
from posttrain.data import generated
from posttrain.data.dataset import load_rows
from posttrain.errors import UserError
from posttrain.models.qwen3_moe import add_router_loss
from posttrain.sharding import make_mesh, shard_batch, use_mesh
from posttrain.train.checkpoint import (
    Checkpointer,
    restore_train_state,
    save_train_state,
)
from posttrain.train.loop import create_model, prepare_tokenizer, resolve_model_config
from posttrain.train.optimizer import init_opt_state, lr_schedule, make_optimizer
from posttrain.train.step import TrainState, make_train_step


# ---- prompts -----------------------------------------------------------------------------------
class PromptIterator:
    """Seeded order over prompt rows; `state()`/`restore()` for exact resume."""

    def __init__(self, rows, seed: int):
        self.rows, self.seed, self.epoch, self.index = rows, seed, 0, 0
        if len(rows) == 0:
            raise UserError("data.source: no prompts")
        self._order_epoch, self._order = -1, None

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:  # one permutation per epoch, not per step
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
            self._order_epoch = epoch
        return self._order

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, st: dict) -> None:
        self.epoch, self.index = st["epoch"], st["index"]

    def take(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            order = self._order_for(self.epoch)
            while self.index < len(order) and len(out) < k:
                out.append(dict(self.rows[int(order[self.index])]))
                self.index += 1
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out


def prompt_rows(cfg: RunConfig, split: str, n: int | None = None) -> list[dict]:
    if cfg.data.source == "generated":
        g = cfg.data.generated
        count = n or (g.num_train if split == "train" else g.num_eval)
        return generated.prompt_completion_rows(split, count, g.max_operand, g.seed, g.eval_fraction)
    rows = load_rows(cfg.data.eval_source or cfg.data.source if split == "eval" else cfg.data.source,
                     split, cfg.data)
    return [dict(rows[i]) for i in range(min(len(rows), n or len(rows)))]


def encode_prompt(row: dict, tokenizer, chat: bool, idx: int) -> list[int]:
    prompt = row.get("prompt")
    if prompt is None and "messages" in row:
        prompt = [m for m in row["messages"] if m["role"] != "assistant"]
    if not prompt:
        raise UserError(f"data row {idx}: needs a 'prompt' (text or messages)")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}] if chat else prompt
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reward_columns(rows: list[dict], group: int, rollouts) -> dict:
    cols = {k: [r[k] for r in rows for _ in range(group)] for k in rows[0] if k != "prompt"}
    cols["completion_ids"] = [r.token_ids for r in rollouts]
    return cols


# ---- the training batch ---------------------------------------------------------------------------
def batch_length(rollouts, seq_len: int, bucket: int = 32) -> int:
    """Rows are padded to the longest prompt + completion rounded up to `bucket` (at most
    `seq_len`), not to `seq_len`: a batch of short completions trains on short rows, and at most
    seq_len / bucket shapes ever compile."""
    longest = max(len(r.prompt_token_ids) + len(r.token_ids) for r in rollouts)
    return min(seq_len, -(-longest // bucket) * bucket)


def build_batch(rollouts, advantages: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Rows = prompt + completion, right-padded to `batch_length`; masks/logprobs sit on the
    positions that *predict* each completion token (position t predicts token t+1)."""
    b = len(rollouts)
    seq_len = batch_length(rollouts, seq_len)
    tokens = np.zeros((b, seq_len), np.int32)
    seg = np.zeros((b, seq_len), np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    lp_roll = np.zeros((b, seq_len), np.float32)
    kept = np.zeros((b, seq_len), np.int32)  # 0: the whole vocabulary
    for i, r in enumerate(rollouts):
        ids = (r.prompt_token_ids + r.token_ids)[:seq_len]
        n, p = len(ids), len(r.prompt_token_ids)
        tokens[i, :n] = ids
        seg[i, :n] = 1
        k = max(0, n - p)
        mask[i, p - 1:p - 1 + k] = 1.0
        lp_roll[i, p - 1:p - 1 + k] = r.logprobs[:k]
        kept[i, p - 1:p - 1 + min(k, len(r.kept_counts))] = r.kept_counts[:k]
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy()
    return {"tokens": tokens, "targets": targets, "positions": pos, "segment_ids": seg,
            "loss_mask": mask, "logp_rollout": lp_roll, "kept_counts": kept,
            "advantages": advantages.astype(np.float32)}


def make_loss_fn(cfg: RunConfig):
    g = cfg.grpo
    policy, agg, kl = G.POLICY_LOSSES[g.loss], G.AGGREGATIONS[g.aggregation], G.KL_ESTIMATORS[g.kl_estimator]
    clip_low, clip_high = g.clip

    def loss_fn(model, batch):
        """Without `logp_old` in the batch (one update per batch: the policy that the ratio
        compares against is the current one), pi_old = stop_gradient(pi): the separate
        log-prob pass is folded into this forward, and the trainer's log-probs come back
        per row (`rows/logp`) for the mismatch metrics."""
        logits, router = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                               with_router_losses=True)
        logits = logits / g.temperature
        logp, log_mass = trainer_logprobs(g, logits, batch)
        logp_old = batch["logp_old"] if "logp_old" in batch else jax.lax.stop_gradient(logp)
        mask = batch["loss_mask"]
        per_tok, aux = policy(logp, logp_old, batch["advantages"], mask, clip_low, clip_high,
                              g.dual_clip)
        per_tok = per_tok * G.truncated_is_weights(logp_old, batch["logp_rollout"], mask,
                                                   g.tis.level, g.tis.cap)
        if "logp_old" not in batch:
            aux["rows/logp"] = logp_old
        n_tok = jnp.maximum(mask.sum(), 1)
        if log_mass is not None:  # how much of the policy top-k / top-p leaves to sample from
            aux["sampling/kept_mass"] = (jnp.exp(log_mass) * mask).sum() / n_tok
        if g.beta > 0:
            k = kl(logp, batch["logp_ref"])
            per_tok = per_tok + g.beta * k
            aux["kl"] = (k * mask).sum() / n_tok
        s, n = agg(per_tok, mask, float(g.max_tokens))
        logz = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        entropy = logz - (probs * logits).sum(-1)
        aux["entropy"] = jax.lax.stop_gradient((entropy * mask).sum() / n_tok)
        return add_router_loss(model.cfg, s, n, router, aux)

    return loss_fn


def trainer_logprobs(g, logits_btv, batch):
    """Log-probs of the batch's tokens under `grpo.logprob_semantics` (logits temperature-scaled),
    replaying the kept counts the engine reported; see `posttrain.algorithms.grpo`."""
    return G.policy_logprobs(logits_btv, batch["targets"], batch["kept_counts"],
                             g.logprob_semantics, g.top_k, g.top_p)


def make_logprob_fn(graphdef, g):
    """Jitted (params, frozen, batch) -> per-token log-probs of the policy `params` (the old or
    the reference policy) under the run's semantics; `g` is the run's `grpo` section."""
    def f(params, frozen, batch):
        model = nnx.merge(graphdef, params, frozen)
        logits = model(batch["tokens"], batch["positions"], batch["segment_ids"]) / g.temperature
        return trainer_logprobs(g, logits, batch)[0]

    return jax.jit(f)


# ---- engines -------------------------------------------------------------------------------------
def build_engines(cfg: RunConfig, model, tokenizer, run_dir: Path):
    r = cfg.rollout
    hf_dir = run_dir / "rollout_hf"
    if r.placement == "colocated" and r.engine == "jax":
        from rollout.jax_engine import JaxEngine

        return JaxEngine(model, tokenizer, seed=cfg.seed, copy_weights=True)
    from converters.export import save_hf

    save_hf(model, hf_dir, lora_scale=cfg.model.lora.scale)
    tokenizer.save_pretrained(hf_dir)
    if r.placement == "colocated":
        from rollout.vllm_engine import VllmEngine

        return VllmEngine(str(hf_dir), dtype=r.dtype, gpu_memory_utilization=r.gpu_memory_utilization,
                          tensor_parallel_size=r.tensor_parallel_size, seed=cfg.seed,
                          enforce_eager=r.enforce_eager,
                          enable_expert_parallel=r.enable_expert_parallel)
    import ray

    from rollout.worker import WorkerGroup

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}}
                 if jax.default_backend() == "cpu" else None)
    spec = {"kind": r.engine, "model_dir": str(hf_dir), "tokenizer_dir": str(hf_dir), "seed": cfg.seed,
            "scan_layers": model.cfg.scan_layers,
            "vllm": {"dtype": r.dtype, "gpu_memory_utilization": r.gpu_memory_utilization,
                     "tensor_parallel_size": r.tensor_parallel_size, "seed": cfg.seed,
                     "enforce_eager": r.enforce_eager,
                     "enable_expert_parallel": r.enable_expert_parallel}}
    return WorkerGroup(spec, r.num_workers)


# ---- sampling a batch --------------------------------------------------------------------------
def sample_groups(cfg: RunConfig, engine, pool, prompts: PromptIterator, tokenizer, sp, times: dict):
    """Generate and score `prompts_per_step` groups. With DAPO dynamic sampling, groups whose
    rewards are all equal (no signal) are dropped and more prompts are sampled, up to
    `max_attempts`; a batch still short is filled with zero-advantage copies so shapes stay
    fixed. Groups dropped by the reward pool (`fallback: drop_group`) are handled the same way."""
    from rollout.engine import SamplingParams

    g = cfg.grpo
    kept_rollouts, kept_rewards, last_scores = [], [], None
    for attempt in range(1, (g.dynamic_sampling.max_attempts if g.dynamic_sampling.enabled else 1) + 1):
        need = g.prompts_per_step - len(kept_rollouts) // g.group_size
        rows = prompts.take(need)
        ids = [encode_prompt(r, tokenizer, g.chat_template, i) for i, r in enumerate(rows)]
        t0 = time.perf_counter()
        outs = engine.generate(ids, SamplingParams(**{**sp.__dict__, "seed": sp.seed + attempt}))
        times["time/rollout"] = times.get("time/rollout", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        last_scores = pool.score([r["prompt"] for r in rows for _ in range(g.group_size)],
                                 [o.text for o in outs], reward_columns(rows, g.group_size, outs),
                                 g.group_size)
        times["time/reward"] = times.get("time/reward", 0.0) + time.perf_counter() - t0
        totals = np.nan_to_num(last_scores.totals).reshape(-1, g.group_size)
        keep = last_scores.keep.reshape(-1, g.group_size).all(1)
        if g.dynamic_sampling.enabled:
            keep &= G.informative_groups(totals.reshape(-1), g.group_size)
        for gi in np.flatnonzero(keep):
            kept_rollouts += outs[gi * g.group_size:(gi + 1) * g.group_size]
            kept_rewards.append(totals[gi])
        if len(kept_rollouts) >= g.prompts_per_step * g.group_size:
            break
    n_real = len(kept_rollouts)
    rewards = np.concatenate(kept_rewards) if kept_rewards else np.zeros(0)
    missing = g.prompts_per_step * g.group_size - n_real
    if missing > 0:  # fill with copies that carry zero advantage
        filler = (kept_rollouts or outs)[: g.group_size]
        kept_rollouts += filler * (missing // g.group_size)
        rewards = np.concatenate([rewards, np.zeros(missing)])
    adv_mask = (np.arange(len(kept_rollouts)) < n_real).astype(np.float64)
    return kept_rollouts, rewards, adv_mask, last_scores, attempt


# ---- evaluation ----------------------------------------------------------------------------------
def greedy_accuracy(cfg: RunConfig, engine, pool, rows: list[dict], prompt_ids: list[list[int]],
                    *, stop: tuple[str, ...] = (), prefix: str = "") -> tuple[dict, list[str]]:
    """Greedy completions of held-out rows, scored by the reward pool; 'correct' means the reward
    named by `eval.reward` (default: the first) reaches 1. `prefix` is prepended to each
    completion before scoring (a plain-text probe whose prompt ends mid-sentence)."""
    from rollout.engine import SamplingParams

    outs = engine.generate(prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=cfg.eval.max_tokens or cfg.grpo.max_tokens, stop=stop))
    texts = [prefix + o.text for o in outs]
    scores = pool.score([r["prompt"] for r in rows], texts, reward_columns(rows, 1, outs), 1)
    label = cfg.eval.reward or cfg.rewards.functions[0].label
    correct = np.nan_to_num(scores.per_function[label]) >= 1.0
    metrics = {"eval/accuracy": float(correct.mean()),
               "eval/reward_mean": float(np.nanmean(scores.totals)),
               "eval/completion_len": float(np.mean([len(o.token_ids) for o in outs]))}
    return metrics, texts


def evaluate(cfg: RunConfig, engine, tokenizer, pool, rows: list[dict]) -> dict:
    ids = [encode_prompt(r, tokenizer, cfg.grpo.chat_template, i) for i, r in enumerate(rows)]
    return greedy_accuracy(cfg, engine, pool, rows, ids, stop=tuple(cfg.grpo.stop))[0]


# ---- the loop ------------------------------------------------------------------------------------
def run_grpo(cfg: RunConfig, run_dir: Path) -> dict:
    from posttrain.tracking import Tracker
    from rewards.pool import RewardPool
    from rollout.engine import SamplingParams
    from rollout.weight_sync import check_probe, probe_sequences, push

    g, t = cfg.grpo, cfg.train
    tokenizer = prepare_tokenizer(cfg, run_dir)
    model_cfg = resolve_model_config(cfg, tokenizer)
    mesh = make_mesh(cfg.mesh)
    with use_mesh(mesh, cfg.mesh.rules), RewardPool(cfg.rewards) as pool:
        model = create_model(cfg, model_cfg, mesh)
        trainable = nnx.LoRAParam if cfg.model.lora.rank else nnx.Param
        graphdef, params, frozen = nnx.split(model, trainable, ...)
        ref_params = jax.tree.map(jnp.copy, params) if g.beta > 0 else None  # beta 0: no reference
        optimizer = make_optimizer(cfg.optimizer, t.steps * g.mu * g.mini_batches)
        state = TrainState(params, frozen, init_opt_state(optimizer, params), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(cfg.seed)))
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        loss_fn = make_loss_fn(cfg)
        step_fn = jax.jit(make_train_step(graphdef, optimizer, loss_fn, t.grad_accum,
                                          lr_schedule(cfg.optimizer, t.steps)),
                          donate_argnums=0, out_shardings=(state_sh, None))
        logprob_fn = make_logprob_fn(graphdef, g)
        # One update per batch: pi_old is the policy being updated, computed in the update's
        # own forward (a whole forward pass less per step).
        fused_logprob = g.mu == 1 and g.mini_batches == 1

        prompts = PromptIterator(prompt_rows(cfg, "train"), cfg.data.shuffle_seed)
        eval_rows = prompt_rows(cfg, "eval", cfg.eval.num_problems)
        if cfg.rewards.dry_run:
            r0 = prompts.rows[0]
            pool.dry_run(r0.get("prompt"), {k: v for k, v in r0.items() if k != "prompt"} |
                         {"completion_ids": [0]})

        ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_save)
        start = 0
        latest = ckpt.latest_step() if cfg.checkpoint.resume else None
        if latest is not None:
            state, meta = restore_train_state(ckpt, latest, graphdef, state, trainable)
            prompts.restore(meta["data_state"])
            start = latest
        model = nnx.merge(graphdef, state.params, state.frozen)
        engine = build_engines(cfg, model, tokenizer, run_dir)
        # every sync ends with the engines scoring this probe against the trainer
        probe = probe_sequences(model_cfg.vocab_size, seed=cfg.seed) if cfg.rollout.probe else None
        lora_scale = cfg.model.lora.scale
        r = cfg.rollout
        sync_opts = dict(lora_scale=lora_scale, transport=r.transport,
                         bucket_bytes=r.bucket_mb << 20, timeout_s=r.sync_timeout_s)
        if start:
            push([engine], nnx.state(model), model_cfg, start, probe=probe, model=model, **sync_opts)
        elif probe is not None:  # the engine as built (from the trainer's model or its HF export)
            check_probe([engine], model, probe, 0)

        def produce(step: int) -> dict:
            """Rollouts, rewards and the training batch of `step` (on the engine's current
            weights); run in a background thread when `async.off_policy_steps` is 1."""
            times: dict = {}
            sp = SamplingParams(n=g.group_size, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, max_tokens=g.max_tokens, stop=tuple(g.stop),
                                logprobs=g.logprob_semantics,
                                seed=cfg.seed * 1_000_003 + step * 101)
            rollouts, all_rewards, adv_mask, scores, attempts = sample_groups(
                cfg, engine, pool, prompts, tokenizer, sp, times)
            adv = G.ADVANTAGES[g.advantage](all_rewards, g.group_size) * adv_mask
            return {"rollouts": rollouts, "rewards": all_rewards, "adv_mask": adv_mask,
                    "scores": scores, "attempts": attempts, "times": times,
                    "batch": build_batch(rollouts, adv, cfg.data.seq_len)}

        off_policy = cfg.async_.off_policy_steps > 0
        executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") if off_policy else None
        tracker = Tracker(cfg, run_dir, t.steps, start)
        last: dict = {}
        try:
            if start == 0:
                m0 = evaluate(cfg, engine, tokenizer, pool, eval_rows)
                tracker.log(0, m0)
            t0 = time.perf_counter()  # a step's wall time runs from the previous step's log
            job = produce(start) if start < t.steps else None
            for step in range(start, t.steps):
                rollouts, all_rewards, adv_mask = job["rollouts"], job["rewards"], job["adv_mask"]
                last_scores, attempts, batch = job["scores"], job["attempts"], job["batch"]
                times = dict(job["times"])
                # Async: batch k+1 is generated (with the weights of step k) while this one trains.
                data_state = prompts.state()  # before batch k+1 takes its prompts
                pending = (executor.submit(produce, step + 1)
                           if off_policy and step + 1 < t.steps else None)

                tr = time.perf_counter()
                dev = shard_batch(batch, mesh, cfg.mesh.rules)
                if not fused_logprob:
                    dev["logp_old"] = logprob_fn(state.params, state.frozen, dev)
                if ref_params is not None:
                    dev["logp_ref"] = logprob_fn(ref_params, state.frozen, dev)
                jax.block_until_ready(dev)
                times["time/logprob"] = time.perf_counter() - tr

                tr = time.perf_counter()
                n_rows = len(rollouts)
                mb = n_rows // g.mini_batches
                ms = []
                for _ in range(g.mu):
                    for k in range(g.mini_batches):
                        sub = jax.tree.map(lambda x: x[k * mb:(k + 1) * mb], dev)
                        state, m = step_fn(state, sub)
                        ms.append(m)
                ms = jax.device_get(ms)
                logp_old = ms[0].pop("rows/logp") if fused_logprob else np.asarray(dev["logp_old"])
                m = jax.tree.map(lambda *xs: float(np.mean(xs)), *ms)
                times["time/update"] = time.perf_counter() - tr
                if pending is not None:  # the engine must be idle before it takes new weights
                    tr = time.perf_counter()
                    job = pending.result()
                    times["time/rollout_wait"] = time.perf_counter() - tr

                tr = time.perf_counter()
                model = nnx.merge(graphdef, state.params, state.frozen)
                sync = push([engine], nnx.state(model), model_cfg, step + 1, probe=probe,
                            model=model, **sync_opts)
                times["time/sync"] = time.perf_counter() - tr

                lens = np.array([len(r.token_ids) for r in rollouts])
                m.update(times)
                m.update(last_scores.metrics)
                m.update(G.mismatch_metrics(logp_old, batch["logp_rollout"], batch["loss_mask"]))
                real = all_rewards[adv_mask > 0] if (adv_mask > 0).any() else all_rewards
                m.update({"reward_mean": float(real.mean()), "reward_std": float(real.std()),
                          "completion_len/mean": float(lens.mean()), "completion_len/max": float(lens.max()),
                          "completion_len/clipped": float(np.mean([r.finish_reason == "length" for r in rollouts])),
                          "sampling/attempts": float(attempts), "sampling/filled_groups":
                          float((adv_mask == 0).sum() / g.group_size), "policy_version": float(step + 1),
                          "rollout/policy_version": float(min(r.version for r in rollouts)),
                          "time/step": time.perf_counter() - t0, **sync})
                if cfg.eval.every and (step + 1) % cfg.eval.every == 0 or step + 1 == t.steps:
                    m.update(evaluate(cfg, engine, tokenizer, pool, eval_rows))
                tracker.log(step + 1, m)
                t0 = time.perf_counter()
                last = m
                if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or step + 1 == t.steps:
                    save_train_state(ckpt, step + 1, graphdef, state, model_cfg, data_state,
                                     cfg.model.lora.model_dump() if cfg.model.lora.rank else {},
                                     policy_version=step + 1)
                if not off_policy and step + 1 < t.steps:
                    job = produce(step + 1)
            ckpt.wait()
        finally:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
            tracker.close()
            ckpt.close()
            if hasattr(engine, "shutdown"):
                engine.shutdown()
        from posttrain.train.checkpoint import load_model_from_checkpoint
        from posttrain.train.loop import save_hf_export

        save_hf_export(load_model_from_checkpoint(run_dir / "checkpoints"), run_dir / "hf", tokenizer)
    return {k: v for k, v in last.items() if isinstance(v, float)}
