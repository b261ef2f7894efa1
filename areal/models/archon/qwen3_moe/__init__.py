"""The qwen3_moe archon family: args, model, state-dict adapter, parallelize function, spec."""

from areal.models.archon.qwen3_moe.args import Qwen3MoeModelArgs
from areal.models.archon.qwen3_moe.model import Qwen3MoeModel
from areal.models.archon.qwen3_moe.parallelize import parallelize_qwen3_moe
from areal.models.archon.qwen3_moe.spec import QWEN3_MOE_SPEC
from areal.models.archon.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

__all__ = [
    "QWEN3_MOE_SPEC",
    "Qwen3MoeModel",
    "Qwen3MoeModelArgs",
    "Qwen3MoeStateDictAdapter",
    "parallelize_qwen3_moe",
]
