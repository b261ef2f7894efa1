"""Vision data path: synthetic CLEVR scenes, Geometry3K / CLEVR-Count file loaders, rewards,
the light Qwen2-VL processor, and the per-backend image request formats."""

from __future__ import annotations

import base64
import io
import json
from collections import Counter

import pytest

from areal.api.cli_args import DatasetConfig


def _png(color=(255, 0, 0), size=28) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- synthetic
def test_synthetic_clevr_same_spec_same_rows_splits_differ():
    from areal.dataset.synthetic_clevr import ClevrSpec, generate_clevr_rows

    a = generate_clevr_rows(ClevrSpec(n=20), "train")
    b = generate_clevr_rows(ClevrSpec(n=20), "train")
    c = generate_clevr_rows(ClevrSpec(n=20), "test")
    assert [r["problem"] for r in a] == [r["problem"] for r in b]
    assert [r["images"][0].tobytes() for r in a] == [r["images"][0].tobytes() for r in b]
    assert [r["problem"] for r in a] != [r["problem"] for r in c]


def test_synthetic_clevr_color_counts_balanced_and_true():
    from areal.dataset.synthetic_clevr import COLORS, ClevrSpec, generate_clevr_rows

    rows = generate_clevr_rows(ClevrSpec(n=400, query="color", max_count=4), "train")
    counts = Counter(int(r["answer"]) for r in rows)
    assert set(counts) == {1, 2, 3, 4} and min(counts.values()) > 60
    # the answer is the number of grid cells (one object each) holding the asked colour
    import numpy as np

    for r in rows[:30]:
        color = r["problem"].split("How many ")[1].split(" ")[0]
        arr = np.asarray(r["images"][0])
        hit = np.all(arr == np.array(COLORS[color]), axis=-1)
        cells = [hit[y : y + 28, x : x + 28].any() for y in (0, 28, 56) for x in (0, 28, 56)]
        assert sum(cells) == int(r["answer"]), r["problem"]


def test_synthetic_clevr_path_parse_and_errors():
    from areal.dataset.synthetic_clevr import parse_clevr_path

    spec = parse_clevr_path("synthetic://clevr?n=5&query=shape&colors=red,blue&max_count=3")
    assert (spec.n, spec.query, spec.colors, spec.max_count) == (5, "shape", ("red", "blue"), 3)
    with pytest.raises(ValueError, match="unknown key"):
        parse_clevr_path("synthetic://clevr?bogus=1")
    with pytest.raises(ValueError, match="query"):
        parse_clevr_path("synthetic://clevr?query=size")
    with pytest.raises(ValueError, match="max_count"):
        parse_clevr_path("synthetic://clevr?max_objects=2&max_count=3")


def test_get_custom_dataset_synthetic_clevr_rl_rows():
    from areal.dataset import get_custom_dataset
    from areal.utils.vlm import load_image

    ds = get_custom_dataset(
        "train", DatasetConfig(path="synthetic://clevr?n=6", type="rl", max_length=None)
    )
    row = ds[0]
    assert set(row) >= {"messages", "images", "answer"}
    content = row["messages"][-1]["content"]
    assert content[0]["type"] == "image" and content[-1]["type"] == "text"
    assert "brackets" in content[-1]["text"]
    assert load_image(row["images"][0]).size == (84, 84)


def test_get_custom_dataset_synthetic_clevr_sft_with_processor_and_max_length():
    from areal.dataset import get_custom_dataset
    from areal.models.tiny_vlm import build_tiny_vlm_processor

    proc = build_tiny_vlm_processor()
    cfg = DatasetConfig(path="synthetic://clevr?n=4", type="sft", max_length=200)
    ds = get_custom_dataset("train", cfg, processor=proc)
    row = ds[0]
    n_img = sum(t == proc.image_token_id for t in row["input_ids"])
    assert n_img == 9  # 84x84 -> 6x6 patches -> 3x3 merged tokens
    target = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert proc.tokenizer.decode(target).startswith("[")
    assert len(row["multi_modal_input"][0]["image_grid_thw"]) == 1
    cfg.max_length = 20
    with pytest.raises(ValueError, match="longer than max_length"):
        get_custom_dataset("train", cfg, processor=proc)


# ----------------------------------------------------------------------------- files
def test_geometry3k_parquet_rows_bad_rows_counted_and_limited(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from areal.dataset import get_custom_dataset

    d = tmp_path / "geometry3k"
    d.mkdir()
    good = [
        {
            "images": [{"bytes": _png(), "path": None}],
            "problem": f"<image>Find x{i}.",
            "answer": "3",
        }
        for i in range(18)
    ]
    bad = [
        {
            "images": [{"bytes": b"not an image", "path": None}],
            "problem": "<image>?",
            "answer": "1",
        },
        {"images": [{"bytes": _png(), "path": None}], "problem": "<image>?", "answer": ""},
    ]
    pq.write_table(pa.Table.from_pylist(good + bad), d / "train-00000-of-00001.parquet")
    ds = get_custom_dataset("train", DatasetConfig(path=str(d), type="rl", max_length=None))
    assert len(ds) == 18
    assert "\\boxed{}" in ds[0]["messages"][-1]["content"][-1]["text"]
    pq.write_table(pa.Table.from_pylist(good[:2] + bad), d / "test.parquet")
    with pytest.raises(ValueError, match="rows are bad"):
        get_custom_dataset("test", DatasetConfig(path=str(d), type="rl", max_length=None))


def test_clevr_count_jsonl_relative_image_paths_and_base64(tmp_path):
    from areal.dataset import get_custom_dataset
    from areal.utils.vlm import load_image

    d = tmp_path / "clevr_count_70k"
    (d / "img").mkdir(parents=True)
    (d / "img" / "a.png").write_bytes(_png((0, 0, 255)))
    rows = [
        {"images": ["img/a.png"], "problem": "<image>How many items are there?", "answer": "4"},
        {
            "images": [base64.b64encode(_png((0, 255, 0))).decode()],
            "problem": "<image>How many?",
            "answer": "2",
        },
    ]
    (d / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = get_custom_dataset("test", DatasetConfig(path=str(d), type="rl", max_length=None))
    assert [r["answer"] for r in ds] == ["4", "2"]
    assert ds[0]["messages"][0]["role"] == "system"  # the bracket instruction
    assert load_image(ds[0]["images"][0]).getpixel((3, 3)) == (0, 0, 255)


# ----------------------------------------------------------------------------- rewards
@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("There are [3] cubes.", "3", 1.0),
        ("[2] no wait [3]", "3", 1.0),
        ("[3.0]", "3", 1.0),
        ("[4]", "3", 0.0),
        ("3", "3", 0.0),  # no brackets: no answer (AReaL's convention)
        ("[three]", "3", 0.0),
        ("[3]", "[3]", 1.0),
    ],
)
def test_clevr_count_70k_reward_fn_bracket_convention(completion, answer, expected):
    from areal.reward import clevr_count_70k_reward_fn

    assert clevr_count_70k_reward_fn("", completion, [], [], answer) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so x = [2\\sqrt{3}]", "2\\sqrt{3}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<think>...</think> \\boxed{7}", "[7]", 1.0),
        ("the answer is 12", "12", 1.0),  # last number fallback
        ("\\boxed{5}", "6", 0.0),
        ("", "6", 0.0),
    ],
)
def test_geometry3k_reward_fn_math_verify(completion, answer, expected):
    from areal.reward import geometry3k_reward_fn

    assert geometry3k_reward_fn("", completion, [], [], answer) == expected


def test_get_custom_reward_fn_by_dataset_name():
    from areal.reward import get_custom_reward_fn
    from areal.reward.geometry3k import geometry3k_reward_fn

    assert get_custom_reward_fn("/data/geometry3k") is geometry3k_reward_fn
    with pytest.raises(ValueError, match="supported"):
        get_custom_reward_fn("/data/gsm8k")


# ----------------------------------------------------------------------------- processor
def test_qwen_vl_processor_expands_image_tokens_and_checks_counts():
    from PIL import Image

    from areal.models.tiny_vlm import build_tiny_vlm_processor

    proc = build_tiny_vlm_processor()
    img = Image.new("RGB", (84, 84))
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    enc = proc(text=[text], images=[img])
    assert int((enc["input_ids"] == proc.image_token_id).sum()) == 9
    assert enc["pixel_values"].shape == (36, 3 * 2 * 14 * 14)
    assert enc["mm_token_type_ids"].sum() == 9
    with pytest.raises(ValueError, match="placeholders"):
        proc(text=[text], images=[img, img])


# ----------------------------------------------------------------------------- requests
def _call():
    from areal.api.inference_protocol import HttpCall

    return HttpCall("/generate", {"input_ids": [1, 2, 3], "sampling_params": {}})


def test_local_and_sglang_image_requests_carry_base64_image_data():
    from areal.inference.clients.local import LocalBackend
    from areal.inference.clients.sglang import SGLangBackend
    from areal.utils.vlm import load_image

    png = _png()
    for backend in (LocalBackend(), SGLangBackend()):
        call = backend.with_images(_call(), [png, "data:image/png;base64,QUJD"], None)
        assert call.path == "/generate" and call.payload["input_ids"] == [1, 2, 3]
        data = call.payload["image_data"]
        assert data[1] == "QUJD"
        assert load_image(data[0]).getpixel((0, 0)) == (255, 0, 0)


def test_vllm_image_request_is_chat_completion_with_data_urls():
    from areal.api.inference_protocol import GenParams
    from areal.inference.clients.vllm import VLLMBackend, parse_chat_completion

    be = VLLMBackend()
    call = be.generate_call(
        "r1",
        [1, 2, 3],
        GenParams(
            max_new_tokens=5,
            min_new_tokens=0,
            temperature=0.7,
            top_p=1.0,
            top_k=-1,
            greedy=False,
            stop_token_ids=[],
            ignore_eos=False,
        ),
    )
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": ""}},
                {"type": "text", "text": "n?"},
            ],
        }
    ]
    chat = be.with_images(call, [_png()], msgs)
    assert chat.path == "/v1/chat/completions"
    p = chat.payload
    assert "prompt" not in p and p["max_tokens"] == 5 and p["temperature"] == 0.7
    assert p["logprobs"] is True and p["return_tokens_as_token_ids"] is True
    part = p["messages"][0]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith(
        "data:image/png;base64,"
    )
    assert msgs[0]["content"][0]["image_url"]["url"] == ""  # caller's messages untouched
    with pytest.raises(ValueError, match="vision_msg_vllm"):
        be.with_images(call, [_png()], None)
    with pytest.raises(ValueError, match="2 images"):
        be.with_images(call, [_png(), _png()], msgs)
    resp = {
        "object": "chat.completion",
        "choices": [
            {
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {"token": "token_id:17", "logprob": -0.5},
                        {"token": "token_id:2", "logprob": -0.25},
                    ]
                },
            }
        ],
    }
    chunk = be.parse_generate(resp)
    assert chunk.tokens == [17, 2] and chunk.logprobs == [-0.5, -0.25]
    assert parse_chat_completion(resp).stop_reason == chunk.stop_reason == "stop"
