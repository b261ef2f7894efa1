"""Shared pytest fixtures (keep minimal and additive)."""

from __future__ import annotations

import os
import random

import pytest
from _ci_plugin import CIPlugin, in_ci
from netns_cluster import netns_cluster  # noqa: F401 - session fixture (tests/netns_cluster.py)
from ray_netns_fixture import ray_netns_cluster  # noqa: F401 - module fixture (tests/ray_netns_fixture.py)


def pytest_configure(config):
    """One run secret for the whole test session (as a controller creates one per run).

    Every worker and server a test starts inherits it, whatever the test order; tests that
    call control endpoints by hand send it (``auth_headers(get_run_secret())``).
    """
    from areal.utils.auth import ensure_run_secret

    ensure_run_secret()
    # CI skip policy, per-file durations, time budget (tests/_ci_plugin.py).
    config.pluginmanager.register(CIPlugin(), "areal-ci")
    _force_hypothesis_seed(config)


def _force_hypothesis_seed(config) -> None:
    """Every run uses one printed Hypothesis seed, so that any failure reproduces.

    ``--hypothesis-seed=N`` wins; else under CI the fixed ``HYPOTHESIS_SEED`` (default 0:
    CI is derandomised), else a fresh random seed. The header prints it with the option
    that replays the run.
    """
    from hypothesis import core

    seed = config.getoption("hypothesis_seed")
    if seed is None:
        seed = os.environ.get("HYPOTHESIS_SEED") or ("0" if in_ci() else None)
    if seed is None:
        seed = random.randrange(2**32)
        # the test processes of `pytest -n` (started after this) use the same seed
        os.environ["HYPOTHESIS_SEED"] = str(seed)
    seed = int(seed) if str(seed).isdigit() else seed
    core.global_force_seed = seed
    config.stash[_HYPOTHESIS_SEED] = seed


_HYPOTHESIS_SEED = pytest.StashKey[object]()

# The longest files of `make check` that are not marked `serial` (Makefile), started
# first: `pytest -n 2 --dist loadfile` hands out whole files in collection order, so one
# of these left for the end would run alone while the other process idles.
LONGEST_FILES = (
    "test_archon_ep.py",  # with the archon_matrix cases (4-rank MoE and pipeline layouts)
    "test_real_model.py",
    "test_presets_train.py",
    "test_deterministic_rollout.py",
    "test_archon_engine.py",
    "test_resume.py",
    "test_ray_scheduler.py",
    "test_agent_workflow.py",
    "test_slurm_scheduler.py",
    "test_preference_trainers.py",
    "test_ppo_actor.py",
    "test_slurm_two_nodes.py",
    "test_rl_trainer_teacher_lora.py",
    # several minutes each (trainer runs through the proxy, servers started per test)
    "test_verifiers_workflow.py",
    "test_openenv_workflow.py",
    "test_reasoning_gym.py",
    "test_cli.py",
    "test_server_teacher.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST_FILES` first, in that order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def pytest_report_header(config):
    seed = config.stash.get(_HYPOTHESIS_SEED, None)
    return f"hypothesis seed: {seed} (reproduce: pytest --hypothesis-seed={seed})"


@pytest.fixture(autouse=True)
def _fresh_stats_trackers():
    """Each test starts with empty stats trackers.

    The trackers are process-wide; under ``pytest -n`` one process runs many files in an
    order that depends on timing, so stats one test left unexported must not reach the
    next test's ``export_stats``. Modules not yet imported have nothing to drop.
    """
    import sys

    tracker = sys.modules.get("areal.utils.stats_tracker")
    if tracker is not None:
        tracker.reset_all()
    yield


def build_tiny_qwen2(
    path: str,
    vocab_size: int = 400,
    seed: int = 0,
    tie: bool = False,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
) -> str:
    """Save a random tiny Qwen2 causal LM (hidden 64, 2 layers) to ``path``; returns ``path``.

    Head dim = 64 / ``num_attention_heads`` (16 by default; vLLM's CPU attention needs >= 32).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg)
    # Larger-than-default init so that sampled distributions are not near-uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Directory of a random tiny Qwen2 (hidden 64, 2 layers, vocab 400, EOS id 2, untied)."""
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")))


def build_tiny_lm_with_tokenizer(path: str, seed: int = 0) -> str:
    """A random tiny Qwen2 (hidden 64, 2 layers) with the project's tiny tokenizer + chat template."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal.dataset.synthetic import ArithSpec, generate_arith_problems
    from areal.models.tiny import build_tiny_tokenizer, tiny_model_config

    rows = generate_arith_problems(ArithSpec(n=2000, seed=seed))
    tok = build_tiny_tokenizer(path, [r["question"] + "\n" + r["answer"] for r in rows])
    torch.manual_seed(seed)
    cfg = tiny_model_config(
        vocab_size=len(tok), num_hidden_layers=2, hidden_size=64, intermediate_size=128
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> str:
    """Directory of a random tiny Qwen2 with the tiny tokenizer (loadable by load_hf_tokenizer)."""
    return build_tiny_lm_with_tokenizer(str(tmp_path_factory.mktemp("tiny_lm")))
