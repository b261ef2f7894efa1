"""The qwen2 archon family: args, model, state-dict adapter, parallelize function, spec."""

from areal.models.archon.qwen2.args import Qwen2ModelArgs
from areal.models.archon.qwen2.model import Qwen2Model
from areal.models.archon.qwen2.parallelize import parallelize_qwen2
from areal.models.archon.qwen2.spec import QWEN2_SPEC
from areal.models.archon.qwen2.state_dict_adapter import Qwen2StateDictAdapter

__all__ = [
    "QWEN2_SPEC",
    "Qwen2Model",
    "Qwen2ModelArgs",
    "Qwen2StateDictAdapter",
    "parallelize_qwen2",
]
