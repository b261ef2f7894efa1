"""Shared pytest fixtures (keep minimal and additive)."""

from __future__ import annotations

import os
import re

import pytest

# --------------------------------------------------------------------------- CI: no silent skips
# With the CI environment variable set (any non-empty value but "0"/"false"), a test that
# skips because Slurm, Ray or test data is missing FAILS instead: CI promises to run them,
# so a broken install must not turn into a green run. GPU, vLLM and opt-in tests (e.g.
# AREAL_REFERENCE_DIR) still skip.
_CI_REQUIRED = re.compile(r"\b(slurm|sbatch|squeue|munge|ray|gsm8k|data(set)?)\b", re.IGNORECASE)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _ci_forbidden_skip(report) -> str | None:
    if not (_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason if _CI_REQUIRED.search(reason or "") else None


def _fail_skip(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"CI is set: a missing Slurm/Ray/data prerequisite is a failure: {reason}"


def pytest_configure(config):
    """One run secret for the whole test session (as a controller creates one per run).

    Every worker and server a test starts inherits it, whatever the test order; tests that
    call control endpoints by hand send it (``auth_headers(get_run_secret())``).
    """
    from areal.utils.auth import ensure_run_secret

    ensure_run_secret()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    reason = _ci_forbidden_skip(report)
    if reason is not None:
        _fail_skip(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    reason = _ci_forbidden_skip(report)
    if reason is not None:
        _fail_skip(report, reason)


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
