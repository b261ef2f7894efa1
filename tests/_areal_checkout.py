"""Files of an AReaL checkout for the opt-in ``areal_checkout`` tests.

``copy_areal_files`` copies ``files`` (paths inside AReaL's repository) from the checkout
named by the first of ``env_vars`` that is set (a work tree, or a bare git directory read
with ``git show HEAD:<path>``) into ``dest``; the test skips when none is set or a file
is missing (these tests are deselected in CI, which has no checkout). ``wait_for_grant``
waits for an online trainer's first session grant (the online examples' tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest


def copy_areal_files(dest: str, files: list[str], env_vars: tuple[str, ...]) -> dict[str, str]:
    """``{path in AReaL's repository: copied file}``."""
    ref = next((os.environ[v] for v in env_vars if os.environ.get(v)), None)
    if not ref:
        pytest.skip(f"set {' or '.join(env_vars)} to an AReaL checkout to run AReaL's own files")
    out = {}
    for rel in files:
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(os.path.join(ref, rel)):
            shutil.copy(os.path.join(ref, rel), target)
        else:  # a bare git directory
            blob = subprocess.run(
                ["git", "--git-dir", ref, "show", f"HEAD:{rel}"], capture_output=True, check=False
            )
            if blob.returncode != 0:
                pytest.skip(f"{rel} not found in the AReaL checkout {ref}")
            with open(target, "wb") as f:
                f.write(blob.stdout)
        out[rel] = target
    return out


def wait_for_grant(base: str, trainer: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until the online trainer's proxy at ``base`` has granted a session (its
    ``/health`` counts ``open_grants``); fails when ``trainer`` exits first or on timeout."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert trainer.poll() is None, "the trainer exited before its proxy came up"
        try:
            if httpx.get(f"{base}/health", timeout=5).json().get("open_grants", 0) > 0:
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"no session granted at {base} within {timeout}s")
