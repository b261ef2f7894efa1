"""The qwen3 archon family: args, model, state-dict adapter, parallelize function, spec."""

from areal.models.archon.qwen3.args import Qwen3ModelArgs
from areal.models.archon.qwen3.model import Qwen3Model
from areal.models.archon.qwen3.parallelize import parallelize_qwen3
from areal.models.archon.qwen3.spec import QWEN3_SPEC
from areal.models.archon.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = [
    "QWEN3_SPEC",
    "Qwen3Model",
    "Qwen3ModelArgs",
    "Qwen3StateDictAdapter",
    "parallelize_qwen3",
]
