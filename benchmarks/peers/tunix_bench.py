"""Peer benchmark: Google's Tunix (0.1.7, JAX 0.10.2) on our reference SFT and GRPO workloads.

Tunix cannot be installed into the repo's .venv, so this file runs under its own interpreter
(`bash benchmarks/peers/setup_tunix.sh` makes .venv-tunix) and
imports nothing from the repo except, when no PROMPTS_JSON is given, `posttrain.data.generated`
(stdlib only):

    .venv-tunix/bin/python benchmarks/peers/tunix_bench.py sft  MODEL_DIR STEPS
    .venv-tunix/bin/python benchmarks/peers/tunix_bench.py grpo MODEL_DIR STEPS [PROMPTS_JSON]

It prints progress to stderr and, last, one line `@@{json}` on stdout. STEPS counts every step,
warm-up included (like the TRL peers): SFT drops the first 5, GRPO the first 3, so STEPS must be
larger than that. JSON keys: `step_s` is the list of every step's wall time (warm-up included, as
the TRL peers report it); `median_step_s` / `mean_step_s` cover the steps after warm-up; sft adds
`tokens_per_s` (16 * 256 / median step) and `tokens_per_s_mean` (over the timed wall span); grpo
adds the per-step lists `rollout_s`, `train_s`, `other_s` and their post-warm-up medians under
`median`. Both add `matmul_peak_gflops` (see the end of this docstring).

MODEL_DIR is a Hugging Face Qwen3 directory (config.json, model.safetensors, tokenizer files), e.g.
from `tests.helpers.save_tiny_model_with_tokenizer(dir, "qwen3", hidden=256, inter=768, layers=4,
heads=4, kv=2, head_dim=64)`. The model is Tunix's own `tunix.models.qwen3.model.Qwen3`: its
`ModelConfig` is built by hand from config.json (Tunix only ships presets for the released sizes;
the class itself supports tied embeddings, q/k-norm and GQA, so the reference shape needs no
change), fp32 weights and compute, and the real weights are loaded from model.safetensors with
Tunix's own loader (`tunix.models.qwen3.params.create_model_from_safe_tensors`; with tied
embeddings there is no lm_head tensor and Tunix decodes with the embedding). One CPU device,
wrapped in a 1x1 ("fsdp", "tp") mesh (`tunix.utils.mesh.create_mesh`, Auto axes) as Tunix's CLI
does. Known deviation: Tunix 0.1.7's Qwen3 attention calls `apply_rope` without the config's
rope_theta, so it always uses theta 1e6 whatever the config says (ours is 1e4). Same FLOPs and
timing; the logits match transformers' to ~1e-6 once the HF model is also given theta 1e6 (checked
by hand on the reference model), and differ by ~0.3 with the true 1e4.

sft: `tunix.sft.peft_trainer.PeftTrainer`, full fine-tuning (no LoRA, so `nnx.Optimizer` over every
  `nnx.Param`), `optax.adamw(1e-5)`, Tunix's default next-token loss, batch 16 x 256. Tunix does not
  pack, so the rows are packed by hand: random token ids from the vocabulary filling all 256
  positions, mask all ones (one causal sequence per row, positions 0..255). The model input is
  built the way `tunix.cli.peft_main` does it (positions from the mask, causal attention mask).
  Timing uses Tunix's own `TrainingHooks.on_train_step_end`, which the trainer calls once per step
  after fetching that step's loss to the host (so the step has finished); consecutive calls are
  one step apart and the trainer keeps its normal one-step-ahead dispatch. Nothing else is
  changed: no checkpointing, no metrics backends (no TensorBoard / W&B), no eval.
  tokens_per_s = 16 * 256 / median step time after 5 warm-up steps.

grpo: `tunix.rl.grpo.grpo_learner.GRPOLearner` + `GRPOConfig` on `tunix.rl.rl_cluster.RLCluster`
  with the "vanilla" rollout engine (Tunix's own JAX sampler), actor and rollout colocated on the
  same mesh (so they share the weights and there is no weight sync). 8 prompts per step x
  num_generations 8, at most 64 new tokens, temperature 1.0 (top_p 1.0, no top_k: plain
  categorical sampling), beta 0.0 and no reference model (Tunix allows `reference=None`; with beta
  0 it never computes reference log-probs), num_iterations 1 (so no separate old-policy forward;
  Tunix's loss uses stop_gradient of the current log-probs), one optimizer update per batch
  (mini-batch = full batch of 64), optax.adamw(1e-5), Tunix's default GRPO loss (epsilon 0.2,
  sequence-mean-token-mean). Prompts are the arithmetic problems with the tokenizer's chat template
  applied (as the TRL peer does), left-padded by Tunix's sampler to max_prompt_length 32;
  completions are right-padded to 64, so the update sees 64 x 96 tokens. KV cache 96 = 32 + 64 (the
  smallest Tunix accepts; its CLI would use +256). Reward: 1.0 if the last number in the
  completion equals the answer, else 0.0.
  Timing: a wall-clock stamp after every `rl_cluster.update_actor` (the last thing in a step; it
  returns only after Tunix's trainer has waited for the update), so step k = stamp k - stamp k-1;
  the split wraps `rl_cluster.generate` (rollout, tokenising and detokenising included: it
  returns host tokens, so it is blocked on) and `rl_cluster.update_actor` (train: loss forward,
  backward, AdamW); "other" is the rest of the step (reward, advantages, metrics buffering, Tunix's
  data-queue hand-off between its rollout thread and the trainer). Median over steps after 3
  warm-up steps. Tunix's vanilla rollout passes no seed, so its sampler uses PRNGKey(0) on every
  call (the same random stream each step; timing is unaffected).

XLA_FLAGS is dropped (as the repo's own benchmarks do for ours) and JAX_PLATFORMS defaults to
cpu; thread counts are left at XLA's defaults. After the run the script measures the f32 matmul
peak in the same process, with the same shapes and method as `benchmarks.common.
matmul_peak_gflops` (`matmul_peak_gflops` in the JSON), since these shared cores move by 2x+
between runs.
"""

from __future__ import annotations

import os

os.environ.pop("XLA_FLAGS", None)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WANDB_MODE", "disabled")

import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

warnings.filterwarnings("ignore", message=".*`with mesh:` context manager.*",
                        category=DeprecationWarning)
ROOT = Path(__file__).resolve().parents[2]
SFT_WARMUP, GRPO_WARMUP = 5, 3
SFT_BATCH, SFT_LEN = 16, 256
PROMPTS_PER_STEP, GROUP, MAX_NEW, PROMPT_LEN = 8, 8, 64, 32
LR = 1e-5


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def model_config(model_dir: Path):
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3

    hf = json.loads((model_dir / "config.json").read_text())
    rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return qwen3.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)),
        dtype=jnp.float32, param_dtype=jnp.float32)


def make_mesh():
    import jax
    from tunix.utils import mesh as mesh_lib

    return mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])


def load_model(model_dir: Path, mesh):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import params

    cfg = model_config(model_dir)
    model = params.create_model_from_safe_tensors(str(model_dir), cfg, mesh=mesh, dtype=jnp.float32)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log(f"tunix Qwen3 loaded from {model_dir}: {n / 1e6:.2f}M params, {cfg}")
    return model, cfg, n


def matmul_peak_gflops(rows: int = 4096, reps: int = 5) -> float:
    """f32 GFLOP/s of rows x 256 @ 256 x 768 and back, best of `reps` (= benchmarks.common's)."""
    import jax

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (rows, 256))
    w1, w2 = jax.random.normal(k2, (256, 768)), jax.random.normal(k3, (768, 256))
    f = jax.jit(lambda x: ((x @ w1) @ w2).sum())
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return 2 * 2 * rows * 256 * 768 / best / 1e9


def summary(step_s: list[float], warmup: int) -> dict:
    timed = step_s[warmup:]
    return {"median_step_s": statistics.median(timed), "mean_step_s": statistics.fmean(timed),
            "timed_steps": len(timed)}


def step_clock():
    """Tunix training hooks that stamp the wall clock at each step end (the trainer has just
    fetched that step's loss): `.start`, `.ends`, `.losses`."""
    from tunix.sft import hooks

    class StepClock(hooks.TrainingHooks):
        def __init__(self):
            self.start, self.ends, self.losses = None, [], []

        def on_train_start(self, train_ctx):
            self.start = time.perf_counter()

        def on_train_step_end(self, train_ctx, train_step, train_loss):
            self.ends.append(time.perf_counter())
            self.losses.append(float(train_loss))

        def on_train_end(self, train_ctx):
            pass

        def on_train_step_start(self, train_ctx):
            pass

        def on_eval_step_start(self, train_ctx):
            pass

        def on_eval_step_end(self, train_ctx, eval_loss):
            pass

    return StepClock()


def gen_model_input_fn(x):
    """A `PeftTrainer` batch (every position real) as Tunix's Qwen3 takes it."""
    from tunix.sft import utils as sft_utils

    mask = x.input_mask.astype(bool)
    return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
            "positions": sft_utils.build_positions_from_mask(mask),
            "attention_mask": sft_utils.make_causal_attn_mask(mask)}


# ---------------------------------------------------------------------------------------------
def run_sft(model_dir: Path, steps: int) -> dict:
    import numpy as np
    import optax
    from tunix.sft import peft_trainer

    mesh = make_mesh()
    model, cfg, n_params = load_model(model_dir, mesh)

    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=steps, checkpoint_root_directory=None,
        metrics_logging_options=None, pbar_description=None)
    trainer = peft_trainer.PeftTrainer(model, optax.adamw(LR), config)
    assert not trainer._lora_enabled  # full fine-tuning: every nnx.Param is trained

    trainer = trainer.with_gen_model_input_fn(gen_model_input_fn)
    clock = step_clock()
    trainer.with_training_hooks(clock)

    rng = np.random.default_rng(0)
    # Hand-packed rows: every one of the 256 positions is a real token.
    data = [peft_trainer.TrainingInput(
        input_tokens=rng.integers(0, cfg.vocab_size, (SFT_BATCH, SFT_LEN), dtype=np.int32),
        input_mask=np.ones((SFT_BATCH, SFT_LEN), np.int32)) for _ in range(steps)]

    t0 = time.perf_counter()
    with mesh:
        trainer.train(data)
    wall = time.perf_counter() - t0
    ends = clock.ends
    if len(ends) != steps:
        raise RuntimeError(f"expected {steps} step-end hooks, got {len(ends)}")
    step_s = [b - a for a, b in zip([clock.start] + ends[:-1], ends)]
    s = summary(step_s, SFT_WARMUP)
    tokens = SFT_BATCH * SFT_LEN
    timed_wall = ends[-1] - ends[SFT_WARMUP - 1]
    return {"peer": "tunix", "mode": "sft", "steps": steps, "warmup": SFT_WARMUP,
            "batch": SFT_BATCH, "seq_len": SFT_LEN, "params": n_params,
            "tokens_per_s": tokens / s["median_step_s"],
            "tokens_per_s_mean": tokens * s["timed_steps"] / timed_wall,
            **s, "step_s": step_s, "losses": clock.losses, "train_wall_s": wall}


# ---------------------------------------------------------------------------------------------
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


REWARDS: list[float] = []  # mean reward of each call, for the report


def last_number_reward(prompts, completions, answer, **kwargs):
    """1.0 when the last number in the completion equals the answer, else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        nums = _NUM.findall(c)
        out.append(1.0 if nums and nums[-1] == str(a).strip() else 0.0)
    REWARDS.append(sum(out) / max(len(out), 1))
    return out


def load_prompts(path: str | None) -> list[dict]:
    if path:
        return json.loads(Path(path).read_text())
    sys.path.insert(0, str(ROOT))
    from posttrain.data import generated

    return [{"prompt": r["prompt"], "answer": r["answer"]}
            for r in generated.prompt_completion_rows("train", 2000, 99, 0)]


def time_cluster(cluster, on_update=None) -> dict[str, list]:
    """Wraps `cluster.generate` and `cluster.update_actor` (instance attributes, so they see
    the learner's calls from any thread) to record: each rollout's seconds and mean completion
    length, each update's seconds and end stamp."""
    import numpy as np

    t = {"rollout_s": [], "lengths": [], "train_s": [], "ends": []}
    generate, update_actor = cluster.generate, cluster.update_actor

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        out = generate(*a, **k)
        t["rollout_s"].append(time.perf_counter() - t0)
        t["lengths"].append(float(np.mean([len(x) for x in out.tokens])))
        return out

    def timed_update_actor(*a, **k):
        t0 = time.perf_counter()
        out = update_actor(*a, **k)
        t["ends"].append(time.perf_counter())
        t["train_s"].append(t["ends"][-1] - t0)
        if on_update:
            on_update(t)
        return out

    cluster.generate, cluster.update_actor = timed_generate, timed_update_actor
    return t


def run_grpo(model_dir: Path, steps: int, prompts_json: str | None) -> dict:
    import numpy as np
    import optax
    from transformers import AutoTokenizer
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    mesh = make_mesh()
    model, cfg, n_params = load_model(model_dir, mesh)
    tok = AutoTokenizer.from_pretrained(str(model_dir))

    rows = load_prompts(prompts_json)
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                     add_generation_prompt=True, tokenize=False) for r in rows]
    longest = max(len(tok.encode(t)) for t in texts[: steps * PROMPTS_PER_STEP])
    if longest > PROMPT_LEN:
        raise ValueError(f"a prompt has {longest} tokens > {PROMPT_LEN}")

    def batches():
        for k in range(steps):
            idx = [(k * PROMPTS_PER_STEP + i) % len(rows) for i in range(PROMPTS_PER_STEP)]
            yield {"prompts": np.array([texts[i] for i in idx]),
                   "answer": np.array([rows[i]["answer"] for i in idx])}

    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=MAX_NEW, max_prompt_length=PROMPT_LEN,
        kv_cache_size=PROMPT_LEN + MAX_NEW, temperature=1.0, top_p=1.0, top_k=None)
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(LR), eval_every_n_steps=10**9, max_steps=steps,
        checkpoint_root_directory=None, metrics_logging_options=None, pbar_description=None)
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, training_config=training_config,
        rollout_config=rollout_config)
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tok,
                                       cluster_config=cluster_config)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[last_number_reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0))
    if learner.should_sync_weights:
        log("warning: Tunix will sync weights between actor and rollout every step")

    def on_update(t):
        ends, r, u = t["ends"], t["rollout_s"], t["train_s"]
        log(f"step {len(ends)}: {ends[-1] - (ends[-2] if len(ends) > 1 else t0):.3f} s "
            f"(rollout {r[-1]:.3f}, train {u[-1]:.3f})")

    timing = time_cluster(cluster, on_update)
    rollout_s, train_s, ends, lengths = (timing[k] for k in ("rollout_s", "train_s", "ends",
                                                              "lengths"))
    t0 = time.perf_counter()
    learner.train(batches())
    wall = time.perf_counter() - t0
    if len(ends) != steps or cluster.actor_trainer.train_steps != steps:
        raise RuntimeError(f"expected {steps} updates, got {len(ends)} "
                           f"({cluster.actor_trainer.train_steps} optimizer steps)")
    step_s = [b - a for a, b in zip([t0] + ends[:-1], ends)]
    other_s = [s - r - u for s, r, u in zip(step_s, rollout_s, train_s)]
    w = GRPO_WARMUP
    # per-step lists (warm-up included), like the TRL peers' "step_s"; medians skip the warm-up
    phases = {"step_s": step_s, "rollout_s": rollout_s, "train_s": train_s, "other_s": other_s}
    return {"peer": "tunix", "mode": "grpo", "steps": steps, "warmup": w, "params": n_params,
            "prompts_per_step": PROMPTS_PER_STEP, "num_generations": GROUP,
            "max_new_tokens": MAX_NEW, "prompt_len": PROMPT_LEN,
            **summary(step_s, w),
            "median": {k: statistics.median(v[w:]) for k, v in phases.items()},
            **phases,
            "mean_completion_tokens": lengths, "mean_reward": REWARDS, "train_wall_s": wall}


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("sft", "grpo"):
        sys.exit(__doc__)
    mode, model_dir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    warm = SFT_WARMUP if mode == "sft" else GRPO_WARMUP
    if steps <= warm:
        sys.exit(f"STEPS must be > {warm} warm-up steps for {mode}")
    import jax

    log(f"jax {jax.__version__} on {jax.devices()}")
    t = time.perf_counter()
    res = run_sft(model_dir, steps) if mode == "sft" else run_grpo(
        model_dir, steps, sys.argv[4] if len(sys.argv) > 4 else None)
    res["total_s"] = time.perf_counter() - t
    res["matmul_peak_gflops"] = matmul_peak_gflops()
    print("@@" + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
