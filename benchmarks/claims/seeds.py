"""The seed of a claim's CI run: derived from the commit under test, so nobody chooses it.

    ci_seed("4c14d19...", "demo")  ->  an int in [0, 2**31)

A claim's threshold is fitted to nothing when the seed it is judged on changes with every
commit and is known only once the commit exists: ``benchmarks/claims/run.py
--seed-from-commit`` passes ``seed=<ci_seed(commit, claim)>`` to every run of a claim (its
own and its controls'), prints it and records it with the commit in the report
(``docs/claims.json`` with ``--write-docs``). Off by default until the thresholds come
from ``benchmarks/claims/calibrate.py`` over several seeds (docs/claims.md).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ci_seed(commit: str, claim: str) -> int:
    """sha256 of ``"<commit>:<claim>"``, its first 8 bytes as an int, modulo 2**31 (a seed
    every config and torch generator accepts). The full 40-hex commit id is expected."""
    if not commit or not claim:
        raise ValueError(f"ci_seed needs a commit and a claim name (got {commit!r}, {claim!r})")
    digest = hashlib.sha256(f"{commit}:{claim}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**31


def head_commit(root: Path = ROOT) -> str:
    """The full id of the checked-out commit (``git rev-parse HEAD``)."""
    out = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()
