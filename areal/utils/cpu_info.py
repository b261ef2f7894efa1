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


def cpu_compute_dtype(setting: str, requested: str = "float32", kind: dict | None = None):
    """The torch dtype a CPU training engine computes in, from ``cpu_compute_dtype``
    (``'float32'`` / ``'bfloat16'`` / ``'auto'``): ``'auto'`` is bfloat16 only where
    ``kind`` (default: this machine's) says bf16 matmuls are fast. Master weights,
    gradients' reduction and optimizer states stay float32 either way; ``requested`` is
    the engine's ``dtype`` field, which on CPU is only reported."""
    import torch

    from areal.utils import logging

    logger = logging.getLogger("CPUInfo")
    if setting not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"cpu_compute_dtype={setting!r}; allowed: 'float32', 'bfloat16', 'auto'")
    if setting != "float32" and kind is None:
        kind = cpu_kind()
    if setting == "auto":
        setting = "bfloat16" if kind["bf16_matmul_fast"] else "float32"
        logger.info("cpu_compute_dtype=auto on %s: %s", describe(kind), setting)
    if setting == "bfloat16":
        if not kind["bf16_matmul_fast"]:
            logger.warning(
                "cpu_compute_dtype=bfloat16 on a CPU without AVX-512-BF16/AMX-BF16 (%s): "
                "bf16 matmuls are much slower than float32 here",
                describe(kind),
            )
        return torch.bfloat16
    if requested != "float32":
        logger.info(
            "dtype=%s requested; training in float32 on CPU (cpu_compute_dtype=float32)",
            requested,
        )
    return torch.float32
