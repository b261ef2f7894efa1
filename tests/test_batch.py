import asyncio

import pytest
import torch

from areal.utils.batch import concat_padded_tensors, pad_sequences_to_tensors
from areal.utils.dynamic_import import import_from_string
from areal.workflow.grouped import GroupedRolloutWorkflow


def test_concat_padded_tensors_pads_versions_minus_one_and_others_zero():
    a = dict(
        input_ids=torch.tensor([[1, 2, 3]]),
        versions=torch.tensor([[-1, 0, 0]]),
        rewards=torch.tensor([1.0]),
        tag=["a"],
    )
    b = dict(
        input_ids=torch.tensor([[4, 5, 6, 7, 8]]),
        versions=torch.tensor([[-1, -1, 1, 1, 1]]),
        rewards=torch.tensor([0.0]),
        tag=["b"],
    )
    out = concat_padded_tensors([a, b])
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert out["versions"].tolist() == [[-1, 0, 0, -1, -1], [-1, -1, 1, 1, 1]]
    assert out["rewards"].tolist() == [1.0, 0.0]
    assert out["tag"] == ["a", "b"]
    out = concat_padded_tensors([a, b], pad_value=9, pad_values={"versions": -7})
    assert out["input_ids"][0, 3:].tolist() == [9, 9]
    assert out["versions"][0, 3:].tolist() == [-7, -7]


def test_concat_padded_tensors_mismatched_keys_raise_value_error():
    with pytest.raises(ValueError, match="keys"):
        concat_padded_tensors([{"a": torch.ones(1, 2)}, {"b": torch.ones(1, 2)}])
    assert concat_padded_tensors([]) == {}


def test_pad_sequences_to_tensors_pads_and_stacks_scalars():
    out = pad_sequences_to_tensors(
        [dict(ids=[1, 2], versions=[-1, 3], r=1.0), dict(ids=[4], versions=[-1], r=0.5)],
        dtypes={"ids": torch.long, "versions": torch.long},
    )
    assert out["ids"].tolist() == [[1, 2], [4, 0]]
    assert out["versions"].tolist() == [[-1, 3], [-1, -1]]
    assert out["r"].tolist() == [1.0, 0.5]


def test_import_from_string_resolves_and_reports_missing():
    assert import_from_string("areal.utils.batch.concat_padded_tensors") is concat_padded_tensors
    with pytest.raises(ImportError, match="no attribute"):
        import_from_string("areal.utils.batch.nope")
    with pytest.raises(ValueError):
        import_from_string("nodots")


def test_grouped_workflow_concatenates_and_drops_none_members():
    class WF:
        def __init__(self):
            self.n = 0

        async def arun_episode(self, engine, data):
            self.n += 1
            if self.n == 2:
                return None
            return dict(
                input_ids=torch.ones(1, self.n, dtype=torch.long),
                rewards=torch.tensor([float(self.n)]),
            )

    out = asyncio.run(GroupedRolloutWorkflow(WF(), 3).arun_episode(None, {}))
    assert out["input_ids"].shape == (2, 3)
    assert sorted(out["rewards"].tolist()) == [1.0, 3.0]

    class NoneWF:
        async def arun_episode(self, engine, data):
            return None

    assert asyncio.run(GroupedRolloutWorkflow(NoneWF(), 2).arun_episode(None, {})) is None
    with pytest.raises(ValueError, match="group_size"):
        GroupedRolloutWorkflow(NoneWF(), 0)
