"""``VisionRLVRWorkflow``'s encodings: the samples of one prompt share one processor output."""

from __future__ import annotations

import asyncio

import torch

from areal.api.cli_args import GenerationHyperparameters
from areal.reward.clevr_count_70k import clevr_count_70k_reward_fn


class CountingProcessor:
    """The tiny VLM's real processor, counting its calls."""

    def __init__(self):
        from areal.models.tiny_vlm import build_tiny_vlm_processor

        self.inner = build_tiny_vlm_processor()
        self.tokenizer = self.inner.tokenizer
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


def _workflow(proc):
    from areal.workflow.vision_rlvr import VisionRLVRWorkflow

    return VisionRLVRWorkflow(
        clevr_count_70k_reward_fn,
        GenerationHyperparameters(n_samples=1, max_new_tokens=4),
        tokenizer=proc.tokenizer,
        processor=proc,
    )


def test_vision_workflow_concurrent_samples_share_one_encoding_equal_to_processor():
    from areal.dataset.synthetic_clevr import ClevrSpec, generate_clevr_rows

    proc = CountingProcessor()
    wf = _workflow(proc)
    rows = generate_clevr_rows(ClevrSpec(n=2, seed=1), "train")
    text = "<|vision_start|><|image_pad|><|vision_end|>How many?"

    async def run():
        same = await asyncio.gather(*[wf._encode(text, rows[0]["images"]) for _ in range(8)])
        other = await wf._encode(text, rows[1]["images"])
        again = await wf._encode(text, rows[0]["images"])
        return same, other, again

    same, other, again = asyncio.run(run())
    # 8 concurrent samples of one prompt + a repeat: one processor call; another image: one more
    assert proc.calls == 2
    assert all(e["pixel_values"] is same[0]["pixel_values"] for e in [*same, again])
    assert not torch.equal(other["pixel_values"], same[0]["pixel_values"])
    ref = proc.inner(text=[text], images=rows[0]["images"], return_tensors="pt")
    assert same[0]["input_ids"] == ref["input_ids"][0].tolist()
    assert torch.equal(same[0]["pixel_values"], ref["pixel_values"])
    assert torch.equal(same[0]["image_grid_thw"], ref["image_grid_thw"])
    assert len(same[0]["image_data"]) == 1 and same[0]["image_data"][0]
