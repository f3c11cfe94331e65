"""SFT data: chat loss masks on a hand-built example, prompt/completion, bad rows, sources."""

import json

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
])
def test_bad_rows_name_file_and_row(tok, tmp_path, row, why):
    path = tmp_path / "train.jsonl"
    good = {"messages": CHAT["messages"][1:3]}
    path.write_text("\n".join(json.dumps(r) for r in [good, good, row]) + "\n")
    data = DataSection(source=str(path), format="messages", seq_len=64)
    rows = load_rows(str(path), "train", data)
    it = PackedBatches(rows, Encoder(tok, data, str(path)), 2, 64, seed=0, shuffle=False)
    with pytest.raises(UserError, match=rf"{path}: row 2: .*{why}"):
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
