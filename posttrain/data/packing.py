"""Sequence packing: variable-length examples -> fixed [B, L] rows with segment ids.

Each example is (token ids, loss mask over those ids). Rows hold whole examples back to back;
`segment_ids` number them 1, 2, ... (0 = padding), `positions` restart at 0 per segment, and the
target of the last token of a segment is masked, so neither attention (see
`posttrain.models.layers.attention_mask`) nor loss crosses a segment boundary.
"""

from __future__ import annotations

import numpy as np


def pack_rows(examples: list, rows: int, seq_len: int,
              pack: bool = True, first_fit: bool = True) -> tuple[dict[str, np.ndarray], int]:
    """Fill `rows` rows from the front of `examples`. First fit: each example goes to the first
    row with room for it; next fit (`first_fit=False`): to the current row, or the next one when
    it does not fit there; without `pack`, one example per row.

    An example is `(ids, mask)`, or a list of them that must share a row (a preference pair:
    chosen, then rejected), each its own segment; a batch of such groups also holds
    `group_index` [rows, seq_len // 2]: which example is the row's k-th group (-1: none).

    Returns the batch and how many examples it consumed: the packing stops at the first example
    that fits in no row, which starts the next batch, so what a batch consumed is always a prefix
    of the data order and the data position stays exact. Next fit (close a row at the first
    example that overflows it) left 16% of the quickstart's pretraining rows empty; first fit
    leaves 5% (grain's `FirstFitPackIterDataset` packs the same way, without the prefix rule).
    Examples must already be truncated to `seq_len` tokens.
    """
    tokens = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    lmask = np.zeros((rows, seq_len), np.float32)
    col = np.zeros((rows,), np.int64)  # next free column of each row
    nseg = np.zeros((rows,), np.int32)
    groups = any(isinstance(ex, list) for ex in examples)
    group_index = np.full((rows, seq_len // 2), -1, np.int32)
    ngroups = np.zeros((rows,), np.int32)
    used = 0
    for ex in examples:
        segments = ex if isinstance(ex, list) else [ex]
        n = sum(len(ids) for ids, _ in segments)
        if n > seq_len:
            raise ValueError(f"example of {n} tokens exceeds seq_len {seq_len}; truncate first")
        if pack:
            fits = np.flatnonzero(col + n <= seq_len)
            if not first_fit:  # only the row being filled, else the first empty one
                fits = fits[fits >= max(int(np.count_nonzero(col)) - 1, 0)]
            if not len(fits):
                break
            r = int(fits[0])
        elif used < rows:
            r = used
        else:
            break
        for ids, mask in segments:
            c, m = int(col[r]), len(ids)
            nseg[r] += 1
            tokens[r, c:c + m] = ids
            seg[r, c:c + m] = nseg[r]
            pos[r, c:c + m] = np.arange(m)
            lmask[r, c:c + m] = mask
            col[r] += m
        if groups:
            group_index[r, ngroups[r]] = used
            ngroups[r] += 1
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
    if groups:
        batch["group_index"] = group_index
    return batch, used


# ---- shape buckets -----------------------------------------------------------------------------
def ladder(unit: int = 32, dense: int = 4):
    """unit, 2 unit, ..., `dense` unit (a power of two), then steps of 1.5x and 4/3x: 6, 8, 12,
    16, 24, ... units (every power of two and its 1.5x)."""
    m = 1
    while True:
        yield m * unit
        m = m + 1 if m < dense else (m * 3 // 2 if m & (m - 1) == 0 else m * 4 // 3)


def bucket_up(n: int, unit: int = 32, dense: int = 4) -> int:
    """The smallest `ladder` size >= n. Every jitted shape a run sees (the engine's prompt
    length, the update's row length and packed row count, the shared prefix) is a point of the
    ladder, so a run compiles at most `dense + 2 log2(max / (dense unit))` sizes per axis (14 up
    to 4096 tokens in units of 32, where multiples of 32 are 128); past `dense` units at most
    a third of a padded row is padding: on a TPU a shape not seen yet costs a compile (50-80 s
    measured for the quickstart's update), far more than its padding."""
    return next(x for x in ladder(unit, dense) if x >= n)


def bucket_down(n: int, unit: int = 32, dense: int = 4) -> int:
    """The largest `ladder` size <= n; 0 below `unit`."""
    best = 0
    for x in ladder(unit, dense):
        if x > n:
            return best
        best = x


def packed_rows(lengths: list[int], row_len: int, row_unit: int) -> list[list[int]]:
    """The sequences (by index) of each row of `row_len` tokens, packed first-fit decreasing;
    the row count rounded up on the `bucket_up` ladder of about B / 8 rows (few shapes compile),
    a multiple of `row_unit` (the rows every micro-batch's shard must divide into)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            r = len(rows)
            rows.append([])
            free.append(row_len)
        rows[r].append(i)
        free[r] -= lengths[i]
    unit = row_unit * max(1, len(lengths) // (8 * row_unit))
    return rows + [[] for _ in range(bucket_up(len(rows), unit) - len(rows))]
