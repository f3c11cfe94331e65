"""Supervised fine-tuning (and pretraining): next-token cross-entropy on the masked tokens.

    L = - sum_{b,t} m_bt log p_theta(x_{b,t+1} | x_{b,<=t}) / sum_{b,t} m_bt

m is the loss mask: assistant tokens (default), the last assistant turn, or all tokens
(`data.loss_on`); pretraining uses all tokens of plain text. Rows are packed, and the mask of the
last token of every segment is 0, so no loss crosses a sequence boundary. The division is by the
token count of the whole batch (not per micro-batch), so gradient accumulation is exact.

Full fine-tuning trains every parameter; with `model.lora.rank > 0`, qwix adds LoRA adapters to
the modules matching `model.lora.target_modules` and only those train (the base is frozen, and
stored int8 with `model.lora.int8_base: true`, QLoRA-style).

    posttrain run recipes/sft_tiny.yaml
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config import RunConfig
from posttrain.train.loop import train_language_model
from posttrain.train.step import next_token_loss


def run(cfg: RunConfig, run_dir: Path) -> dict:
    return train_language_model(cfg, run_dir, loss_fn=next_token_loss)
