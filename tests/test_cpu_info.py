"""areal.utils.cpu_info: the CPU kind that benchmarks print next to their figures."""

from areal.utils.cpu_info import cpu_kind, describe

AMX_HOST = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile avx512_fp16
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2
"""


def test_cpu_kind_reads_model_and_matrix_extensions_from_the_first_processor():
    kind = cpu_kind(AMX_HOST)
    assert kind["model"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert kind["extensions"] == [
        "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
        "amx_bf16",
    ]  # fmt: skip
    assert kind["bf16_matmul_fast"] is True
    assert kind["torch_capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NEON", "SVE256"}


def test_cpu_kind_without_avx512_lists_only_what_the_flags_name():
    kind = cpu_kind("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n")
    assert kind["model"] == "AMD EPYC" and kind["extensions"] == ["avx2", "fma"]
    assert kind["bf16_matmul_fast"] is False
    assert describe(kind).startswith("AMD EPYC (avx2 fma; torch ")
    assert describe(kind).endswith("; bf16 slow)")


def test_cpu_compute_dtype_auto_follows_the_cpu_kind_and_explicit_values_win():
    import pytest
    import torch

    from areal.utils.cpu_info import cpu_compute_dtype

    fast, slow = cpu_kind(AMX_HOST), cpu_kind("model name\t: X\nflags\t\t: avx2 fma\n")
    assert cpu_compute_dtype("auto", kind=fast) is torch.bfloat16
    assert cpu_compute_dtype("auto", kind=slow) is torch.float32
    assert cpu_compute_dtype("float32", requested="bfloat16", kind=fast) is torch.float32
    assert cpu_compute_dtype("bfloat16", kind=slow) is torch.bfloat16  # asked for: warned
    with pytest.raises(ValueError, match="cpu_compute_dtype='fp8'.*allowed"):
        cpu_compute_dtype("fp8", kind=fast)
