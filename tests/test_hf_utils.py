"""Hub ids resolve through a locally built Hugging Face cache (never the network).

The cache is laid out as ``huggingface_hub`` writes it: ``{HF_HOME}/hub/models--org--name/
refs/main`` (a commit hash) and ``snapshots/<hash>/...``; datasets under
``datasets--org--name``. Every test runs with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os

import pytest

from areal.api.cli_args import DatasetConfig

TINY_BASE = os.path.join(os.path.dirname(__file__), "..", "areal", "models", "assets", "tiny-base")
REV = "0123456789abcdef0123456789abcdef01234567"
MODEL_ID = "tiny-org/Tiny-LM-Instruct"
DATASET_ID = "openai/gsm8k"
ROWS = {
    "train": [
        {
            "question": f"Tom has {i} apples and buys 2 more. How many?",
            "answer": f"{i}+2={i + 2}\n#### {i + 2}",
        }
        for i in range(6)
    ],
    "test": [{"question": "What is 3 plus 4?", "answer": "3+4=7\n#### 7"}],
}


def _snapshot_dir(hub: str, kind: str, repo_id: str) -> str:
    folder = os.path.join(hub, f"{kind}s--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(REV)
    snap = os.path.join(folder, "snapshots", REV)
    os.makedirs(snap, exist_ok=True)
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An HF_HOME whose hub cache holds a tiny model and a tiny openai/gsm8k."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    home = str(tmp_path_factory.mktemp("hf_home"))
    hub = os.path.join(home, "hub")
    shutil.copytree(TINY_BASE, _snapshot_dir(hub, "model", MODEL_ID), dirs_exist_ok=True)
    snap = _snapshot_dir(hub, "dataset", DATASET_ID)
    os.makedirs(os.path.join(snap, "main"))
    for split, rows in ROWS.items():
        pq.write_table(
            pa.Table.from_pylist(rows),
            os.path.join(snap, "main", f"{split}-00000-of-00001.parquet"),
        )
    return home


@pytest.fixture
def offline(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def test_resolve_hub_path_offline_cached_model_returns_snapshot_dir(offline):
    from areal.utils.hf_utils import is_hub_id, resolve_model_path

    assert is_hub_id(MODEL_ID)
    path = resolve_model_path(MODEL_ID)
    assert path == os.path.join(
        offline, "hub", "models--tiny-org--Tiny-LM-Instruct", "snapshots", REV
    )
    assert os.path.exists(os.path.join(path, "config.json"))
    # a local path is returned unchanged
    assert resolve_model_path(path) == path


def test_load_hf_tokenizer_with_hub_id_offline_uses_cache(offline):
    from areal.utils.hf_utils import load_hf_tokenizer

    tok = load_hf_tokenizer(MODEL_ID)
    assert tok.decode(tok.encode("12 + 7", add_special_tokens=False)) == "12 + 7"


def test_get_custom_dataset_hub_id_reads_cached_snapshot_split_and_subset(offline):
    from areal.dataset import get_custom_dataset

    cfg = DatasetConfig(
        path=DATASET_ID, type="rl", max_length=None, split="test", dataset_kwargs={"name": "main"}
    )
    test = get_custom_dataset(dataset_config=cfg)  # split from the config
    assert len(test) == 1 and test[0]["answer"].endswith("#### 7")
    train = get_custom_dataset("train", cfg)
    assert len(train) == 6
    assert train[0]["messages"][0]["content"].startswith("Tom has 0 apples")
    cfg.dataset_kwargs = {"nme": "main"}
    with pytest.raises(ValueError, match="nme"):
        get_custom_dataset("train", cfg)


def test_offline_uncached_hub_id_raises_one_error_naming_id_cache_and_flag(offline):
    from areal.utils.hf_utils import resolve_model_path

    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(e.value)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in msg
    assert os.path.join(offline, "hub") in msg
    assert "HF_HUB_OFFLINE='1'" in msg


def test_offline_uncached_dataset_id_raises_naming_it(offline):
    from areal.dataset import get_custom_dataset

    cfg = DatasetConfig(path="someone/nowhere", type="rl", max_length=None)
    with pytest.raises(FileNotFoundError, match="dataset 'someone/nowhere'.*HF_HUB_OFFLINE"):
        get_custom_dataset("train", cfg)


def test_missing_relative_path_is_not_taken_for_a_hub_id(offline):
    from areal.utils.hf_utils import is_hub_id, resolve_model_path

    assert not is_hub_id("./models/x") and not is_hub_id("/no/such/dir")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./models/x")


def test_resolve_config_hub_paths_replaces_every_model_path(offline, tmp_path):
    from areal.api.cli_args import GRPOConfig
    from areal.utils.hf_utils import resolve_config_hub_paths

    cfg = GRPOConfig()
    cfg.actor.path = MODEL_ID
    cfg.tokenizer_path = MODEL_ID
    cfg.ref = type(cfg.actor)(path=MODEL_ID)
    local = str(tmp_path)
    cfg.critic = None
    changed = resolve_config_hub_paths(cfg)
    snap = os.path.join(offline, "hub", "models--tiny-org--Tiny-LM-Instruct", "snapshots", REV)
    assert cfg.actor.path == cfg.ref.path == cfg.tokenizer_path == snap
    assert {"actor.path", "ref.path", "tokenizer_path"} <= set(changed)
    cfg.actor.path = local  # local paths untouched
    assert "actor.path" not in resolve_config_hub_paths(cfg)


def test_planner_sizes_a_hub_id_from_the_cache_and_names_an_uncached_one(offline, capsys):
    """``python -m areal.tools.plan`` takes ``actor.path`` as the trainer does: a hub id
    is read from the cache (the real-model recipe names one); an uncached id is an error
    naming the field, not a traceback."""
    import json

    from areal.tools import plan as plan_cli

    yaml = os.path.join(os.path.dirname(__file__), "..", "examples", "math", "gsm8k_grpo_cpu.yaml")
    assert plan_cli.main(["--config", yaml, f"actor.path={MODEL_ID}", "--json"]) == 0
    by_hub = json.loads(capsys.readouterr().out)["trainer_rank"]
    assert plan_cli.main(["--config", yaml, f"actor.path={TINY_BASE}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer_rank"] == by_hub  # same weights
    assert plan_cli.main(["--config", yaml, "actor.path=someone/nowhere", "--json"]) == 1
    err = capsys.readouterr().err
    assert "actor.path='someone/nowhere'" in err and "HF_HUB_OFFLINE" in err
