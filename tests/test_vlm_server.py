"""Built-in server with a Qwen2-VL-architecture model (tiny, random weights), in process.

Image prompts and a text-only prompt are generated concurrently (continuous batching puts
them in the same batch); each response's logprobs must equal a plain transformers forward
of prompt + output with the same pixel values (atol 1e-4). Copies of one image prompt (a
GRPO group) share one preprocessing of the image.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

ATOL = 1e-4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from areal.models.tiny_vlm import build_random_tiny_vlm

    return build_random_tiny_vlm(tmp_path_factory.mktemp("vlm_srv") / "m", seed=1)


def _image_prompts(path):
    from areal.dataset.synthetic_clevr import ClevrSpec, generate_clevr_rows
    from areal.dataset.vision import problem_to_messages
    from areal.utils.vlm import image_to_base64, load_vlm_processor

    proc = load_vlm_processor(path)
    out = []
    for r in generate_clevr_rows(ClevrSpec(n=2, seed=5), "test"):
        msgs = problem_to_messages(r["problem"], 1)
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=r["images"])
        out.append((enc["input_ids"][0].tolist(), [image_to_base64(r["images"][0])], enc))
    text_ids = proc.tokenizer.encode("<|im_start|>user\nhello 12 + 5<|im_end|>\n")
    return proc, out, text_ids


@torch.no_grad()
def _hf_logprobs(model, prompt, output, enc=None):
    ids = torch.tensor([prompt + output])
    kw = {}
    if enc is not None:
        kw = dict(
            pixel_values=enc["pixel_values"],
            image_grid_thw=enc["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).to(torch.int32),
        )
    logits = model(input_ids=ids, use_cache=False, **kw).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


async def test_vlm_server_image_and_text_requests_logprobs_match_hf(vlm_dir):
    from aiohttp.test_utils import TestClient, TestServer
    from transformers import Qwen2VLForConditionalGeneration

    from areal.inference.server.app import LocalInferenceServer

    torch.set_num_threads(1)
    srv = LocalInferenceServer.from_pretrained(vlm_dir, seed=0)
    client = TestClient(TestServer(srv.build_app()))
    await client.start_server()
    _, image_prompts, text_ids = _image_prompts(vlm_dir)
    try:

        async def gen(ids, images=None, n=6, seed=1):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "seed": seed},
            }
            if images is not None:
                body["image_data"] = images
            r = await client.post("/generate", json=body)
            assert r.status == 200, await r.text()
            return await r.json()

        # a GRPO group: the first image prompt 3 more times, concurrently, other seeds
        results = await asyncio.gather(
            gen(image_prompts[0][0], image_prompts[0][1], n=7, seed=1),
            gen(text_ids, None, n=4, seed=2),
            gen(image_prompts[1][0], image_prompts[1][1], n=9, seed=3),
            *(gen(image_prompts[0][0], image_prompts[0][1], n=5, seed=s) for s in (4, 5, 6)),
        )
        # each distinct image list is preprocessed once; the group's copies share it
        assert (srv.image_cache.misses, srv.image_cache.hits) == (2, 3)
        # an image that does not decode is refused each time (a failure is not cached)
        junk = "data:image/png;base64," + "A" * 600
        for _ in range(2):
            r = await client.post(
                "/generate",
                json={
                    "input_ids": image_prompts[0][0],
                    "image_data": [junk],
                    "sampling_params": {"max_new_tokens": 2},
                },
            )
            assert r.status == 400 and "could not decode" in await r.text()
        assert srv.image_cache.misses == 4
        # a wrong number of image tokens is refused with a clear 400
        short = list(image_prompts[0][0])
        short.remove(srv.core.model.config.image_token_id)
        bad = await client.post(
            "/generate",
            json={
                "input_ids": short,
                "image_data": image_prompts[0][1],
                "sampling_params": {"max_new_tokens": 2},
            },
        )
        assert bad.status == 400 and "image tokens" in await bad.text()
    finally:
        await client.close()
        srv.core.shutdown()
    model = Qwen2VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    cases = [
        (image_prompts[0][0], results[0], image_prompts[0][2]),
        (text_ids, results[1], None),
        (image_prompts[1][0], results[2], image_prompts[1][2]),
        *((image_prompts[0][0], r, image_prompts[0][2]) for r in results[3:]),
    ]
    for prompt, res, enc in cases:
        out = res["output_ids"]
        assert len(out) >= 1
        ref = _hf_logprobs(model, prompt, out, enc)
        torch.testing.assert_close(torch.tensor(res["output_logprobs"]), ref, atol=ATOL, rtol=0)
