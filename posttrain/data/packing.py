"""Sequence packing: variable-length examples -> fixed [B, L] rows with segment ids.

Each example is (token ids, loss mask over those ids). Rows hold whole examples back to back;
`segment_ids` number them 1, 2, ... (0 = padding), `positions` restart at 0 per segment, and the
target of the last token of a segment is masked, so neither attention (see
`posttrain.models.layers.attention_mask`) nor loss crosses a segment boundary.
"""

from __future__ import annotations

import numpy as np


def pack_rows(examples: list[tuple[list[int], list[int]]], rows: int, seq_len: int,
              pack: bool = True) -> tuple[dict[str, np.ndarray], int]:
    """Greedily fill `rows` rows from the front of `examples`.

    Returns the batch and how many examples it consumed; an example that does not fit in the space
    left is not consumed (it starts the next batch), so the data position stays exact. Examples
    must already be truncated to `seq_len` tokens.
    """
    tokens = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    lmask = np.zeros((rows, seq_len), np.float32)
    used, r, col, nseg = 0, 0, 0, 0
    for ids, mask in examples:
        n = len(ids)
        if n > seq_len:
            raise ValueError(f"example of {n} tokens exceeds seq_len {seq_len}; truncate first")
        if col + n > seq_len or (not pack and col > 0):
            r, col, nseg = r + 1, 0, 0
            if r == rows:
                break
        nseg += 1
        tokens[r, col:col + n] = ids
        seg[r, col:col + n] = nseg
        pos[r, col:col + n] = np.arange(n)
        lmask[r, col:col + n] = mask
        col += n
        used += 1
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    same_next = np.zeros_like(seg, dtype=bool)
    same_next[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
    # The loss mask marks tokens to be *predicted*: shift it onto the position that predicts them.
    pred_mask = np.zeros_like(lmask)
    pred_mask[:, :-1] = lmask[:, 1:]
    loss_mask = pred_mask * same_next
    batch = {"tokens": tokens, "targets": targets, "positions": pos, "segment_ids": seg,
             "loss_mask": loss_mask.astype(np.float32)}
    return batch, used
