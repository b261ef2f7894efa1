"""Synthetic CLEVR-style counting images (Pillow), for CPU-sized vision-language models.

Each row is an image of a few coloured shapes on a grey background and a counting
question about them, in the format of CLEVR-Count-70K (``problem`` with an ``<image>``
placeholder, ``answer`` a bare number, ``images`` a list of one image)::

    problem: "<image>How many red circles are there?"
    answer:  "2"

The model is asked to answer in brackets (``[2]``), which
:func:`areal.reward.clevr_count_70k.clevr_count_70k_reward_fn` checks.

Objects sit in distinct cells of a ``grid x grid`` layout (no overlaps, so the count is
always visible), with random size jitter and offsets inside their cell.

Spec (:class:`ClevrSpec`), written as a dataset path::

    synthetic://clevr?n=2000&seed=0&size=84&max_objects=6&max_count=4&query=color

- ``query``: what is counted: ``all`` ("How many objects are there?"), ``color``
  ("How many red objects ..."), ``shape`` ("How many circles ..."), ``color_shape``
  ("How many red circles ...", CLEVR's kind of question).
- ``colors`` / ``shapes``: comma-separated subsets of :data:`COLORS` / :data:`SHAPES`.
- ``size``: image side in pixels (a multiple of 28 keeps Qwen2-VL's patching exact).

Generation is a pure function of (spec, split): every process gets the same rows, and the
splits ``train`` / ``test`` / ... are independent streams.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (150, 60, 190),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle")
QUERIES = ("all", "color", "shape", "color_shape")
CLEVR_SCHEME = "synthetic://clevr"
# The instruction appended to every question (the reward reads the bracketed number).
CLEVR_PROMPT_SUFFIX = " Answer with the number in brackets."


@dataclass(frozen=True)
class ClevrSpec:
    """Size and difficulty of a synthetic counting dataset (see module docstring)."""

    n: int = 2000
    seed: int = 0
    size: int = 84
    grid: int = 3
    min_objects: int = 1
    max_objects: int = 6
    max_count: int = 4
    query: str = "color"
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow")
    shapes: tuple[str, ...] = SHAPES

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"synthetic clevr n={self.n}; must be >= 1")
        if self.size < 28 or self.size > 1024:
            raise ValueError(f"synthetic clevr size={self.size}; must be in [28, 1024]")
        if self.grid < 1 or self.grid > 8:
            raise ValueError(f"synthetic clevr grid={self.grid}; must be in [1, 8]")
        if not 1 <= self.min_objects <= self.max_objects <= self.grid * self.grid:
            raise ValueError(
                f"synthetic clevr min_objects={self.min_objects}, max_objects="
                f"{self.max_objects}; need 1 <= min_objects <= max_objects <= grid*grid "
                f"({self.grid * self.grid})"
            )
        if not 1 <= self.max_count <= self.max_objects:
            raise ValueError(
                f"synthetic clevr max_count={self.max_count}; must be in [1, max_objects="
                f"{self.max_objects}]"
            )
        if self.query not in QUERIES:
            raise ValueError(f"synthetic clevr query={self.query!r}; allowed: {list(QUERIES)}")
        if not self.colors or any(c not in COLORS for c in self.colors):
            raise ValueError(
                f"synthetic clevr colors={list(self.colors)}; must be a non-empty subset of "
                f"{list(COLORS)}"
            )
        if not self.shapes or any(s not in SHAPES for s in self.shapes):
            raise ValueError(
                f"synthetic clevr shapes={list(self.shapes)}; must be a non-empty subset of "
                f"{list(SHAPES)}"
            )


def is_clevr_path(path: str) -> bool:
    """Whether ``path`` is a ``synthetic://clevr?...`` spec."""
    return isinstance(path, str) and (path == CLEVR_SCHEME or path.startswith(CLEVR_SCHEME + "?"))


def parse_clevr_path(path: str) -> ClevrSpec:
    """``synthetic://clevr?n=..&query=..`` -> :class:`ClevrSpec` (unknown keys are errors)."""
    if not is_clevr_path(path):
        raise ValueError(f"not a synthetic clevr path: {path!r} (expected {CLEVR_SCHEME}?...)")
    query = parse_qs(urlparse(path).query, keep_blank_values=True)
    fields = {f.name: f for f in dataclasses.fields(ClevrSpec)}
    kwargs: dict = {}
    for key, values in query.items():
        if key not in fields:
            raise ValueError(f"{path}: unknown key {key!r}; allowed: {sorted(fields)}")
        value = values[-1]
        try:
            if key in ("colors", "shapes"):
                kwargs[key] = tuple(v.strip() for v in value.split(",") if v.strip())
            elif key == "query":
                kwargs[key] = value
            else:
                kwargs[key] = int(value)
        except ValueError as e:
            raise ValueError(f"{path}: {key}={value!r} is not an integer") from e
    return ClevrSpec(**kwargs)


def _split_seed(spec: ClevrSpec, split: str) -> int:
    digest = hashlib.sha256(f"clevr|{spec.seed}|{split}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def draw_scene(objects: list[tuple[str, str, int]], size: int, grid: int, rng: random.Random):
    """A Pillow RGB image of ``objects`` = [(colour, shape, cell index), ...]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    cell = size / grid
    for color, shape, idx in objects:
        r, c = divmod(idx, grid)
        side = cell * rng.uniform(0.55, 0.8)
        x0 = c * cell + rng.uniform(0, cell - side)
        y0 = r * cell + rng.uniform(0, cell - side)
        box = (x0, y0, x0 + side, y0 + side)
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    return img


def _scene(spec: ClevrSpec, rng: random.Random) -> tuple[list, str, int]:
    """Objects [(colour, shape, cell)], the question and its answer.

    The answer is drawn uniformly from 1..max_count first (so counts are balanced), then
    that many matching objects and some distractors that do not match are placed."""
    color, shape = rng.choice(spec.colors), rng.choice(spec.shapes)
    if spec.query == "all":
        k = rng.randint(max(1, spec.min_objects), spec.max_count)
        objs = [(rng.choice(spec.colors), rng.choice(spec.shapes)) for _ in range(k)]
        question, distractors = "How many objects are there?", []
    else:
        k = rng.randint(1, spec.max_count)
        if spec.query == "color":
            match = lambda c, s: c == color  # noqa: E731
            question = f"How many {color} objects are there?"
        elif spec.query == "shape":
            match = lambda c, s: s == shape  # noqa: E731
            question = f"How many {shape}s are there?"
        else:
            match = lambda c, s: c == color and s == shape  # noqa: E731
            question = f"How many {color} {shape}s are there?"
        objs = []
        for _ in range(k):
            c = color if spec.query != "shape" else rng.choice(spec.colors)
            s = shape if spec.query != "color" else rng.choice(spec.shapes)
            objs.append((c, s))
        others = [(c, s) for c in spec.colors for s in spec.shapes if not match(c, s)]
        lo = max(0, spec.min_objects - k)
        hi = spec.max_objects - k if others else 0
        distractors = [rng.choice(others) for _ in range(rng.randint(min(lo, hi), hi))]
    items = objs + distractors
    cells = rng.sample(range(spec.grid * spec.grid), len(items))
    return [(c, s, cell) for (c, s), cell in zip(items, cells, strict=True)], question, k


def generate_clevr_rows(spec: ClevrSpec, split: str = "train") -> list[dict]:
    """``spec.n`` rows ``{"problem", "answer", "images"}`` (PIL images) for ``split``."""
    rng = random.Random(_split_seed(spec, split))
    rows = []
    for _ in range(spec.n):
        objects, question, count = _scene(spec, rng)
        image = draw_scene(objects, spec.size, spec.grid, rng)
        rows.append({"problem": "<image>" + question, "answer": str(count), "images": [image]})
    return rows
