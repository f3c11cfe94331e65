"""The trainer behind one interface: the policy's state, its jitted steps and its checkpoints.

The loops (`train.loop` for pretrain/SFT, `pipeline` for RL) hold data, rollouts and metrics and
talk to a trainer only through these methods, with global host batches in and host values out:

    restore() -> meta | None           resume from the latest checkpoint (data position inside)
    train_step(batch) -> pending       one optimizer step; `pending()` -> metrics (host)
    eval_loss(batches) -> float
    update(batch) -> (metrics, logp_old)   a GRPO batch: logp_old/ref, mu x mini-batch steps
    save(step, data_state, **meta); wait(); close()
    exporter(...) / score(sequences) / save_hf(dir)   the policy as engines load it (weight sync)

Two implementations: `Trainer` (this module) runs in the calling process over its devices, the
default; `posttrain.train.group.TrainerGroup` runs one `Trainer` per host in Ray actors that
form one JAX program over a global mesh (`trainer.hosts > 1`). Inside a group every method runs
on every host (the same program), each host putting only its own rows of the batch on its
devices (`jax.make_array_from_process_local_data`); values come back from the devices through
`host_value` (a gather where an array spans hosts).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import RunConfig
from posttrain.models import qwix_apply
from posttrain.models.config import ModelConfig
from posttrain.models.export import host_array, save_hf
from posttrain.models.loading import load_model
from posttrain.models.transformer import CausalLM
from posttrain.sharding import (batch_shards, batch_sharding, make_mesh, shard_batch, state_shardings,
                                use_mesh)
from posttrain.train.checkpoint import Checkpointer, restore_train_state, save_train_state
from posttrain.train.optimizer import init_opt_state, lr_schedule, make_optimizer
from posttrain.train.step import TrainState, make_eval_step, make_train_step, next_token_loss
from rollout.buckets import Exporter
from rollout.jax_engine import score_sequences


HOST_ONLY = ("pair_rows",)  # batch keys the host keeps (which dataset row each pair came from)


def host_value(tree):
    """Device values -> numpy, in one batched transfer. An array spread over several processes
    is gathered (every process calls this on the same values: a collective)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)):
        return jax.device_get(tree)
    return jax.tree.map(lambda x: host_array(x) if isinstance(x, jax.Array) else x, tree)


def batch_rows(mesh, rules, rows: int) -> tuple[int, int]:
    """The rows [lo, hi) of a global batch of `rows` that this process's devices hold."""
    sh = batch_sharding(mesh, rules, 1)
    spans = {(s[0].start or 0, s[0].stop if s[0].stop is not None else rows)
             for s in sh.addressable_devices_indices_map((rows,)).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if sum(b - a for a, b in spans) != hi - lo:
        raise ValueError(f"this process's batch rows are not contiguous: {sorted(spans)}")
    return lo, hi


def create_model(cfg: RunConfig, model_cfg: ModelConfig, mesh) -> CausalLM:
    """Random init directly into the sharded layout, or the checkpoint at model.path (with an
    int8 LoRA base on an accelerator, quantized in host memory first: `base_made_on_host`)."""
    rules = cfg.mesh.rules
    host = cfg.model.path is not None and base_made_on_host(cfg)
    if cfg.model.path is None:
        abstract = nnx.eval_shape(lambda: CausalLM(model_cfg, nnx.Rngs(cfg.seed)))
        shardings = state_shardings(nnx.state(abstract), mesh, rules)

        @jax.jit
        def init():
            return nnx.state(CausalLM(model_cfg, nnx.Rngs(cfg.seed)))

        graphdef = nnx.graphdef(abstract)
        state = jax.jit(init, out_shardings=shardings)()
        model = nnx.merge(graphdef, state)
    else:
        with jax.default_device(jax.local_devices(backend="cpu")[0]) if host else nullcontext():
            model = load_model(cfg.model.path, **{k: getattr(model_cfg, k) for k in (
                "scan_layers", "remat", "param_dtype", "compute_dtype")})
            if host:  # quantized where the checkpoint is, the int8 base then sent
                model = with_adapters(model, cfg)
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    if cfg.model.lora.rank and not host:
        model = with_adapters(model, cfg)
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    if cfg.model.quantization == "int8":
        import qwix

        provider = qwix.QtProvider([qwix.QtRule(module_path=r".*_proj|lm_head",
                                                weight_qtype=jnp.int8, act_qtype=jnp.int8)])
        model = qwix_apply(model, provider)
    return model


def base_made_on_host(cfg: RunConfig) -> bool:
    """Whether a checkpoint is loaded and its LoRA int8 base made in host memory, then sent:
    on an accelerator with `model.lora.int8_base` (a Qwen3-8B's bf16 weights, 16.4 GB, are more
    than a 16 GB TPU v5e holds; its int8 base is 8.2 GB). Elsewhere the weights go to the
    devices as they load."""
    lora = cfg.model.lora
    return bool(lora.rank and lora.int8_base) and jax.default_backend() != "cpu"


def with_adapters(model: CausalLM, cfg: RunConfig) -> CausalLM:
    """`model` with the recipe's LoRA adapters (over an int8 copy of the base with
    `model.lora.int8_base`); also under `nnx.eval_shape` (`posttrain plan` compiles the step
    of the abstract model)."""
    import qwix

    lora = cfg.model.lora
    provider = qwix.LoraProvider(module_path=lora.target_modules, rank=lora.rank,
                                 alpha=lora.alpha, dropout=lora.dropout,
                                 weight_qtype=jnp.int8 if lora.int8_base else None)
    return qwix_apply(model, provider, rngs=nnx.Rngs(params=cfg.seed, dropout=cfg.seed))


class Trainer:
    """The policy trainer over this process's view of the mesh (see the module docstring).
    `algorithm`: the recipe's; GRPO adds the policy loss, the reference policy (beta > 0) and
    `update`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, model_cfg: ModelConfig, loss_fn=None):
        self.cfg, self.run_dir, self.model_cfg = cfg, Path(run_dir), model_cfg
        t, g = cfg.train, cfg.grpo
        rl = cfg.algorithm == "grpo"
        self.mesh = make_mesh(cfg.mesh)
        self.rules = cfg.mesh.rules
        self._mesh_ctx = use_mesh(self.mesh, self.rules)
        self._mesh_ctx.__enter__()
        model = create_model(cfg, model_cfg, self.mesh)
        self.trainable = nnx.LoRAParam if cfg.model.lora.rank else nnx.Param
        self.lora_meta = cfg.model.lora.model_dump() if cfg.model.lora.rank else {}
        self.graphdef, params, frozen = nnx.split(model, self.trainable, ...)
        updates = t.steps * (g.mu * g.mini_batches if rl else 1)
        optimizer = make_optimizer(cfg.optimizer, updates)
        self.state = TrainState(params, frozen, init_opt_state(optimizer, params),
                                jnp.zeros((), jnp.int32),
                                jax.random.key_data(jax.random.key(cfg.seed)))
        if rl:
            from posttrain.algorithms.grpo import make_logprob_fn, make_loss_fn

            loss_fn = make_loss_fn(cfg)
            self.logprob_fn = make_logprob_fn(self.graphdef, g)
            # beta 0: no reference policy is kept
            self.ref_params = jax.tree.map(jnp.copy, params) if g.beta > 0 else None
        self.pair_ref_params, self.reference_fn = None, None  # DPO's (GRPO's: ref_params)
        if cfg.algorithm == "dpo":
            from posttrain.algorithms import dpo

            loss_fn = dpo.make_loss_fn(cfg.dpo)
            route = cfg.dpo.reference_route(lora=bool(cfg.model.lora.rank))
            if route is not None:
                self.reference_fn = jax.jit(dpo.make_reference_fn(self.graphdef))
            # the reference's weights: the starting ones, copied, or the adapters at zero (the
            # base model itself: W + s A B with B = 0); precompute reads the starting params
            # once, before any step or restore (`reference_logps`)
            if route == "model":
                self.pair_ref_params = jax.tree.map(jnp.copy, params)
            elif route == "adapters_off":
                self.pair_ref_params = jax.tree.map(jnp.zeros_like, params)
        state_sh = jax.tree.map(lambda x: x.sharding, self.state)
        self.step_fn = jax.jit(make_train_step(self.graphdef, optimizer, loss_fn or next_token_loss,
                                               t.grad_accum, lr_schedule(cfg.optimizer, t.steps)),
                               donate_argnums=0, out_shardings=(state_sh, None))
        self.eval_fn = jax.jit(make_eval_step(self.graphdef, loss_fn or next_token_loss))
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep,
                                 cfg.checkpoint.async_save)

    # ---- data in -------------------------------------------------------------------------------
    def put(self, batch: dict, rows: int | None = None) -> dict:
        """A batch on the mesh: this process's rows of a global batch of `rows` (default: all),
        with the reference's log-probs added where the reference scores every batch (DPO)."""
        dev = shard_batch({k: v for k, v in batch.items() if k not in HOST_ONLY},
                          self.mesh, self.rules, rows)
        if self.pair_ref_params is not None:
            dev.update(self.reference_fn(self.pair_ref_params, self.state.frozen, dev))
        return dev

    def reference_logps(self, batch: dict, rows: int | None = None) -> dict[str, np.ndarray]:
        """DPO's reference log-probs of a batch (host arrays): by the reference's weights, or
        for `precompute` by the current ones (the starting weights, before any step)."""
        dev = shard_batch({k: v for k, v in batch.items() if k not in HOST_ONLY},
                          self.mesh, self.rules, rows)
        params = self.state.params if self.pair_ref_params is None else self.pair_ref_params
        return host_value(self.reference_fn(params, self.state.frozen, dev))

    def local_rows(self, rows: int) -> tuple[int, int]:
        return batch_rows(self.mesh, self.rules, rows)

    def row_unit(self) -> int:
        """What a GRPO batch's row count must be a multiple of: its mini-batches' micro-batches
        each split over the batch shards (`posttrain.rollouts.build_batch` packs to it)."""
        g, t = self.cfg.grpo, self.cfg.train
        return g.mini_batches * t.grad_accum * batch_shards(self.mesh, self.rules)

    # ---- steps ---------------------------------------------------------------------------------
    def train_step(self, batch: dict, rows: int | None = None):
        """Dispatch one step; returns `pending`, whose call gives the step's metrics on the host
        (the device keeps computing while the caller prepares the next batch)."""
        self.state, m = self.step_fn(self.state, self.put(batch, rows))
        return lambda: host_value(m)

    def eval_loss(self, batches: list[dict], rows: int | None = None) -> float:
        tot, cnt = 0.0, 0.0
        for b in batches:
            s, n = host_value(self.eval_fn(self.state.params, self.state.frozen, self.put(b, rows)))
            tot, cnt = tot + float(s), cnt + float(n)
        return tot / max(cnt, 1.0)

    def update(self, batch: dict, rows: int | None = None) -> tuple[dict, np.ndarray]:
        """One GRPO batch: log-probs of the old policy (`grpo.scores_old`: not with one update
        per batch, whose own forward is pi_old, nor with the engine's log-probs as pi_old) and
        the reference's, then `mu` passes of `mini_batches` steps. Returns mean metrics (with
        the time split) and the trainer's log-probs under pi_old per token [B, L] for the
        mismatch metrics (without the pass of its own: the first mini-batch's rows, from its
        forward before any update; the other rows NaN)."""
        g = self.cfg.grpo
        t0 = time.perf_counter()
        dev = self.put(batch, rows)
        if g.scores_old:
            dev["logp_old"] = self.logprob_fn(self.state.params, self.state.frozen, dev)
        if self.ref_params is not None:
            dev["logp_ref"] = self.logprob_fn(self.ref_params, self.state.frozen, dev)
        jax.block_until_ready(dev)
        t_logprob = time.perf_counter() - t0
        t0 = time.perf_counter()
        n_rows = dev["tokens"].shape[0]
        mb = n_rows // g.mini_batches
        ms = []
        for _ in range(g.mu):
            for k in range(g.mini_batches):
                sub = jax.tree.map(lambda x: x[k * mb:(k + 1) * mb], dev)
                self.state, m = self.step_fn(self.state, sub)
                ms.append(m)
        ms = host_value(ms)
        scored = [x.pop("rows/logp", None) for x in ms][0]
        if g.scores_old:
            logp_old = host_value(dev["logp_old"])
        else:
            logp_old = np.full((n_rows, scored.shape[1]), np.nan, np.float32)
            logp_old[:len(scored)] = scored
        m = jax.tree.map(lambda *xs: float(np.mean(xs)), *ms)
        m.update({"time/logprob": t_logprob, "time/update": time.perf_counter() - t0})
        return m, logp_old

    # ---- checkpoints ---------------------------------------------------------------------------
    def restore(self) -> dict | None:
        """Resume from the latest checkpoint when the recipe asks to: its meta (with the data
        position and `step`), or None when there is none."""
        if not self.cfg.checkpoint.resume:
            return None
        found = self.ckpt.restore_latest(lambda step: restore_train_state(
            self.ckpt, step, self.graphdef, self.state, self.trainable))
        if found is None:
            return None
        step, (self.state, meta) = found
        return {**meta, "step": step}

    def latest_step(self) -> int | None:
        return self.ckpt.latest_step()

    def save(self, step: int, data_state: dict, **meta) -> None:
        save_train_state(self.ckpt, step, self.graphdef, self.state, self.model_cfg, data_state,
                         self.lora_meta, **meta)

    def wait(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()
        self._mesh_ctx.__exit__(None, None, None)

    # ---- the policy, as engines take it ----------------------------------------------------------
    def policy(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state.params, self.state.frozen)

    def policy_state(self) -> nnx.State:
        return nnx.state(self.policy())

    def exporter(self, **kw):
        """A `rollout.buckets.Exporter` of the current policy (keyword arguments as its)."""
        return Exporter(self.policy_state(), self.model_cfg, **kw)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The probe's log-probs under the current policy (see `rollout.weight_sync`)."""
        return score_sequences(self.policy(), sequences)

    def save_hf(self, out: Path, lora_scale: float | None = None, write: bool = True) -> None:
        save_hf(self.policy(), Path(out), lora_scale=lora_scale, write=write)
