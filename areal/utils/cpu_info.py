"""What kind of CPU this is: its model name and the vector/matrix extensions that decide
which kernels torch runs (AVX2, AVX-512, AVX-512 BF16, AMX). Benchmarks print it next to
their figures, since a throughput ratio measured on one kind does not carry to another."""

from __future__ import annotations

import platform

# /proc/cpuinfo flag names of the extensions that change torch's CPU kernels
EXTENSIONS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip
# the extensions with bf16 matrix instructions: without one of them torch's CPU bf16
# matmul converts element by element (measured on AVX2 + FMA only: ~60x slower than fp32)
BF16_MATMUL_EXTENSIONS = ("avx512_bf16", "amx_bf16")


def cpu_kind(cpuinfo: str | None = None) -> dict:
    """``{"model", "extensions", "torch_capability", "bf16_matmul_fast"}`` for this
    machine (or for the given ``/proc/cpuinfo`` text). ``torch_capability`` is the kernel
    set torch dispatches to (e.g. ``AVX2``, ``AVX512``); ``bf16_matmul_fast`` says whether
    the CPU has bf16 matrix instructions (AVX-512 BF16 or AMX-BF16), the only CPUs where a
    bf16 path can beat fp32."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or "unknown", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        capability = None
    return {
        "model": model,
        "extensions": [e for e in EXTENSIONS if e in flags],
        "torch_capability": capability,
        "bf16_matmul_fast": any(e in flags for e in BF16_MATMUL_EXTENSIONS),
    }


def describe(kind: dict) -> str:
    """One line for a benchmark's output: ``AMD EPYC (avx2 fma; torch AVX2; bf16 slow)``."""
    ext = " ".join(kind["extensions"]) or "no AVX2/AVX-512/AMX"
    bf16 = "bf16 fast" if kind["bf16_matmul_fast"] else "bf16 slow"
    return f"{kind['model']} ({ext}; torch {kind['torch_capability']}; {bf16})"
