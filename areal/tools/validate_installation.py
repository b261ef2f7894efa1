"""Check what this installation of areal can do: ``python -m areal.tools.validate_installation``.

Prints one line per check (``OK``, ``MISSING`` or ``FAIL``) and exits nonzero when a
required piece (Python, torch, transformers, the tiny model) fails. Optional backends and
extras that are not installed are reported as ``MISSING`` and do not change the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass

REQUIRED_MODULES = ("torch", "transformers", "safetensors", "omegaconf", "math_verify")
OPTIONAL_MODULES = (
    "ray",
    "vllm",
    "sglang",
    "openai",
    "agents",
    "swanlab",
    "trackio",
    "tensorboard",
    "wandb",
    "aiohttp",
    "fastapi",
)
MIN_PYTHON = (3, 10)


@dataclass
class Check:
    name: str
    status: str  # OK | MISSING | FAIL
    detail: str
    required: bool


def check_module(name: str, required: bool) -> Check:
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == name.split(".")[0]:
            return Check(name, "MISSING", "not installed", required)
        return Check(name, "FAIL", f"import error: {exc}", required)
    except Exception as exc:  # a broken install of an existing package
        return Check(name, "FAIL", f"{type(exc).__name__}: {exc}", required)
    return Check(name, "OK", str(getattr(mod, "__version__", "unknown version")), required)


def check_python() -> Check:
    ok = sys.version_info[:2] >= MIN_PYTHON
    version = ".".join(map(str, sys.version_info[:3]))
    want = ".".join(map(str, MIN_PYTHON))
    return Check("python", "OK" if ok else "FAIL", f"{version} (need >= {want})", True)


def check_cuda() -> Check:
    try:
        import torch
    except Exception as exc:
        return Check("cuda", "FAIL", f"torch unavailable: {exc}", False)
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return Check("cuda", "OK", f"{len(names)} device(s): {', '.join(names)}", False)
    return Check("cuda", "MISSING", "no CUDA device (CPU only)", False)


def check_tiny_model(max_new_tokens: int = 4) -> Check:
    start = time.perf_counter()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from areal.models.tiny import get_tiny_base_path

        path = get_tiny_base_path()
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        model.eval()
        ids = tok("1+1=", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            )
        new = out.shape[1] - ids.shape[1]
        if new != max_new_tokens:
            return Check(
                "tiny_model", "FAIL", f"generated {new} tokens, want {max_new_tokens}", True
            )
    except Exception as exc:
        return Check("tiny_model", "FAIL", f"{type(exc).__name__}: {exc}", True)
    ms = (time.perf_counter() - start) * 1000
    return Check("tiny_model", "OK", f"loaded and generated {new} tokens in {ms:.0f} ms", True)


def run_checks(skip_model: bool = False) -> list[Check]:
    checks = [check_python()]
    checks += [check_module(m, True) for m in REQUIRED_MODULES]
    checks += [check_module(m, False) for m in OPTIONAL_MODULES]
    checks.append(check_cuda())
    if not skip_model:
        checks.append(check_tiny_model())
    return checks


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal.tools.validate_installation")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--skip-model", action="store_true", help="skip the tiny-model check")
    args = parser.parse_args(argv)
    checks = run_checks(skip_model=args.skip_model)
    failed = [c for c in checks if c.required and c.status != "OK"]
    if args.json:
        _out(json.dumps({"checks": [asdict(c) for c in checks], "ok": not failed}, indent=2))
    else:
        for c in checks:
            kind = "required" if c.required else "optional"
            _out(f"{c.status:<8} {c.name:<14} [{kind}] {c.detail}")
        _out(
            "RESULT: "
            + ("OK" if not failed else "FAIL (" + ", ".join(c.name for c in failed) + ")")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
