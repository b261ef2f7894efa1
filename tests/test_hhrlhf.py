"""Preference datasets: HH-RLHF's released format from local files, synthetic arith pairs."""

from __future__ import annotations

import gzip
import json

import pytest

from areal.api.cli_args import DatasetConfig
from areal.dataset import get_custom_dataset
from areal.dataset.synthetic import ArithSpec, generate_arith_preference_pairs

ROWS = [
    {
        "chosen": "\n\nHuman: What is 2+2?\n\nAssistant: It is 4.",
        "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: It is 5.",
    },
    {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello! How can I help?",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Go away.",
    },
]


@pytest.fixture(scope="module")
def tok():
    from areal.models.tiny import get_tiny_base_path
    from areal.utils.hf_utils import load_hf_tokenizer

    return load_hf_tokenizer(get_tiny_base_path())


def _cfg(path, type, max_length=None):
    return DatasetConfig(path=path, type=type, max_length=max_length, dataset_kwargs={})


def _write(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def test_hhrlhf_dpo_rows_mask_only_the_differing_responses(tmp_path, tok):
    _write(tmp_path / "train.jsonl.gz", ROWS, gz=True)
    ds = get_custom_dataset("train", _cfg(str(tmp_path), "dpo"), tok)
    assert len(ds) == 2
    r = ds[0]
    assert tok.decode(r["chosen_ids"]).startswith("\n\nHuman: What is 2+2?")
    assert r["chosen_ids"][-1] == tok.eos_token_id
    n_prompt = r["chosen_loss_mask"].index(1)
    assert r["chosen_ids"][:n_prompt] == r["rejected_ids"][:n_prompt]
    assert r["chosen_ids"][n_prompt] != r["rejected_ids"][n_prompt]
    assert sum(r["rejected_loss_mask"]) == len(r["rejected_ids"]) - n_prompt


def test_hhrlhf_rw_rows_have_ids_without_masks(tmp_path, tok):
    _write(tmp_path / "pairs.jsonl", ROWS)
    ds = get_custom_dataset("train", _cfg(str(tmp_path / "pairs.jsonl"), "rw"), tok)
    assert set(ds.column_names) == {"chosen_ids", "rejected_ids"}


def test_hhrlhf_bad_rows_skipped_and_too_many_raise(tmp_path, tok):
    good = ROWS * 10
    _write(tmp_path / "a.jsonl", good + ["{not json", {"chosen": "x"}])
    ds = get_custom_dataset("train", _cfg(str(tmp_path / "a.jsonl"), "rw"), tok)
    assert len(ds) == 20
    _write(tmp_path / "b.jsonl", ROWS + ["{not json"] * 2 + [{"chosen": "a", "rejected": "a"}])
    with pytest.raises(ValueError, match="max_bad_fraction"):
        get_custom_dataset("train", _cfg(str(tmp_path / "b.jsonl"), "rw"), tok)


def test_hhrlhf_max_length_drops_long_pairs(tmp_path, tok):
    _write(tmp_path / "train.jsonl", ROWS)

    def longest(row):
        return max(len(tok(row[k], add_special_tokens=False)["input_ids"]) + 1 for k in row)

    cap = min(longest(ROWS[0]), longest(ROWS[1]))
    assert max(longest(ROWS[0]), longest(ROWS[1])) > cap
    ds = get_custom_dataset("train", _cfg(str(tmp_path), "dpo", max_length=cap), tok)
    assert len(ds) == 1


def test_hhrlhf_missing_path_raises_file_not_found(tmp_path, tok):
    with pytest.raises(FileNotFoundError):
        get_custom_dataset("train", _cfg(str(tmp_path / "nope"), "rw"), tok)


def test_arith_pref_rejected_is_off_by_one_in_last_line_and_answer():
    for p in generate_arith_preference_pairs(ArithSpec(n=50, seed=2)):
        c, r = p["chosen"].split("\n"), p["rejected"].split("\n")
        assert c[:-2] == r[:-2]
        assert int(r[-1].split()[-1]) == int(c[-1].split()[-1]) + 1
        assert int(r[-2].split()[-1]) == int(c[-2].split()[-1]) + 1


def test_arith_pref_dataset_chat_prompt_and_type_checks(tok):
    ds = get_custom_dataset("test", _cfg("synthetic://arith_pref?n=8&seed=1", "dpo"), tok)
    assert len(ds) == 8
    text = tok.decode(ds[0]["chosen_ids"])
    assert "<|im_start|>assistant" in text and text.rstrip().endswith("<|im_end|>")
    with pytest.raises(ValueError, match="rw' or 'dpo"):
        get_custom_dataset("train", _cfg("synthetic://arith_pref?n=8", "rl"), tok)
    with pytest.raises(ValueError, match="arith_pref"):
        get_custom_dataset("train", _cfg("synthetic://arith?n=8", "rw"), tok)
