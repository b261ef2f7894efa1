"""FSDPEngine on a Qwen2-VL-architecture model (tiny, random): multimodal packed batches.

One 1-rank gloo session (process start-up dominates) computes everything; the tests assert
on its results:

- packed logprobs (several micro-batches, images and text-only rows mixed) equal plain
  transformers on the right-padded batch (with attention mask, pixel values, M-RoPE
  computed by the model itself);
- gradients of the same loss through the packed path equal the padded path's;
- one train step on a mixed text+image batch changes vision-tower and text parameters;
  with ``freeze_vision_tower`` the vision tower stays bit-identical;
- on a GRPO-shaped batch (several samples of each image prompt, each with its own copy of
  the pixels, plus text-only rows), the fast path (``dedup_images``: each distinct image
  through the vision tower once, shared prefixes packed once) gives the old path's
  logprobs, loss and gradients, and both equal transformers on the padded batch.
"""

from __future__ import annotations

import pytest
import torch
from _dist_helpers import run_ranks

ATOL = 1e-4


def make_mm_batch(path: str) -> dict:
    """4 rows: image, text-only, image, text-only; right-padded, ``multi_modal_input``."""
    from areal.dataset.synthetic_clevr import ClevrSpec, generate_clevr_rows
    from areal.utils.vlm import load_vlm_processor

    proc = load_vlm_processor(path)
    tok = proc.tokenizer
    rows = generate_clevr_rows(ClevrSpec(n=2, seed=3), "test")
    seqs, entries = [], []
    answers = ["[2]", "[13]", "[4] ok", "[7]"]
    for i in range(4):
        if i % 2 == 0:
            r = rows[i // 2]
            msgs = [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": r["problem"][7:]}],
                }
            ]
            text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            enc = proc(text=[text], images=r["images"])
            ids = enc["input_ids"][0].tolist()
            entries.append(
                {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
            )
        else:
            msgs = [{"role": "user", "content": "what is " + "1 + " * (i + 2) + "1?"}]
            text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
            entries.append({})
        ans = tok.encode(answers[i], add_special_tokens=False) + [tok.eos_token_id]
        seqs.append((ids, ans))
    return right_padded(seqs, entries)


def right_padded(seqs: list[tuple[list[int], list[int]]], entries: list[dict]) -> dict:
    """(prompt ids, answer ids) pairs as a right-padded batch; the loss on the answers."""
    width = max(len(p) + len(a) for p, a in seqs)
    b = len(seqs)
    input_ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
        loss_mask[i, len(p) : len(p) + len(a)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "multi_modal_input": entries,
    }


def make_grpo_batch(path: str) -> dict:
    """2 image prompts x 3 samples (each sample its own processor output) and one text
    prompt x 2 samples, completions of different lengths; right-padded."""
    from areal.dataset.synthetic_clevr import ClevrSpec, generate_clevr_rows
    from areal.utils.vlm import load_vlm_processor

    proc = load_vlm_processor(path)
    tok = proc.tokenizer
    rows = generate_clevr_rows(ClevrSpec(n=2, seed=5), "train")
    seqs, entries = [], []
    answers = ["[1]", "[3] x", "[2]", "[4]", "[1] [1]", "[0]"]
    for g, r in enumerate(rows):
        msgs = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": r["problem"][7:]}],
            }
        ]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        for k in range(3):
            enc = proc(text=[text], images=r["images"])
            ans = tok.encode(answers[3 * g + k], add_special_tokens=False) + [tok.eos_token_id]
            seqs.append((enc["input_ids"][0].tolist(), ans))
            entries.append(
                {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
            )
    msgs = [{"role": "user", "content": "what is 1 + 1 + 1 + 1 + 1 + 1?"}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    for ans in ("[6]", "[5] no"):
        ids = tok.encode(text, add_special_tokens=False)
        seqs.append((ids, tok.encode(ans, add_special_tokens=False) + [tok.eos_token_id]))
        entries.append({})
    return right_padded(seqs, entries)


def loss_fn(logp, entropy, d):
    m = d["loss_mask"].float()
    return -(logp * m).sum() / m.sum()


def loss_weight_fn(d):
    return d["loss_mask"].sum()


def _config(path: str, max_tokens=None, **kw):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    return TrainEngineConfig(
        experiment_name="t",
        trial_name="t",
        path=path,
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.0, warmup_steps_proportion=0.0),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
        num_threads=1,
        **kw,
    )


def _engine(path: str, max_tokens=None, **kw):
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    eng = FSDPEngine(_config(path, max_tokens, **kw))
    eng.create_process_group()
    eng.initialize(None, FinetuneSpec(1, 10, 1))
    return eng


def _reference(path: str, batch: dict) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """transformers on the padded batch: logprobs [B, T], the loss, its gradients."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.config.vision_config._attn_implementation = "sdpa"
    ids, mask = batch["input_ids"], batch["attention_mask"]
    entries = batch["multi_modal_input"]
    pv = torch.cat([e["pixel_values"] for e in entries if e])
    grid = torch.cat([e["image_grid_thw"] for e in entries if e])
    mm = (ids == model.config.image_token_id).to(torch.int32) * mask
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pv,
        image_grid_thw=grid,
        mm_token_type_ids=mm,
        use_cache=False,
    ).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    logp = torch.zeros(ids.shape)
    logp[:, 1:] = lp
    logp = logp * mask
    m = batch["loss_mask"].float()
    loss = -(logp * m).sum() / m.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), float(loss), grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _session(rank, world_size, path):
    torch.set_num_threads(1)
    batch = make_mm_batch(path)
    res = {}
    ref_logp, ref_loss, ref_grads = _reference(path, batch)
    res["ref_logp"], res["ref_loss"] = ref_logp, ref_loss
    eng = _engine(path, max_tokens=64)  # several micro-batches
    res["n_mbs"] = len(eng._split(batch))
    res["fwd_mbs"] = eng.forward_batch(batch)
    one = _engine(path)  # one micro-batch holding every row, packed
    res["fwd_one"] = one.forward_batch(batch)
    # gradients through the packed path (one micro-batch), same loss as the reference
    one.model.zero_grad(set_to_none=True)
    mb = one._split(batch).packed()[0]
    logp, _ = one._forward_packed(mb)
    loss = loss_fn(logp, None, mb)
    loss.backward()
    res["loss"] = float(loss)
    grads = {}
    for n, p in one.model.named_parameters():
        if p.grad is not None:
            grads[n.replace("lm_head.head.", "lm_head.")] = _full(p.grad).clone()
    res["grad_pairs"] = {n: (grads[n], ref_grads[n]) for n in ref_grads if n in grads}
    res["ref_grad_names"] = sorted(ref_grads)
    # one optimizer step on the mixed batch: what changed?
    before = {k: v.clone() for k, v in eng._full_state_dict().items()}
    eng.train_batch(batch, loss_fn, loss_weight_fn)
    after = eng._full_state_dict()
    res["changed"] = {k: not torch.equal(before[k], after[k]) for k in before}
    frozen = _engine(path, max_tokens=64, freeze_vision_tower=True)
    before = {k: v.clone() for k, v in frozen._full_state_dict().items()}
    frozen.train_batch(batch, loss_fn, loss_weight_fn)
    after = frozen._full_state_dict()
    res["changed_frozen"] = {k: not torch.equal(before[k], after[k]) for k in before}
    res["mask"] = batch["attention_mask"]
    res["fast"] = _fast_vs_old(_engine(path), path)  # a fresh engine: no earlier backward
    return res


def _packed_grads(eng, batch: dict) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Logprobs [B, T] (forward_batch), and the loss and gradients of one packed
    micro-batch holding every row."""
    logp_all = eng.forward_batch(batch)
    eng.model.zero_grad(set_to_none=True)
    mb = eng._split(batch).packed()[0]
    logp, _ = eng._forward_packed(mb)
    loss = loss_fn(logp, None, mb)
    loss.backward()
    grads = {
        n.replace("lm_head.head.", "lm_head."): _full(p.grad).clone()
        for n, p in eng.model.named_parameters()
        if p.grad is not None
    }
    eng.model.zero_grad(set_to_none=True)
    return logp_all, float(loss), grads


def _fast_vs_old(eng, path: str) -> dict:
    from areal.engine.fsdp.vision_inputs import pack_images

    batch = make_grpo_batch(path)
    out: dict = {"mask": batch["attention_mask"]}
    out["ref"] = _reference(path, batch)
    eng.dedup_images, eng.share_prefixes = False, False
    out["old"] = _packed_grads(eng, batch)
    eng.dedup_images, eng.share_prefixes = True, True
    out["new"] = _packed_grads(eng, batch)
    mb = eng._split(batch).packed()[0]
    images = pack_images(eng.model, mb["input_ids"], mb["cu_seqlens"], mb["multi_modal_input"])
    out["n_images"] = int(images.image_grid_thw.shape[0])
    plan = eng._shared_prefix_plan(images.keys, mb["cu_seqlens"].long(), images.position_ids)
    out["plan_tokens"] = (plan.n_tokens if plan is not None else None, mb["input_ids"].numel())
    return out


@pytest.fixture(scope="module")
def vlm_session(tmp_path_factory):
    from areal.models.tiny_vlm import build_random_tiny_vlm

    path = build_random_tiny_vlm(tmp_path_factory.mktemp("vlm") / "m", seed=0)
    return run_ranks(_session, 1, (path,), timeout=400)[0]


@pytest.mark.slow
def test_vlm_packed_microbatches_logprobs_equal_padded_hf(vlm_session):
    r = vlm_session
    assert r["n_mbs"] >= 2
    mask = r["mask"].bool()
    first = torch.zeros_like(mask)
    first[:, 0] = True  # no logprob for the first token
    sel = mask & ~first
    torch.testing.assert_close(r["fwd_mbs"][sel], r["ref_logp"][sel], atol=ATOL, rtol=0)
    torch.testing.assert_close(r["fwd_one"][sel], r["ref_logp"][sel], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_vlm_packed_gradients_equal_padded_hf(vlm_session):
    r = vlm_session
    assert abs(r["loss"] - r["ref_loss"]) < ATOL
    pairs = r["grad_pairs"]
    # every reference gradient is compared (vision tower and language model)
    assert len(pairs) == len(r["ref_grad_names"])
    assert any("visual" in n for n in pairs) and any("language_model" in n for n in pairs)
    for name, (g, ref) in pairs.items():
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_vlm_mixed_batch_step_changes_vision_and_text_params(vlm_session):
    changed = vlm_session["changed"]
    vision = [k for k in changed if "visual" in k]
    text = [k for k in changed if "language_model" in k]
    assert vision and text
    assert all(changed[k] for k in vision if "blocks" in k or "merger" in k), vision
    assert all(changed[k] for k in text if "layers" in k)
    frozen = vlm_session["changed_frozen"]
    assert not any(frozen[k] for k in frozen if "visual" in k)
    assert any(frozen[k] for k in frozen if "language_model" in k)


@pytest.mark.slow
def test_vlm_fast_path_equals_old_path_and_padded_hf(vlm_session):
    r = vlm_session["fast"]
    # 6 image rows with 2 distinct images; the shared prompts are packed once
    assert r["n_images"] == 2
    n_plan, n_tokens = r["plan_tokens"]
    assert n_plan is not None and n_plan < 0.6 * n_tokens
    mask = r["mask"].bool()
    first = torch.zeros_like(mask)
    first[:, 0] = True
    sel = mask & ~first
    old_logp, old_loss, old_grads = r["old"]
    new_logp, new_loss, new_grads = r["new"]
    ref_logp, ref_loss, ref_grads = r["ref"]
    torch.testing.assert_close(new_logp[sel], old_logp[sel], atol=1e-5, rtol=0)
    torch.testing.assert_close(new_logp[sel], ref_logp[sel], atol=ATOL, rtol=0)
    assert abs(new_loss - old_loss) < 1e-5 and abs(new_loss - ref_loss) < ATOL
    assert sorted(new_grads) == sorted(old_grads)
    assert any("visual" in n for n in new_grads)
    for name in old_grads:
        torch.testing.assert_close(
            new_grads[name],
            old_grads[name],
            atol=1e-6,
            rtol=1e-4,
            msg=lambda m, n=name: f"{n}: {m}",
        )
        if name in ref_grads:
            torch.testing.assert_close(
                new_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name
            )
