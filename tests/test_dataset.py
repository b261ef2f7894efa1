"""Tests of the dataset loaders, the synthetic generator and the resumable dataloader."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from areal.api.cli_args import DatasetConfig
from areal.dataset import get_custom_dataset
from areal.dataset.synthetic import ArithSpec, generate_arith_problems, parse_synthetic_path
from areal.reward.gsm8k import gsm8k_reward_fn
from areal.utils.dataloader import create_dataloader

# The GSM8K test split is vendored in the repository (MIT licence, tests/data/gsm8k).
GSM8K_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"


def cfg(path, type="rl", max_length=None, batch_size=4, shuffle=True, drop_last=True):
    return DatasetConfig(
        path=str(path),
        type=type,
        max_length=max_length,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=0,
    )


class CharTokenizer:
    """Minimal tokenizer: one id per character; no chat template."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 + 1 for c in text]}


# --------------------------------------------------------------------- synthetic
_STEP_RE = {
    "add": re.compile(r"(?:buys|finds|gets) (\d+) more"),
    "sub": re.compile(r"(?:gives away|loses|sells) (\d+) "),
    "mul": re.compile(r"makes the number of \w+ (\d+) times"),
}


def recompute(question: str) -> int:
    """True result recomputed from the question text alone."""
    value = int(re.match(r"\w+ has (\d+) ", question).group(1))
    events = []
    for op, rx in _STEP_RE.items():
        events += [(m.start(), op, int(m.group(1))) for m in rx.finditer(question)]
    for _, op, b in sorted(events):
        value = value + b if op == "add" else value - b if op == "sub" else value * b
    return value


@pytest.mark.parametrize(
    "spec",
    [
        ArithSpec(digits=1, steps=2, n=300, seed=0),
        ArithSpec(digits=2, steps=4, ops=("add", "sub", "mul"), n=300, seed=7),
        ArithSpec(digits=3, steps=1, ops=("sub",), n=100, seed=1),
    ],
)
def test_synthetic_generator_same_seed_same_rows_and_answers_correct(spec):
    rows = generate_arith_problems(spec, "train")
    assert rows == generate_arith_problems(spec, "train")
    assert rows != generate_arith_problems(spec, "test")
    assert len(rows) == spec.n
    lo, hi = (1 if spec.digits == 1 else 10 ** (spec.digits - 1)), 10**spec.digits - 1
    for r in rows:
        truth = recompute(r["question"])
        assert r["result"] == truth >= 0
        lines = r["answer"].split("\n")
        assert len(lines) == spec.steps + 1 and lines[-1] == f"#### {truth}"
        for line in lines[:-1]:  # every reasoning line is correct arithmetic
            a, op, b, c = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", line).groups()
            assert lo <= int(b) <= hi
            assert int(c) == eval(f"{a}{op}{b}")  # noqa: S307 - digits and one operator
        assert gsm8k_reward_fn(r["question"], r["answer"], [], [], r["answer"]) == 1.0
    other_seed = generate_arith_problems(
        ArithSpec(**{**spec.__dict__, "seed": spec.seed + 1}), "train"
    )
    assert rows != other_seed


def test_synthetic_path_parse_roundtrip_and_bad_params_raise():
    spec = parse_synthetic_path("synthetic://arith?digits=2&steps=3&ops=add,mul&n=10&seed=5")
    assert spec == ArithSpec(digits=2, steps=3, ops=("add", "mul"), n=10, seed=5)
    assert parse_synthetic_path(spec.to_path()) == spec
    with pytest.raises(ValueError, match="unknown synthetic parameter"):
        parse_synthetic_path("synthetic://arith?digit=2")
    with pytest.raises(ValueError, match="ops"):
        parse_synthetic_path("synthetic://arith?ops=div")
    with pytest.raises(ValueError, match="integer"):
        parse_synthetic_path("synthetic://arith?n=many")
    with pytest.raises(ValueError, match="only 'arith'"):
        parse_synthetic_path("synthetic://geometry?n=3")


def test_get_custom_dataset_synthetic_rl_rows_have_messages_and_answer():
    ds = get_custom_dataset("train", cfg("synthetic://arith?digits=1&steps=2&n=50&seed=3"), None)
    assert len(ds) == 50
    row = ds[0]
    assert row["messages"][0]["role"] == "user"
    assert row["messages"][0]["content"].endswith("have now?")
    assert row["answer"].split("\n")[-1].startswith("#### ")
    test = get_custom_dataset("test", cfg("synthetic://arith?n=50&seed=3"), None)
    assert test[0]["messages"] != row["messages"]


# --------------------------------------------------------------------- gsm8k
def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _good(i: int) -> dict:
    return {"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}


def test_gsm8k_loader_skips_bad_rows_counts_them(tmp_path, caplog):
    rows = [_good(i) for i in range(30)]
    rows[3] = {"question": "no answer here"}
    rows[7] = "{not json"
    rows[11] = {"question": "q", "answer": "reasoning without a final line"}
    f = _write_jsonl(tmp_path / "train.jsonl", rows)
    logging.getLogger("areal").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="areal"):
            ds = get_custom_dataset("train", cfg(tmp_path), None)
    finally:
        logging.getLogger("areal").propagate = False
    assert len(ds) == 27
    assert "skipped 3 of 30 rows" in caplog.text
    assert {r["answer"] for r in ds} == {
        _good(i)["answer"] for i in range(30) if i not in (3, 7, 11)
    }
    # a file path works as well as a directory
    assert len(get_custom_dataset("train", cfg(f), None)) == 27


def test_gsm8k_loader_too_many_bad_rows_raises(tmp_path):
    rows = [_good(i) for i in range(10)] + [{"question": "x", "answer": ""}] * 2
    _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"2 of 12 rows are bad"):
        get_custom_dataset("train", cfg(tmp_path), None)
    assert len(get_custom_dataset("train", cfg(tmp_path), None, max_bad_fraction=0.2)) == 10


def test_gsm8k_loader_missing_split_or_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no 'valid' split"):
        get_custom_dataset("valid", cfg(tmp_path), None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_custom_dataset("train", cfg(tmp_path / "nope.jsonl"), None)
    with pytest.raises(ValueError, match="type"):
        get_custom_dataset("train", cfg(tmp_path, type="kto"), None)


def test_gsm8k_loader_max_length_filters_long_prompts(tmp_path):
    rows = [_good(i) for i in range(5)] + [{"question": "long " * 50, "answer": "#### 1"}]
    _write_jsonl(tmp_path / "test.jsonl", rows)
    ds = get_custom_dataset("test", cfg(tmp_path, max_length=80), CharTokenizer(), prompt_suffix="")
    assert len(ds) == 5
    sft = get_custom_dataset("test", cfg(tmp_path, type="sft", max_length=80), CharTokenizer())
    assert len(sft) == 5
    r = sft[0]
    assert len(r["input_ids"]) == len(r["loss_mask"])
    assert r["input_ids"][-1] == CharTokenizer.eos_token_id
    assert sum(r["loss_mask"]) == len(_good(0)["answer"]) + 1


def test_gsm8k_loader_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([_good(i) for i in range(6)]),
        tmp_path / "train-00000-of-00001.parquet",
    )
    ds = get_custom_dataset("train", cfg(tmp_path), None)
    assert len(ds) == 6 and ds[2]["answer"].endswith("#### 3")


def test_gsm8k_real_test_split_loads_all_rows():
    ds = get_custom_dataset("test", cfg(GSM8K_DIR), None)
    assert len(ds) == 1319
    assert ds[0]["messages"][0]["content"].startswith("Janet")
    assert ds[0]["answer"].endswith("#### 18")


# --------------------------------------------------------------------- dataloader
def _ids(batches):
    return [[r["i"] for r in b] for b in batches]


def test_dataloader_resume_mid_epoch_yields_exactly_remaining():
    data = [{"i": i} for i in range(23)]
    c = cfg("x", batch_size=4)
    ref = create_dataloader(data, c, seed=5)
    epoch0, epoch1 = _ids(ref), _ids(ref)
    assert epoch0 != epoch1  # the epoch advances by itself
    assert len(epoch0) == 5 and all(len(b) == 4 for b in epoch0)
    assert len({i for b in epoch0 for i in b}) == 20

    dl = create_dataloader(data, c, seed=5)
    it = iter(dl)
    seen = _ids([next(it), next(it)])
    state = dl.state_dict()
    resumed = create_dataloader(data, c, seed=5)
    resumed.load_state_dict(state)
    rest = _ids(resumed)
    assert seen + rest == epoch0
    assert _ids(resumed) == epoch1


def test_dataloader_shards_disjoint_and_collates_lists():
    data = [{"i": i} for i in range(20)]
    c = cfg("x", batch_size=5, shuffle=False)
    r0 = _ids(create_dataloader(data, c, rank=0, world_size=2))
    r1 = _ids(create_dataloader(data, c, rank=1, world_size=2))
    flat0, flat1 = sum(r0, []), sum(r1, [])
    assert not set(flat0) & set(flat1) and len(flat0) == len(flat1) == 10
    batch = next(iter(create_dataloader(data, c)))
    assert isinstance(batch, list) and batch[0] == {"i": 0}
    with pytest.raises(ValueError, match="fewer than batch_size"):
        create_dataloader(data[:3], cfg("x", batch_size=4))
    with pytest.raises(ValueError, match="rank"):
        create_dataloader(data, c, rank=2, world_size=2)
