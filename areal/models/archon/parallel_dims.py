"""``ArchonParallelDims``: the sizes of the archon engine's parallel dimensions and the
``DeviceMesh`` built from them.

Dimensions (AReaL's names): ``dp_shard`` (FSDP data-parallel shard), ``cp`` (context,
Ulysses sequence parallel), ``tp`` (tensor), ``pp`` (pipeline), ``ep`` (expert), ``etp``
(expert tensor, 1 or ``tp``: with ``tp`` each expert's hidden dimension is split over
the tensor ranks, and ``ep`` comes from ``dp_shard``); ``dp_replicate`` (HSDP) must be 1. The mesh is
``(pp, dp_shard, cp, tp)`` with the flattened ``dp_shard_cp`` dimension that FSDP shards
over (context-parallel ranks hold different tokens of the same sequences, so their
gradients are reduced like data-parallel ones). With expert parallelism ``dp_shard`` is
split as ``(dp_mod_ep, ep)``: the mesh is ``(pp, dp_mod_ep, ep, cp, tp)``, ``dp_shard``
and ``dp_shard_cp`` are flattened from it, and the experts are FSDP-sharded over
``efsdp`` = ``(dp_mod_ep, cp)`` (the ranks that hold the same experts).

The MoE hybrid form (``archon:(attn:d2t2|ffn:d2e2)``, ``ep_spans_cp_tp=True``) is
torchtitan's etp=1 layout: the ``ep`` ranks take every context and tensor rank and the
rest from ``dp_shard``. The mesh is ``(pp, dp_mod_ep, dp_in_ep, cp, tp)`` with
``dp_mod_ep = dp_shard*cp*tp/ep`` and ``dp_in_ep = ep/(cp*tp)``; ``ep`` is flattened from
``(dp_in_ep, cp, tp)`` and the experts are FSDP-sharded over ``efsdp`` = ``dp_mod_ep``
(the hybrid form's ffn ``d``). The attention layers keep ``(pp, dp_shard, cp, tp)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ArchonParallelDims"]

_MESH_DIMS = ("pp", "dp_shard", "cp", "tp")


@dataclass
class ArchonParallelDims:
    """Sizes of the parallel dimensions; ``dp_shard=-1`` takes what the others leave."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int = 1
    device_type: str = "cuda"
    ep_spans_cp_tp: bool = False  # the MoE hybrid form: ep borrows the cp and tp ranks
    _world_mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ArchonParallelDims.{name}={value!r}; must be an int >= 1")
        if self.dp_replicate != 1:
            raise ValueError(
                f"ArchonParallelDims.dp_replicate={self.dp_replicate}: HSDP replication is not "
                "supported; allowed: 1"
            )
        others = self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"ArchonParallelDims: world_size={self.world_size} is not divisible by "
                    f"cp*tp*pp={others}"
                )
            self.dp_shard = self.world_size // others
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"ArchonParallelDims.dp_shard={self.dp_shard!r}; must be -1 or >= 1")
        if self.dp_shard * others != self.world_size:
            raise ValueError(
                f"ArchonParallelDims: dp_shard*cp*tp*pp = {self.dp_shard}*{self.cp}*{self.tp}"
                f"*{self.pp} = {self.dp_shard * others} != world_size={self.world_size}"
            )
        if self.etp not in (1, self.tp):
            raise ValueError(f"ArchonParallelDims.etp={self.etp}; allowed: 1 or tp={self.tp}")
        if self.etp > 1 and self.ep_spans_cp_tp:
            raise ValueError(
                f"ArchonParallelDims.etp={self.etp} with ep_spans_cp_tp=True: the tensor "
                "ranks cannot both split the experts (ep) and each expert (etp); allowed: "
                "etp=1, or ep_spans_cp_tp=False"
            )
        if self.etp > 1 and self.ep > 1 and self.dp_shard // self.ep * self.cp > 1:
            raise ValueError(
                f"ArchonParallelDims.etp={self.etp} with ep={self.ep}: experts split over "
                f"ep and tp cannot also be FSDP-sharded (dp_shard/ep*cp = "
                f"{self.dp_shard // self.ep * self.cp}); allowed: ep = dp_shard with cp=1, or ep=1"
            )
        if self.ep_spans_cp_tp:
            ct, ranks = self.cp * self.tp, self.dp_shard * self.cp * self.tp
            if self.ep % ct or ranks % self.ep:
                allowed = [e for e in range(ct, ranks + 1, ct) if ranks % e == 0]
                raise ValueError(
                    f"ArchonParallelDims.ep={self.ep} (hybrid form: ep takes the cp*tp={ct} "
                    f"ranks and divides dp_shard*cp*tp={ranks}); allowed ep: {allowed}"
                )
        elif self.ep > 1 and self.dp_shard % self.ep:
            raise ValueError(
                f"ArchonParallelDims.ep={self.ep} must divide dp_shard={self.dp_shard} (experts "
                f"are split over data-parallel ranks); allowed ep: "
                f"{[d for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0]}"
            )

    # ---- mesh
    def build_mesh(self) -> DeviceMesh:
        """The ``(pp, dp_shard, cp, tp)`` mesh plus ``dp_shard_cp`` (needs the default group);
        ``(pp, dp_mod_ep, ep, cp, tp)`` plus ``dp_shard``, ``dp_shard_cp``, ``efsdp`` when ep > 1."""
        if self.ep > 1 and self.ep_spans_cp_tp:
            ct = self.cp * self.tp
            mesh = init_device_mesh(
                self.device_type,
                (self.pp, self.dp_shard * ct // self.ep, self.ep // ct, self.cp, self.tp),
                mesh_dim_names=("pp", "dp_mod_ep", "dp_in_ep", "cp", "tp"),
            )
            self._flat = {
                "dp_shard": mesh["dp_mod_ep", "dp_in_ep"]._flatten("dp_shard"),
                "dp_shard_cp": mesh["dp_mod_ep", "dp_in_ep", "cp"]._flatten("dp_shard_cp"),
                "ep": mesh["dp_in_ep", "cp", "tp"]._flatten("ep"),
                "efsdp": mesh["dp_mod_ep"]._flatten("efsdp"),
            }
            self._world_mesh = mesh
            return mesh
        if self.ep > 1:
            mesh = init_device_mesh(
                self.device_type,
                (self.pp, self.dp_shard // self.ep, self.ep, self.cp, self.tp),
                mesh_dim_names=("pp", "dp_mod_ep", "ep", "cp", "tp"),
            )
            self._flat = {
                "dp_shard": mesh["dp_mod_ep", "ep"]._flatten("dp_shard"),
                "dp_shard_cp": mesh["dp_mod_ep", "ep", "cp"]._flatten("dp_shard_cp"),
                "efsdp": mesh["dp_mod_ep", "cp"]._flatten("efsdp"),
            }
            self._world_mesh = mesh
            return mesh
        mesh = init_device_mesh(
            self.device_type,
            (self.pp, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=_MESH_DIMS,
        )
        self._flat = {"dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp")}
        self._world_mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._world_mesh is None:
            self.build_mesh()
        return self._world_mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A named 1-D sub-mesh: 'pp', 'dp_shard', 'cp', 'tp', 'dp_shard_cp'; with ep > 1
        also 'ep', 'dp_mod_ep' and 'efsdp'."""
        mesh = self.world_mesh
        return self._flat[name] if name in self._flat else mesh[name]

    def get_group(self, name: str) -> dist.ProcessGroup:
        return self.get_mesh(name).get_group()

    # ---- what is on
    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """How many ranks FSDP-shard each expert: dp_shard / ep * cp (hybrid form:
        dp_shard * cp * tp / ep)."""
        if self.ep_spans_cp_tp:
            return self.dp_shard * self.cp * self.tp // self.ep
        return self.dp_shard // self.ep * self.cp

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def seq_len_divisor(self) -> int:
        """A packed micro-batch is padded to a multiple of this (each cp rank an equal part)."""
        return self.cp

    @property
    def context_and_model_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp
