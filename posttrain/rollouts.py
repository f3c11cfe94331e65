"""The driver's side of an RL step: prompts, rollouts from the engines, rewards, the training
batch and held-out evaluation. Everything here runs where the loop runs (`posttrain.pipeline`);
nothing touches the trainer's state.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from posttrain.algorithms import grpo as G
from posttrain.config import RunConfig
from posttrain.data import generated
from posttrain.data.dataset import load_rows, locate
from posttrain.data.packing import bucket_down, bucket_up, packed_rows
from posttrain.errors import UserError


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
        """The next `k` rows; their indices in the dataset are left in `last_ids`."""
        out, self.last_ids = [], []
        while len(out) < k:
            order = self._order_for(self.epoch)
            while self.index < len(order) and len(out) < k:
                self.last_ids.append(int(order[self.index]))
                out.append(dict(self.rows[self.last_ids[-1]]))
                self.index += 1
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out


def prompt_rows(cfg: RunConfig, split: str, n: int | None = None) -> list[dict]:
    if cfg.data.source == "generated":
        g = cfg.data.generated
        count = n or (g.num_train if split == "train" else g.num_eval)
        return generated.rows_for(g, "prompt_completion", split, count)
    rows = load_rows(cfg.data.eval_source or cfg.data.source if split == "eval" else cfg.data.source,
                     split, cfg.data)
    return [dict(rows[i]) for i in range(min(len(rows), n or len(rows)))]


def encode_prompt(row: dict, tokenizer, chat: bool, idx: int, source: str = "data") -> list[int]:
    prompt = row.get("prompt")
    if prompt is None and "messages" in row:
        prompt = [m for m in row["messages"] if m["role"] != "assistant"]
    if not prompt:
        raise UserError(f"{locate(source, idx)}: needs a 'prompt' (text or messages)")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}] if chat else prompt
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reward_columns(rows: list[dict], group: int, rollouts) -> dict:
    """The dataset's columns per completion, its token ids, and for multi-turn episodes the
    trajectory (`messages`, `turn_token_ids`, `num_tool_calls`: `rollout.episodes`)."""
    from rollout.episodes import trajectory_columns

    cols = {k: [r[k] for r in rows for _ in range(group)] for k in rows[0] if k != "prompt"}
    cols["completion_ids"] = [r.token_ids for r in rollouts]
    if rollouts and "turn_token_ids" in rollouts[0].extra:
        cols.update(trajectory_columns(rollouts))
    return cols


# ---- multi-turn ------------------------------------------------------------------------------------
def make_environment(cfg: RunConfig):
    """The recipe's environment (`agent`): a user's class, or the tools one; None: single turn."""
    from rollout.episodes import Environment, ToolEnvironment, ToolSpec

    a = cfg.agent
    if not a.enabled:
        return None
    if a.environment is not None:
        from posttrain.config import check_agent
        from posttrain.plugins import load_object

        check_agent(a)  # the spec's form, as `posttrain validate` checks it
        env = load_object(a.environment)(**a.environment_kwargs)
        if not isinstance(env, Environment):
            raise UserError(f"agent.environment: {a.environment} is not a subclass of "
                            "rollout.episodes.Environment")
        return env
    return ToolEnvironment([ToolSpec(t.fn, dict(t.kwargs), t.name) for t in a.tools], a.parser,
                           a.tool_timeout_s, a.tool_workers, a.max_calls_per_turn)


def generate(cfg: RunConfig, engine, tokenizer, env, rows: list[dict], ids: list[list[int]], sp):
    """One batch of rollouts: single-turn completions of `ids`, or with an environment whole
    episodes of `rows` (`rollout.episodes.run_episodes`, one engine call per round)."""
    if env is None:
        return engine.generate(ids, sp)
    from rollout.episodes import Limits, run_episodes

    lim = Limits(max_turns=cfg.agent.max_turns, max_tokens=cfg.agent.max_tokens,
                 max_turn_tokens=sp.max_tokens, seq_len=cfg.data.seq_len)
    return run_episodes(engine, tokenizer, env, rows, sp, lim)


# ---- the training batch ---------------------------------------------------------------------------
def batch_length(rollouts, seq_len: int, bucket: int = 32) -> int:
    """Rows are padded to the longest prompt + completion rounded up on the `bucket_up` ladder
    of `bucket` (at most `seq_len`), not to `seq_len`: a batch of short completions trains on
    short rows, and only the ladder's few lengths ever compile."""
    longest = max(len(r.prompt_token_ids) + len(r.token_ids) for r in rollouts)
    return min(seq_len, bucket_up(longest, bucket))


def shared_prefix_len(rollouts, group_size: int, seq_len: int, bucket: int = 16) -> int:
    """How many leading tokens every row of each group of `group_size` consecutive rows shares
    (their prompt), rounded down on the `bucket_up` ladder of `bucket` so that few shapes
    compile; 0 when groups are of one row, share fewer than `bucket` tokens, or a group's
    prompts differ."""
    if group_size <= 1 or len(rollouts) % group_size:
        return 0
    n = min(len(r.prompt_token_ids) for r in rollouts)
    n = bucket_down(min(n, seq_len - 1), bucket)  # at least one position left to the rows' own pass
    for i in range(0, len(rollouts), group_size):
        head = rollouts[i].prompt_token_ids[:n]
        if any(r.prompt_token_ids[:n] != head for r in rollouts[i + 1:i + group_size]):
            return 0
    return n


def build_batch(rollouts, advantages: np.ndarray, seq_len: int,
                group_size: int = 1, row_unit: int = 0, fixed: bool = False,
                head_window: int = 0) -> dict[str, np.ndarray]:
    """Rows = prompt + completion, right-padded to `batch_length`; masks/logprobs sit on the
    positions that *predict* each completion token (position t predicts token t+1). With
    `group_size` > 1 (rows i*G .. i*G + G-1 sampled from one prompt) the batch also carries
    `shared_prefix` [B, S]: the S leading tokens the rows of each group share, which the GRPO loss
    runs through the model once per group instead of once per row
    (`posttrain.algorithms.grpo.policy_pass`).

    With `row_unit` > 0 the sequences are packed instead, several to a row (first-fit
    decreasing, segment ids 1, 2, ... and positions restarting per sequence, so attention stays
    within each), when that costs fewer token positions than the padded rows net of the shared
    prefix: a batch of mostly short completions with a few long ones trains on a fraction of
    its padded size. A packed batch carries its advantages per token ([R, T], each sequence's
    on its tokens), which is how the loss knows its layout (`grpo.Seqs`); its row count is a
    multiple of `row_unit`.

    With `fixed` every batch of b rollouts has one shape, [b, seq_len]: rows padded to
    `seq_len`, one per sequence, no shared prefix (`grpo.shapes: fixed`: one compile of the
    update, where each costs more than the padding).

    With `head_window` W (`RunConfig.head_window`) and one sequence per row, the batch also
    carries `head_index` [B, W]: the W consecutive positions of each row that hold all of its
    loss (from its first completion position), so that the LM head runs on those alone
    (`grpo.policy_pass`): GSM8K-like rows of 512 with 256-token completions put half the
    head's matmuls and vocabulary passes on the prompt. Left out (the whole row's head) when
    some row's loss spans more than W positions or W is the row."""
    b = len(rollouts)
    seq_len = seq_len if fixed else batch_length(rollouts, seq_len)
    seqs = [(r.prompt_token_ids + r.token_ids)[:seq_len] for r in rollouts]
    n_shared = 0 if fixed else shared_prefix_len(rollouts, group_size, seq_len)
    layout, packed = [[i] for i in range(b)], False
    if row_unit and not fixed:
        candidate = packed_rows([len(x) for x in seqs], seq_len, row_unit)
        padded_cost = b * seq_len - (b - b // max(group_size, 1)) * n_shared
        if len(candidate) * seq_len < padded_cost:
            layout, packed = candidate, True
    rows = len(layout)
    tokens = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    mask = np.zeros((rows, seq_len), np.float32)
    lp_roll = np.zeros((rows, seq_len), np.float32)
    kept = np.zeros((rows, seq_len), np.int32)  # 0: the whole vocabulary
    adv = np.zeros((rows, seq_len), np.float32)
    for row, members in enumerate(layout):
        col = 0
        for s_id, i in enumerate(members, start=1):
            r, ids = rollouts[i], seqs[i]
            n, p = len(ids), len(r.prompt_token_ids)
            tokens[row, col:col + n] = ids
            seg[row, col:col + n] = s_id
            pos[row, col:col + n] = np.arange(n)
            adv[row, col:col + n] = advantages[i]
            k = max(0, n - p)
            at = col + p - 1  # the position that predicts the first completion token
            mask[row, at:at + k] = r.loss_mask[:k] if r.loss_mask else 1.0
            lp_roll[row, at:at + k] = r.logprobs[:k]
            kept[row, at:at + min(k, len(r.kept_counts))] = r.kept_counts[:k]
            col += n
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    if not packed:
        pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy()
    out = {"tokens": tokens, "targets": targets, "positions": pos, "segment_ids": seg,
           "loss_mask": mask, "logp_rollout": lp_roll, "kept_counts": kept,
           "advantages": adv if packed else advantages.astype(np.float32)}
    if n_shared and not packed:
        out["shared_prefix"] = tokens[:, :n_shared].copy()
    if head_window and not packed and head_window < seq_len:
        index = head_index(mask, head_window)
        if index is not None:
            out["head_index"] = index
    return out


def head_index(mask: np.ndarray, w: int) -> np.ndarray | None:
    """[B, w] positions per row covering every position of its `mask` (a window that starts at
    the row's first masked position, moved left where it would run past the row's end), or None
    when some row's masked positions span more than w."""
    rows, t = mask.shape
    on = mask != 0
    first = np.where(on.any(1), on.argmax(1), 0)
    last = np.where(on.any(1), t - 1 - on[:, ::-1].argmax(1), 0)
    if (last - first + 1 > w).any():
        return None
    start = np.minimum(first, t - w)
    return (start[:, None] + np.arange(w)).astype(np.int32)


# ---- engines -------------------------------------------------------------------------------------
def build_engines(cfg: RunConfig, trainer, tokenizer, run_dir: Path):
    """The recipe's rollout engine: the colocated one on the trainer's own model, else an engine
    (in this process, or `rollout.num_workers` Ray workers) started from an HF export of the
    trainer's current policy."""
    r = cfg.rollout
    hf_dir = run_dir / "rollout_hf"
    if r.placement == "colocated" and r.engine == "jax":
        from rollout.jax_engine import JaxEngine

        return JaxEngine(trainer.policy(), tokenizer, seed=cfg.seed, copy_weights=True,
                         decode_phases=r.decode_phases, unroll_layers=r.unroll_layers,
                         kv_cache_dtype=r.kv_cache_dtype, max_rows=r.max_rows,
                         continuous_batching=r.continuous_batching,
                         lora_scale=cfg.model.lora.scale, reuse_programs=r.reuse_programs)
    trainer.save_hf(hf_dir, lora_scale=cfg.model.lora.scale)
    tokenizer.save_pretrained(hf_dir)
    import jax

    platform = jax.default_backend()
    if platform == "gpu" and r.engine == "vllm" and r.placement == "colocated" and \
            r.transport == "in_process":
        raise UserError("rollout.transport: in_process hands vLLM views of the JAX buffers in "
                        "the trainer's process; on GPUs vLLM's model lives in processes of its "
                        "own: use vllm_ipc (or auto)")
    vllm = {"dtype": r.dtype, "gpu_memory_utilization": r.gpu_memory_utilization,
            "tensor_parallel_size": r.tensor_parallel_size, "seed": cfg.seed,
            "enforce_eager": r.enforce_eager, "enable_expert_parallel": r.enable_expert_parallel,
            "weight_transfer": r.weight_transfer(platform)}
    standins = os.environ.get("POSTTRAIN_CUDA_STANDINS") == "1"  # CPU dry runs of the GPU path
    if r.placement == "colocated":
        from rollout.vllm_engine import VllmEngine

        engine = VllmEngine(str(hf_dir), **vllm, enable_sleep_mode=r.sleep_level > 0)
        if standins and vllm["weight_transfer"]:
            from rollout.cuda_standins import install_in_engine

            install_in_engine(engine)
        return engine
    from posttrain.cluster import init_ray
    from rollout.worker import WorkerGroup

    init_ray(cfg)
    gpus = r.gpus_per_worker
    if gpus is None:
        gpus = r.tensor_parallel_size if platform == "gpu" and r.engine == "vllm" else 0
    spec = {"kind": r.engine, "model_dir": str(hf_dir), "tokenizer_dir": str(hf_dir), "seed": cfg.seed,
            "scan_layers": trainer.model_cfg.scan_layers, "decode_phases": r.decode_phases,
            "unroll_layers": r.unroll_layers, "kv_cache_dtype": r.kv_cache_dtype,
            "max_rows": r.max_rows, "reuse_programs": r.reuse_programs,
            "continuous_batching": r.continuous_batching,
            "num_gpus": gpus, "vllm": vllm}
    group = WorkerGroup(spec, r.num_workers, request_timeout_s=r.request_timeout_s)
    if standins and vllm["weight_transfer"]:
        from rollout.cuda_standins import install, install_in_group

        install()
        install_in_group(group)
    return group


# ---- sampling a batch --------------------------------------------------------------------------
def sample_groups(cfg: RunConfig, engine, pool, prompts: PromptIterator, tokenizer, sp, times: dict,
                  env=None):
    """Generate and score `prompts_per_step` groups. With DAPO dynamic sampling, groups whose
    rewards are all equal (no signal) are dropped and more prompts are sampled, up to
    `max_attempts`; a batch still short is filled with zero-advantage copies so shapes stay
    fixed. Groups dropped by the reward pool (`fallback: drop_group`) are handled the same way."""
    from rollout.engine import SamplingParams

    g = cfg.grpo
    kept_rollouts, kept_rewards, last_scores, taken = [], [], None, []
    for attempt in range(1, (g.dynamic_sampling.max_attempts if g.dynamic_sampling.enabled else 1) + 1):
        need = g.prompts_per_step - len(kept_rollouts) // g.group_size
        rows = prompts.take(need)
        taken += prompts.last_ids
        ids = [encode_prompt(r, tokenizer, g.chat_template, i, cfg.data.source)
               for i, r in zip(prompts.last_ids, rows)] if env is None else None
        t0 = time.perf_counter()
        outs = generate(cfg, engine, tokenizer, env, rows, ids,
                        SamplingParams(**{**sp.__dict__, "seed": sp.seed + attempt}))
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
    return kept_rollouts, rewards, adv_mask, last_scores, attempt, taken


# ---- evaluation ----------------------------------------------------------------------------------
def greedy_accuracy(cfg: RunConfig, engine, pool, rows: list[dict], prompt_ids: list[list[int]],
                    *, stop: tuple[str, ...] = (), prefix: str = "", env=None,
                    tokenizer=None) -> tuple[dict, list[str]]:
    """Greedy completions of held-out rows, scored by the reward pool; 'correct' means the reward
    named by `eval.reward` (default: the first) reaches 1. `prefix` is prepended to each
    completion before scoring (a plain-text probe whose prompt ends mid-sentence)."""
    from posttrain import faults
    from rollout.engine import SamplingParams

    faults.point("eval")
    from rollout.episodes import episode_metrics

    outs = generate(cfg, engine, tokenizer, env, rows, prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=cfg.eval.max_tokens or cfg.grpo.max_tokens, stop=stop))
    texts = [prefix + o.text for o in outs]
    scores = pool.score([r["prompt"] for r in rows], texts, reward_columns(rows, 1, outs), 1)
    label = cfg.eval.reward or cfg.rewards.functions[0].label
    correct = np.nan_to_num(scores.per_function[label]) >= 1.0
    metrics = {"eval/accuracy": float(correct.mean()),
               "eval/reward_mean": float(np.nanmean(scores.totals)),
               "eval/completion_len": float(np.mean([len(o.token_ids) for o in outs]))}
    metrics.update({f"eval/{k.split('/', 1)[1]}": v for k, v in episode_metrics(outs).items()})
    return metrics, texts


def evaluate(cfg: RunConfig, engine, tokenizer, pool, rows: list[dict], env=None) -> dict:
    ids = [encode_prompt(r, tokenizer, cfg.grpo.chat_template, i, cfg.data.eval_source or
                         cfg.data.source) for i, r in enumerate(rows)] if env is None else None
    return greedy_accuracy(cfg, engine, pool, rows, ids, stop=tuple(cfg.grpo.stop), env=env,
                           tokenizer=tokenizer)[0]
