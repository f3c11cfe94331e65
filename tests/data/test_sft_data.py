"""SFT data: chat loss masks on a hand-built example, prompt/completion, bad rows, sources."""

import json
from pathlib import Path

import pytest

from posttrain.config import DataSection
from posttrain.data import generated
from posttrain.data.dataset import Encoder, PackedBatches, load_rows
from posttrain.data.tokenizer import train_bpe
from posttrain.errors import UserError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe(generated.corpus_for_tokenizer(99), 512, tmp_path_factory.mktemp("tok"))


def decode_masked(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "content": "The answer is 5."},
                     {"role": "user", "content": "What is 4 - 1?"},
                     {"role": "assistant", "content": "The answer is 3."}]}


def test_assistant_mask_covers_exactly_the_replies(tok):
    enc = Encoder(tok, DataSection(format="messages"), "mem")
    ids, mask = enc(CHAT, 0)
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert decode_masked(tok, ids, mask) == "The answer is 5.<|im_end|>The answer is 3.<|im_end|>"
    last = Encoder(tok, DataSection(format="messages", loss_on="last_turn"), "mem")
    assert decode_masked(tok, *last(CHAT, 0)) == "The answer is 3.<|im_end|>"
    every = Encoder(tok, DataSection(format="messages", loss_on="all"), "mem")
    assert all(every(CHAT, 0)[1])


def test_tool_chats_show_the_tools_and_train_on_the_model_turns_only(tok):
    """An SFT chat that calls a tool (HF's `tool_calls` / `tools` columns): the template shows
    the schema and writes the call in the hermes syntax the rollout parser reads; the loss
    covers the call and the answer, never the tool's result or the schema."""
    from posttrain.tools import format_hermes, parse_hermes

    row = generated.tool_chat(generated.Problem(37, 48, "*"), "call")
    data = DataSection(format="messages", seq_len=1024)  # this tokenizer has not seen the schema
    ids, mask = Encoder(tok, data, "mem")(row, 0)
    text = tok.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    call = format_hermes("calculator", {"expression": "37 * 48"})
    assert decode_masked(tok, ids, mask) == call + "<|im_end|>The answer is 1776.<|im_end|>"
    assert [c.arguments for c in parse_hermes(text)] == [{"expression": "37 * 48"}]
    assert "<|im_start|>tool\n1776<|im_end|>" in text
    plain = generated.tool_chat(generated.Problem(37, 48, "*"), "plain")
    assert "<tools>" not in tok.decode(Encoder(tok, data, "mem")(plain, 0)[0])


def test_prompt_completion_mask(tok):
    enc = Encoder(tok, DataSection(format="prompt_completion"), "mem")
    ids, mask = enc({"prompt": "What is 2 + 3?", "completion": " The answer is 5."}, 0)
    assert decode_masked(tok, ids, mask) == " The answer is 5.<|im_end|>"


@pytest.mark.parametrize("row,why", [
    ({"text": "x"}, "missing or empty 'messages'"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "wrong role order"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
     "empty content"),
    ({"messages": [{"role": "user", "content": "q"}]}, "must end with an assistant"),
    ({"messages": [{"role": "robot", "content": "q"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "tool", "content": "1"}, {"role": "assistant", "content": "b"}]},
     "a tool message answers an assistant turn that calls a tool"),
])
def test_bad_rows_name_file_and_row(tok, tmp_path, row, why):
    path = tmp_path / "train.jsonl"
    good = {"messages": CHAT["messages"][1:3]}
    path.write_text("\n".join(json.dumps(r) for r in [good, good, row]) + "\n")
    data = DataSection(source=str(path), format="messages", seq_len=64)
    rows = load_rows(str(path), "train", data)
    it = PackedBatches(rows, Encoder(tok, data, str(path)), 2, 64, seed=0, shuffle=False)
    with pytest.raises(UserError, match=rf"{path}: line 3 \(row 2\): .*{why}"):
        it.next_batch()
    skip = DataSection(source=str(path), format="messages", seq_len=64, skip_bad_rows=True)
    it = PackedBatches(rows, Encoder(tok, skip, str(path)), 2, 64, seed=0, shuffle=False)
    _, used = it.next_batch()  # the walk wraps epochs: the bad row may come up more than once
    assert 2 not in used and it.skipped >= 1


def test_sources_jsonl_parquet_and_saved_dir(tok, tmp_path):
    import datasets

    rows = generated.chat_rows("train", 6, 9, 0)
    ds = datasets.Dataset.from_list(rows)
    ds.to_json(tmp_path / "d.jsonl")
    ds.to_parquet(tmp_path / "d.parquet")
    ds.save_to_disk(tmp_path / "saved")
    data = DataSection(format="messages")
    for src in ("d.jsonl", "d.parquet", "saved"):
        loaded = load_rows(str(tmp_path / src), "train", data)
        assert len(loaded) == 6 and loaded[0]["messages"] == rows[0]["messages"]


def test_iterator_position_restores_exactly(tok):
    data = DataSection(format="messages", seq_len=64)
    rows = generated.chat_rows("train", 50, 9, 0)
    a = PackedBatches(rows, Encoder(tok, data, "g"), 4, 64, seed=3)
    seen = [a.next_batch()[1] for _ in range(6)]  # crosses an epoch boundary
    b = PackedBatches(rows, Encoder(tok, data, "g"), 4, 64, seed=3)
    for _ in range(3):
        b.next_batch()
    c = PackedBatches(rows, Encoder(tok, data, "g"), 4, 64, seed=3)
    c.restore(b.state())
    assert [c.next_batch()[1] for _ in range(3)] == seen[3:]


BAD_FILES = {  # file text, fragments of the one-line error
    "malformed_json_line": ('{"text": "a"}\n\n{"text": "b"}\n{"text": "c",\n{"text": "d"}\n',
                            ["train.jsonl: line 4: invalid JSON"]),
    # a blank line before it: line 4 of the file is row 2 of the dataset
    "bad_row_after_a_blank_line": ('{"text": "a"}\n\n{"text": "b"}\n{"text": ""}\n',
                                   ["train.jsonl: line 4 (row 2): missing or empty 'text'"]),
    "empty_file": ("\n", ["train.jsonl: no rows"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_data_file_exits_2_naming_file_and_line(tmp_path, case):
    """Through the CLI as a user meets it: exit 2, one line, no traceback."""
    import subprocess
    import sys

    from posttrain.data.tokenizer import train_bpe

    text, fragments = BAD_FILES[case]
    (tmp_path / "train.jsonl").write_text(text)
    train_bpe(generated.corpus_for_tokenizer(9), 300, tmp_path / "tok")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", "recipes/pretrain_tiny.yaml",
                        f"run_dir={tmp_path / 'run'}", "--set", f"data.source={tmp_path / 'train.jsonl'}",
                        f"tokenizer.path={tmp_path / 'tok'}", "train.steps=2", "train.batch_size=2",
                        "tracking.wandb.mode=disabled"],
                       capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()  # the progress bar's line may precede the message
    assert "Traceback" not in r.stderr and lines[-1].startswith("posttrain: error:"), r.stderr
    assert sum("error" in line for line in lines) == 1, r.stderr
    assert all(f in lines[-1] for f in fragments), r.stderr


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"train.jsonl: line 2: expected a JSON object"):
        load_rows(str(tmp_path / "train.jsonl"), "train", DataSection(format="text"))


def test_resume_at_an_epoch_boundary_starts_the_next_epoch(tok):
    """A checkpoint taken exactly at the end of an epoch resumes into the next one (a peer's
    resume there ran zero steps): the same batches as the iterator that never stopped."""
    rows = generated.rows("text", "train", 8, 9, 0, 0.1, False)
    data = DataSection(format="text", seq_len=32)
    def it():
        return PackedBatches(rows, Encoder(tok, data, "g"), 4, 32, seed=1, pack=False)
    a = it()
    first = [a.next_batch()[1] for _ in range(2)]  # two batches of 4: the whole epoch
    st = a.state()
    b = it()
    b.restore(st)
    assert sorted(sum(first, [])) == list(range(8))
    assert [b.next_batch()[1] for _ in range(2)] == [a.next_batch()[1] for _ in range(2)]
    assert b.state()["epoch"] >= 1


def per_prefix_masks(tok, msgs, tools=None):
    """The reference: every turn boundary from tokenizing its rendered prefix on its own."""
    def n_tokens(m, gen):
        text = tok.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=gen)
        return tok(text, add_special_tokens=False)["input_ids"]

    ids = n_tokens(msgs, False)
    mask = [0] * len(ids)
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            start, end = len(n_tokens(msgs[:j], True)), len(n_tokens(msgs[:j + 1], False))
            while end > start and not tok.decode(ids[end - 1:end]).strip():
                end -= 1
            mask[start:end] = [1] * (end - start)
    return ids, mask


def test_turn_boundaries_from_one_tokenization_match_tokenizing_each_prefix(tok):
    """The encoder reads turn boundaries off the offsets of one tokenization; a template that
    rewrites earlier text (here: a header counting the messages) falls back to tokenizing each
    prefix. Both give the reference's ids and mask on single-turn, multi-turn and tool chats."""
    import copy

    rows = [CHAT] + generated.chat_rows("train", 20, 5, 0) + [
        generated.tool_chat(generated.Problem(3, 4, "+"), "call")]
    rewriting = copy.copy(tok)
    rewriting.chat_template = "{{ messages | length }}\n" + tok.chat_template
    for t in (tok, rewriting):
        enc = Encoder(t, DataSection(format="messages", seq_len=1024), "mem")
        for i, row in enumerate(rows):
            assert enc(row, i) == per_prefix_masks(t, row["messages"], row.get("tools")), (i, t)
    assert rewriting.apply_chat_template(CHAT["messages"][:1], tokenize=False).startswith("1\n")
