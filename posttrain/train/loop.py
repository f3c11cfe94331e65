"""The language-model training loop shared by `pretrain` and `sft`.

Reads top to bottom: tokenizer -> model config -> data -> trainer (`train.trainer`: the model,
random init or a checkpoint, sharded by the rules table, optionally int8 QAT; its TrainState,
jitted steps and checkpoints; in this process or a group of hosts) -> resume -> steps (log,
eval, checkpoint) -> final checkpoint + HF export. Algorithms differ only in the data format
and the `loss_fn` they pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from flax import nnx

from posttrain import compile_cache, faults, watchdog
from posttrain.config import RunConfig
from posttrain.data import generated
from posttrain.data.dataset import Encoder, PackedBatches, load_rows
from posttrain.data.tokenizer import load_tokenizer, train_bpe
from posttrain.errors import UserError
from posttrain.models.config import ModelConfig
from posttrain.models.loading import hf_model_config, resolve_model_path, tokenizer_next_to
from posttrain.pairs import sampled_pairs
from posttrain.train.checkpoint import find_checkpoint, read_meta
from posttrain.train.group import make_trainer
from posttrain.train.step import next_token_loss


# ---- pieces ----------------------------------------------------------------------------------
def prepare_tokenizer(cfg: RunConfig, run_dir: Path):
    """The recipe's tokenizer, or one trained on the data; always saved to RUN_DIR/tokenizer."""
    out = run_dir / "tokenizer"
    src = cfg.tokenizer.path or (tokenizer_next_to(resolve_model_path(cfg.model.path))
                                 if cfg.model.path else None)
    if src is not None:
        tok = load_tokenizer(src)
        if not out.exists():
            tok.save_pretrained(out)
        return tok
    if out.exists():
        return load_tokenizer(out)
    if cfg.data.source != "generated":
        raise UserError("tokenizer.path: required unless the data is generated or model.path has one")
    texts = generated.corpus_for_tokenizer(cfg.data.generated.max_operand, cfg.data.generated.kind)
    return train_bpe(texts, cfg.tokenizer.train_vocab_size, out)


def resolve_model_config(cfg: RunConfig, tokenizer) -> ModelConfig:
    m = cfg.model
    switches = m.switches()
    if m.path is not None:
        p = resolve_model_path(m.path)
        if (p / "config.json").is_file():
            return hf_model_config(p, **switches)
        ckpt_dir, step = find_checkpoint(p)
        return ModelConfig.model_validate(read_meta(ckpt_dir, step)["model_config"]).model_copy(
            update=switches)
    if m.preset is not None:
        return ModelConfig.preset(m.preset, **switches)
    base = m.config or ModelConfig()
    # From scratch: size the embedding to the tokenizer (rounded up to 64 for matmul tiling).
    vocab = -(-len(tokenizer) // 64) * 64
    return base.model_copy(update=dict(vocab_size=vocab, **switches))


def save_hf_export(model: nnx.Module, out: Path, tokenizer) -> None:
    """Write RUN_DIR/hf: config.json + model.safetensors + tokenizer, loadable by transformers/vLLM."""
    from posttrain.models.export import save_hf

    save_hf(model, out)
    tokenizer.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=None).save_pretrained(out)


# ---- the loop --------------------------------------------------------------------------------
def train_language_model(cfg: RunConfig, run_dir: Path, loss_fn=next_token_loss) -> dict:
    from posttrain.tracking import Tracker

    tokenizer = prepare_tokenizer(cfg, run_dir)
    model_cfg = resolve_model_config(cfg, tokenizer)
    compile_cache.set_effort(cfg.train.compile_effort, model_cfg)
    t = cfg.train
    source = cfg.data.source
    if cfg.algorithm == "dpo" and source == "generated":  # pairs sampled from the starting model
        source = str(sampled_pairs(cfg, run_dir, tokenizer))
    train_rows = load_rows(source, "train", cfg.data)
    encoder = Encoder(tokenizer, cfg.data, source)
    data = PackedBatches(train_rows, encoder, t.batch_size, cfg.data.seq_len,
                         cfg.data.shuffle_seed, cfg.data.pack,
                         first_fit=cfg.data.packing == "first_fit")
    eval_batches = _eval_batches(cfg, tokenizer)
    trainer = make_trainer(cfg, run_dir, model_cfg, loss_fn)
    tracker = None
    dog = watchdog.for_run(cfg, run_dir)
    last: dict = {}
    try:
        reference = None
        if cfg.algorithm == "dpo" and cfg.dpo.reference_route(bool(cfg.model.lora.rank)) == "precompute":
            with dog.waiting("the reference log-probs of the data"):  # before any step or restore
                reference = reference_table(cfg, run_dir, trainer, train_rows, encoder)
                eval_batches = [{**b, **trainer.reference_logps(b)} for b in eval_batches]
        meta = trainer.restore()
        start = 0
        if meta is not None:
            data.restore(meta["data_state"])
            start = meta["step"]
        tracker = Tracker(cfg, run_dir, t.steps, start)
        # Metrics of step k are fetched after step k+1 is dispatched, so the host prepares
        # the next batch while the device computes (no sync per step).
        pending: tuple | None = None
        t_prev = time.perf_counter()

        def flush(p):
            nonlocal t_prev, last
            step_no, fetch, n_tok, extra = p
            with dog.waiting(f"the update of step {step_no}"):
                m = fetch()
            now = time.perf_counter()
            m.update(batch_tokens=n_tok, tokens_per_s=n_tok / max(now - t_prev, 1e-9), **extra)
            t_prev = now
            tracker.log(step_no, m)
            last = m

        feed = data.batches()
        for step in range(start, t.steps):
            with dog.waiting(f"the data batch of step {step + 1}"):
                batch, row_ids, data_state = next(feed)
            if reference is not None:
                batch = with_reference(batch, reference)
            tracker.log_rows(step + 1, row_ids)
            with dog.waiting(f"the update of step {step + 1}"):
                fetch = trainer.train_step(batch)
            faults.point("step")
            if pending is not None:
                flush(pending)
            extra = {}
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                with dog.waiting(f"evaluation at step {step + 1}"):
                    faults.point("eval")
                    extra["eval_loss"] = trainer.eval_loss(eval_batches)
            extra["skipped_rows"] = data_state["skipped"]
            pending = (step + 1, fetch, float((batch["segment_ids"] > 0).sum()), extra)
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 \
                    and step + 1 != t.steps:
                with dog.waiting(f"checkpoint {step + 1}"):
                    trainer.save(step + 1, data_state)
        if pending is not None:
            flush(pending)
        with dog.waiting(f"the final checkpoint ({t.steps})"):
            if trainer.latest_step() != t.steps:
                trainer.save(t.steps, data_state if t.steps > start else data.state())
            trainer.wait()
    finally:
        dog.close()
        if tracker is not None:
            tracker.close()
        trainer.close()
    if cfg.model.quantization == "none":
        # The HF export is the plain model: LoRA merged, an int8 base dequantized.
        from posttrain.models.loading import load_model_from_checkpoint

        save_hf_export(load_model_from_checkpoint(run_dir / "checkpoints"), run_dir / "hf",
                       tokenizer)
    return {k: float(v) for k, v in last.items() if np.ndim(v) == 0}


def reference_table(cfg: RunConfig, run_dir: Path, trainer, rows, encoder) -> dict[str, np.ndarray]:
    """DPO's reference log-probs of every training pair, by dataset row: one pass over the data
    in order with the starting weights (TRL's `precompute_ref_log_probs`), kept in
    RUN_DIR/reference_logps.npz and reused by a resumed run when the data and model match."""
    path = run_dir / "reference_logps.npz"
    key = repr((cfg.data.source, cfg.data.split, len(rows), cfg.data.seq_len, cfg.data.truncation,
                cfg.model.path, cfg.seed))
    if path.exists():
        saved = np.load(path)
        if str(saved["key"]) == key:
            return {"ref_chosen": saved["ref_chosen"], "ref_rejected": saved["ref_rejected"]}
    table = {k: np.full(len(rows), np.nan, np.float32) for k in ("ref_chosen", "ref_rejected")}
    it = PackedBatches(rows, encoder, cfg.train.batch_size, cfg.data.seq_len, seed=0,
                       pack=cfg.data.pack, shuffle=False)
    while it.epoch == 0:
        batch, _ = it.next_batch()
        got = trainer.reference_logps(batch)
        slots = batch["pair_rows"] >= 0
        for k in table:
            table[k][batch["pair_rows"][slots]] = got[k][slots]
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, key=key, **table)
    tmp.replace(path)
    return table


def with_reference(batch: dict, table: dict[str, np.ndarray]) -> dict:
    """The batch with its pairs' precomputed reference log-probs ([B, K], 0 in empty slots)."""
    rows = batch["pair_rows"]
    out = dict(batch)
    for k, values in table.items():
        got = np.where(rows >= 0, values[np.maximum(rows, 0)], 0.0).astype(np.float32)
        if np.isnan(got).any():  # a pair the precompute pass never scored: never train on it
            raise RuntimeError(f"no precomputed reference log-prob for dataset rows "
                               f"{sorted(set(rows[np.isnan(got)].tolist()))[:5]}")
        out[k] = got
    return out


def _eval_batches(cfg: RunConfig, tokenizer) -> list[dict]:
    src = cfg.data.eval_source or ("generated" if cfg.data.source == "generated" else None)
    if src is None or not cfg.train.eval_every or (src == "generated" and cfg.algorithm == "dpo"):
        return []
    rows = load_rows(src, "eval", cfg.data)
    it = PackedBatches(rows, Encoder(tokenizer, cfg.data, src), cfg.train.batch_size,
                       cfg.data.seq_len, seed=0, pack=cfg.data.pack, shuffle=False,
                       first_fit=cfg.data.packing == "first_fit")
    return [it.next_batch()[0] for _ in range(cfg.train.eval_batches)]
