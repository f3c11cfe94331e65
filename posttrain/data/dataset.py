"""Datasets -> token batches.

`load_rows` reads a source (`generated`, a .jsonl/.json/.parquet file, a directory written by
`datasets.save_to_disk`, or a hub dataset already in the local cache) with `datasets`.
`encode_row` turns one row into (token ids, loss mask) for the recipe's format, with errors that
name the file and row. `PackedBatches` walks a seeded permutation of the rows, packs them into
[B, L] batches, and exposes its position (`state()` / `restore()`) for exact resume.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config import DataSection
from posttrain.data import generated
from posttrain.data.packing import pack_rows
from posttrain.errors import UserError


# ---- where a row lives in its file -------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _jsonl_row_lines(path: str, mtime: float) -> tuple[int, ...]:
    """1-based line numbers of a JSON Lines file's rows (blank lines hold no row)."""
    with open(path, "rb") as f:
        return tuple(n for n, line in enumerate(f, 1) if line.strip())


def locate(source: str, idx: int) -> str:
    """`FILE: line N (row I)` for a JSON Lines file, whose users count lines from 1 and rows
    (what `datasets` indexes) skip blank lines; `SOURCE: row I` (from 0) for anything else."""
    p = Path(source)
    if p.suffix == ".jsonl" and p.is_file():
        lines = _jsonl_row_lines(str(p), p.stat().st_mtime)
        if 0 <= idx < len(lines):
            return f"{source}: line {lines[idx]} (row {idx})"
    return f"{source}: row {idx}"


def first_bad_json_line(path: Path) -> str | None:
    """Why a JSON Lines file does not parse, naming the first bad line; None if every line does."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return f"line {n}: invalid JSON: {getattr(e, 'msg', e)} (column {getattr(e, 'colno', '?')})"
            if not isinstance(value, dict):
                return f"line {n}: expected a JSON object per line, got {type(value).__name__}"
    return None


def load_rows(source: str, split: str, data: DataSection):
    """`split` is 'train' or 'eval'; a hub/saved source maps it to data.split / data.eval_split."""
    if source == "generated":
        g = data.generated
        n = g.num_train if split == "train" else g.num_eval
        return generated.rows_for(g, data.format, split, n)
    p = Path(source)
    split = data.split if split == "train" else data.eval_split
    if p.is_file() and _blank(p):  # `datasets` would fail with a bare StopIteration
        raise UserError(f"{source}: no rows")
    try:
        with _quiet_datasets():
            rows = _load(source, p, split)
    except UserError:
        raise
    except FileNotFoundError as e:
        raise UserError(f"{source}: {e}") from None
    except Exception as e:  # datasets raises many types for unreadable input
        why = first_bad_json_line(p) if p.suffix == ".jsonl" and p.is_file() else None
        if why:
            raise UserError(f"{source}: {why}") from None
        raise UserError(f"{source}: cannot load dataset: {type(e).__name__}: {e}") from None
    if len(rows) == 0:
        raise UserError(f"{source}: no rows" + ("" if p.is_file() else f" in split {split!r}"))
    return rows


def _blank(p: Path, limit: int = 1 << 20) -> bool:
    """A file with nothing but whitespace (an empty JSONL file, say); large files are not."""
    if p.stat().st_size > limit:
        return False
    return not p.read_bytes().strip()


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or logged parse errors from `datasets` while it reads local files: a
    failure is reported once, by us, naming the line."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _load(source: str, p: Path, split: str):
    import datasets

    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        return ds[split if split in ds else "train"] if isinstance(ds, datasets.DatasetDict) else ds
    if p.suffix in (".jsonl", ".json"):
        return datasets.load_dataset("json", data_files=str(p), split="train")
    if p.suffix == ".parquet":
        return datasets.load_dataset("parquet", data_files=str(p), split="train")
    if p.suffix:
        raise UserError(f"{source}: unsupported data file type {p.suffix} (jsonl, json, parquet)")
    return datasets.load_dataset(source, split=split)


@dataclass
class Encoder:
    """Row -> (ids, mask) under the recipe's format, truncation and loss policy."""

    tokenizer: Any
    data: DataSection
    source: str

    def bad(self, idx: int, why: str) -> UserError:
        return UserError(f"{locate(self.source, idx)}: {why}")

    def __call__(self, row: dict, idx: int) -> tuple[list[int], list[int]] | None:
        fmt = self.data.format
        eos = self.tokenizer.eos_token_id
        if fmt == "text":
            text = row.get("text")
            if not isinstance(text, str) or not text:
                raise self.bad(idx, "missing or empty 'text' field")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            mask = [1] * len(ids)
        elif fmt == "messages":
            ids, mask = self.encode_chat(row, idx)
        elif fmt == "preference":
            return self.encode_preference(row, idx)
        else:
            ids, mask = self.encode_prompt_completion(row, idx)
        return self.truncate(ids, mask)

    # ---- chat ------------------------------------------------------------------------------
    def check_messages(self, row: dict, idx: int) -> list[dict]:
        """The row's conversation, checked: roles in a valid order (system first if any, then
        user; an assistant turn after a user or tool message; `tool` messages after an assistant
        turn that calls tools), non-empty content (an assistant turn with `tool_calls` may have
        none), ending with an assistant turn."""
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise self.bad(idx, "missing or empty 'messages' field")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
                raise self.bad(idx, f"messages[{j}] needs 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise self.bad(idx, f"messages[{j}]: unknown role {m['role']!r}")
            calls = m["role"] == "assistant" and m.get("tool_calls")
            if not calls and (not isinstance(m.get("content"), str) or not m["content"].strip()):
                raise self.bad(idx, f"messages[{j}] ({m['role']}): empty content")
        turns = msgs[1:] if msgs[0]["role"] == "system" else msgs
        after = {"user": ("assistant",), "assistant": ("user", "tool"), "tool": ("assistant", "tool")}
        for j, m in enumerate(turns):
            prev = turns[j - 1] if j else None
            ok = m["role"] == "user" if prev is None else prev["role"] in after.get(m["role"], ())
            if ok and m["role"] == "tool" and prev["role"] == "assistant":
                ok = bool(prev.get("tool_calls")) or "<tool_call>" in (prev.get("content") or "")
            if not ok:
                want = "user" if prev is None else {"user": "assistant", "assistant": "user or tool",
                                                    "tool": "assistant or tool"}[prev["role"]]
                raise self.bad(idx, f"wrong role order: expected {want} at turn {j}, got {m['role']}"
                               + (" (a tool message answers an assistant turn that calls a tool)"
                                  if m["role"] == "tool" else ""))
        if turns[-1]["role"] != "assistant":
            raise self.bad(idx, "the conversation must end with an assistant message")
        return msgs

    def _render(self, msgs: list[dict], add_generation_prompt: bool, tools=None) -> str:
        return self.tokenizer.apply_chat_template(msgs, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _render_len(self, msgs: list[dict], add_generation_prompt: bool, tools=None) -> list[int]:
        return self.tokenizer(self._render(msgs, add_generation_prompt, tools),
                              add_special_tokens=False)["input_ids"]

    def _prefix_tokens(self, text: str, starts: list[int] | None, prefix: str) -> int:
        """How many of `text`'s tokens the rendered `prefix` covers: the tokens that start inside
        it, read off the offsets of one tokenization of the whole text. Tokenizing every prefix
        on its own (as templates that rewrite earlier turns still need: the fallback) was two
        thirds of a chat's encoding time."""
        if starts is not None and text.startswith(prefix):
            return bisect.bisect_left(starts, len(prefix))
        return len(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])

    def encode_chat(self, row: dict, idx: int) -> tuple[list[int], list[int]]:
        """Render with the tokenizer's chat template; mask the assistant turns' tokens.

        Turn boundaries come from rendering growing prefixes (template-agnostic: works for
        templates without {% generation %} markers, such as Qwen's). A `tools` column (JSON
        schemas, as in HF tool-calling datasets) is shown by the template; tool messages are
        context, never trained on."""
        msgs = self.check_messages(row, idx)
        tools = row.get("tools")
        text = self._render(msgs, False, tools)
        if getattr(self.tokenizer, "is_fast", False):  # offsets need a Rust (`tokenizers`) one
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
        else:
            ids, starts = self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        mask = [0] * len(ids)
        assistant = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
        if self.data.loss_on == "last_turn":
            assistant = assistant[-1:]
        for j in assistant:
            start = self._prefix_tokens(text, starts, self._render(msgs[:j], True, tools))
            end = min(self._prefix_tokens(text, starts, self._render(msgs[: j + 1], False, tools)),
                      len(ids))
            # the separator a template puts after the end-of-turn token is not the reply's
            while end > start and not self.tokenizer.decode(ids[end - 1:end]).strip():
                end -= 1
            for t in range(start, min(end, len(ids))):
                mask[t] = 1
        if self.data.loss_on == "all":
            mask = [1] * len(ids)
        return ids, mask

    def encode_prompt_completion(self, row: dict, idx: int) -> tuple[list[int], list[int]]:
        prompt, completion = row.get("prompt"), row.get("completion")
        if prompt is None or completion is None:
            raise self.bad(idx, "needs 'prompt' and 'completion' fields")
        if isinstance(prompt, list):  # conversational prompt
            p_ids = self._render_len(prompt, True)
        elif isinstance(prompt, str) and prompt:
            p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            raise self.bad(idx, "empty 'prompt'")
        if not isinstance(completion, str) or not completion.strip():
            raise self.bad(idx, "empty 'completion'")
        c_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"] + \
            [self.tokenizer.eos_token_id]
        mask = ([1] * len(p_ids) if self.data.loss_on == "all" else [0] * len(p_ids)) + [1] * len(c_ids)
        return p_ids + c_ids, mask

    # ---- preference pairs ------------------------------------------------------------------
    def encode_preference(self, row: dict, idx: int) -> list[tuple[list[int], list[int]]] | None:
        """A pair, [(prompt + chosen, mask), (prompt + rejected, mask)], masks on the completion
        tokens only. `prompt` is a string or a message list (TRL's conversational format; the
        chat template renders it once, ending with the assistant's header); `chosen` and
        `rejected` are strings (+ EOS) or the assistant message(s) that follow the prompt (what
        the template renders after it). Both sequences of a pair share one packed row, so each
        is held to seq_len // 2 tokens by `data.truncation` (right: the completion's end goes;
        left: the prompt's start; drop: the pair)."""
        prompt = row.get("prompt")
        if any(row.get(k) is None for k in ("prompt", "chosen", "rejected")):
            raise self.bad(idx, "needs 'prompt', 'chosen' and 'rejected' fields")
        msgs = None
        if isinstance(prompt, list):
            msgs = self.check_prompt_messages(prompt, idx)
            p_text = self._render(msgs, True)
        elif isinstance(prompt, str) and prompt.strip():
            p_text = prompt
        else:
            raise self.bad(idx, "empty 'prompt'")
        p_ids = self.tokenizer(p_text, add_special_tokens=False)["input_ids"]
        pair = []
        for key in ("chosen", "rejected"):
            c_ids = self.completion_ids(row[key], msgs, p_text, key, idx)
            seq = self.truncate_half(p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids))
            if seq is None:
                return None
            pair.append(seq)
        return pair

    def check_prompt_messages(self, msgs: list, idx: int) -> list[dict]:
        if not msgs or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and m.get("role") in ("system", "user", "assistant", "tool")
                               for m in msgs):
            raise self.bad(idx, "'prompt': a message list needs 'role' and 'content' in each message")
        if msgs[-1]["role"] == "assistant":
            raise self.bad(idx, "'prompt' ends with an assistant message (the completions are "
                           "'chosen' and 'rejected')")
        return msgs

    def completion_ids(self, comp, msgs: list[dict] | None, p_text: str, key: str,
                       idx: int) -> list[int]:
        eos = self.tokenizer.eos_token_id
        if isinstance(comp, str):
            if not comp.strip():
                raise self.bad(idx, f"empty '{key}'")
            return self.tokenizer(comp, add_special_tokens=False)["input_ids"] + [eos]
        if not (isinstance(comp, list) and comp and all(
                isinstance(m, dict) and m.get("role") == "assistant"
                and isinstance(m.get("content"), str) and m["content"].strip() for m in comp)):
            raise self.bad(idx, f"'{key}': a string, or assistant messages with content")
        if msgs is None:
            raise self.bad(idx, f"'{key}' is a message list but 'prompt' is a string (use "
                           "messages for both, or strings)")
        full = self._render(msgs + comp, False)
        if not full.startswith(p_text):
            raise self.bad(idx, f"the chat template renders the prompt differently once '{key}' "
                           "follows it; cannot tell the completion's tokens")
        ids = self.tokenizer(full[len(p_text):], add_special_tokens=False)["input_ids"]
        # the separator a template puts after the end-of-turn token is not the reply's
        while len(ids) > 1 and not self.tokenizer.decode(ids[-1:]).strip():
            ids = ids[:-1]
        return ids

    def truncate_half(self, ids: list[int], mask: list[int]):
        """One sequence of a pair to at most seq_len // 2 tokens; None drops the pair (also when
        nothing of the completion would remain)."""
        half = self.data.seq_len // 2
        if len(ids) > half:
            if self.data.truncation == "drop":
                return None
            cut = slice(-half, None) if self.data.truncation == "left" else slice(None, half)
            ids, mask = ids[cut], mask[cut]
        return (ids, mask) if any(mask) else None

    def truncate(self, ids: list[int], mask: list[int]):
        L = self.data.seq_len
        if len(ids) <= L:
            return ids, mask
        if self.data.truncation == "drop":
            return None
        if self.data.truncation == "left":
            return ids[-L:], mask[-L:]
        return ids[:L], mask[:L]


class PackedBatches:
    """Seeded, resumable iterator of packed batches over encoded rows."""

    def __init__(self, rows, encoder: Encoder, batch_size: int, seq_len: int, seed: int,
                 pack: bool = True, shuffle: bool = True, first_fit: bool = True):
        self.rows, self.encoder = rows, encoder
        self.first_fit = first_fit
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.pack, self.shuffle = pack, shuffle
        self.n = len(rows)
        if self.n == 0:
            raise UserError(f"{encoder.source}: dataset is empty")
        self.epoch, self.index = 0, 0
        self.skipped = 0
        self._order_epoch, self._order = -1, None
        self._cache: dict[int, tuple | None] = {}

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.n)
                           if self.shuffle else np.arange(self.n))
            self._order_epoch = epoch
        return self._order

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "skipped": self.skipped}

    def restore(self, st: dict) -> None:
        self.epoch, self.index, self.skipped = st["epoch"], st["index"], st.get("skipped", 0)

    def _walk(self):
        """Yield (epoch, index, row id) from the current position on, across epochs."""
        e, i = self.epoch, self.index
        while True:
            order = self._order_for(e)
            while i < self.n:
                yield e, i, int(order[i])
                i += 1
            e, i = e + 1, 0

    def next_batch(self) -> tuple[dict[str, np.ndarray], list[int]]:
        """A packed batch and the row ids it holds (in order)."""
        budget = self.batch_size * self.seq_len
        cands, ids, positions, tokens = [], [], [], 0
        for e, i, rid in self._walk():
            enc = self._encode(rid)
            positions.append((e, i))
            if enc is None:
                cands.append(None)
                continue
            cands.append(enc)
            tokens += sum(len(ids) for ids, _ in enc) if isinstance(enc, list) else len(enc[0])
            if tokens > budget + self.seq_len or len(cands) > 4 * budget:
                break
        real = [c for c in cands if c is not None]
        batch, used = pack_rows(real, self.batch_size, self.seq_len, self.pack, self.first_fit)
        # advance past `used` real examples (and the skipped ones among them)
        consumed_real, k = 0, 0
        while k < len(cands) and (consumed_real < used or cands[k] is None):
            if cands[k] is None:
                self.skipped += 1
            else:
                consumed_real += 1
                ids.append(self._row_id_at(positions[k]))
            k += 1
        e, i = positions[k] if k < len(positions) else positions[-1]
        self.epoch, self.index = e, i
        if "group_index" in batch:  # which dataset row each pair slot holds (-1: none)
            gi = batch.pop("group_index")
            batch["pair_rows"] = np.where(gi >= 0, np.asarray(ids + [-1], np.int32)[gi], -1)
        return batch, ids

    def batches(self, depth: int = 2):
        """Yield (batch, row ids, position after it) with `depth` batches prepared ahead in a
        background thread, so tokenization overlaps the device's step. The position travels with
        its batch, so a checkpoint stores exactly what was consumed."""
        import queue
        import threading

        q: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def work():
            try:
                while not stop.is_set():
                    batch, ids = self.next_batch()
                    q.put((batch, ids, self.state()))
            except BaseException as e:  # surface data errors (bad rows) in the consumer
                q.put(e)

        threading.Thread(target=work, daemon=True, name="posttrain-data").start()
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while not q.empty():
                q.get_nowait()

    def _row_id_at(self, pos: tuple[int, int]) -> int:
        return int(self._order_for(pos[0])[pos[1]])

    def _encode(self, rid: int):
        # Rows looked ahead but not packed come up again at the next batch: keep them encoded.
        if rid in self._cache:
            return self._cache[rid]
        enc = self._encode_uncached(rid)
        if len(self._cache) > 8192:
            self._cache.clear()
        self._cache[rid] = enc
        return enc

    def _encode_uncached(self, rid: int):
        row = self.rows[rid]
        try:
            return self.encoder(row, rid)
        except UserError:
            if self.encoder.data.skip_bad_rows:
                return None
            raise
