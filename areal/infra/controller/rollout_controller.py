"""``RolloutController``: inference servers started through a scheduler, driven from here.

What ``RemoteSGLangEngine.as_controller(config, scheduler)`` (and the vLLM / built-in
server engines) return, as in AReaL's evaluation tutorial::

    rollout = RemotevLLMEngine.as_controller(config.rollout, scheduler)
    rollout.initialize(role="eval-rollout", server_args=server_args)
    for item in rows:
        rollout.submit(item, workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=...)
    rollout.wait(len(rows), timeout=None)
    stats = rollout.export_stats()
    rollout.destroy()

``initialize`` starts ``dp`` server processes of role ``role`` through the scheduler (the
data-parallel size from ``config.backend``, e.g. ``"vllm:d2"``) with the command the
engine class builds from ``server_args`` (``engine_cls.build_server_command``), or
connects to running servers (``addresses=[...]``), then creates one client engine
(``engine_cls(config)``) in this process; the rollout methods delegate to it and to its
``WorkflowExecutor``. The engine class is passed in, so this module knows no backend.
"""

from __future__ import annotations

from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.utils import logging

logger = logging.getLogger("RolloutController")


class RolloutController:
    """Servers through a scheduler + one client engine in this process (module docstring)."""

    def __init__(
        self, inf_engine: type, config: InferenceEngineConfig, scheduler: Any = None
    ) -> None:
        self.inf_engine = inf_engine
        self.config = config
        self.scheduler = scheduler
        self.engine: Any = None
        self.role: str | None = None
        self.addresses: list[str] = []
        self._own_role = False

    # ------------------------------------------------------------------ lifecycle
    def initialize(
        self,
        role: str = "rollout",
        server_args: dict[str, Any] | None = None,
        addresses: list[str] | str | None = None,
        alloc_mode: Any = None,
        train_data_parallel_size: int | None = 1,
        **kwargs: Any,
    ) -> None:
        """Start (or connect to) the servers and create the client engine.

        ``alloc_mode``: a ``ModelAllocation``/``AllocationMode`` or a string like
        ``"vllm:d2"``; default ``config.backend``. ``server_args``: the flags of one
        server (e.g. ``vLLMConfig.build_args(...)``; must name the model).
        """
        self.role = role
        if addresses is None:
            if self.scheduler is None:
                raise ValueError("RolloutController.initialize: no scheduler and no addresses")
            if not server_args:
                raise ValueError(
                    "RolloutController.initialize: server_args (the flags of one server, with "
                    "the model) are required to start servers"
                )
            dp, instance = _sizes(alloc_mode if alloc_mode is not None else self.config.backend)
            specs = self.config.scheduling_spec or []
            gpus = instance if specs and int(getattr(specs[0], "gpu", 0) or 0) > 0 else 0
            command, env = self.inf_engine.build_server_command(dict(server_args))
            from areal.infra.scheduler.servers import launch_server_workers

            self._own_role = True
            self.addresses = launch_server_workers(
                self.scheduler,
                n_servers=dp,
                command=command,
                env=env,
                gpus_per_server=gpus,
                timeout=float(self.config.setup_timeout),
                role=role,
                placement=specs[0] if specs else None,
            )
        else:
            self.addresses = (
                [a.strip() for a in addresses.split(",") if a.strip()]
                if isinstance(addresses, str)
                else list(addresses)
            )
        self.engine = self.inf_engine(self.config)
        self.engine.initialize(
            addr=self.addresses, train_data_parallel_size=train_data_parallel_size
        )
        logger.info(
            "%s: %d %s server(s) at %s",
            role,
            len(self.addresses),
            self.engine.backend.name,
            self.addresses,
        )

    def destroy(self) -> None:
        if self.engine is not None:
            try:
                self.engine.destroy()
            finally:
                self.engine = None
        if self._own_role and self.scheduler is not None:
            try:
                self.scheduler.delete_workers(self.role)
            except Exception as e:  # noqa: BLE001 - teardown continues
                logger.warning("deleting the %r workers failed: %s", self.role, e)
            self._own_role = False

    def __enter__(self) -> RolloutController:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("RolloutController.initialize() was not called")
        return self.engine

    # ------------------------------------------------------------------ rollout
    def submit(
        self,
        data: Any,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Any = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> int:
        return self._engine().submit(
            data,
            workflow=workflow,
            workflow_kwargs=workflow_kwargs,
            should_accept_fn=should_accept_fn,
            group_size=group_size,
            task_id=task_id,
            is_eval=is_eval,
            reward_normalization=reward_normalization,
            drop_incomplete_group=drop_incomplete_group,
        )

    def wait(self, count: int, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._engine().wait(count, timeout=timeout, **kwargs)

    def rollout_batch(self, data: Any, workflow: Any = None, workflow_kwargs: Any = None, **kw):
        return self._engine().rollout_batch(data, workflow, workflow_kwargs, **kw)

    def prepare_batch(self, dataloader: Any, workflow: Any = None, workflow_kwargs=None, **kw):
        return self._engine().prepare_batch(dataloader, workflow, workflow_kwargs, **kw)

    async def agenerate(self, req: Any) -> Any:
        return await self._engine().agenerate(req)

    def pause(self) -> None:
        self._engine().pause()

    def resume(self) -> None:
        self._engine().resume()

    def set_version(self, version: int) -> None:
        self._engine().set_version(version)

    def get_version(self) -> int:
        return self._engine().get_version()

    def export_stats(self) -> dict[str, float]:
        return self._engine().export_stats()

    @property
    def staleness_manager(self) -> Any:
        return self._engine().staleness_manager

    def __getattr__(self, name: str) -> Any:
        # Anything else an engine offers (pause_generation, update_weights_from_disk, ...).
        if name.startswith("_") or self.__dict__.get("engine") is None:
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)


def _sizes(alloc: Any) -> tuple[int, int]:
    """(number of servers, GPUs per server) of an allocation or its string."""
    if isinstance(alloc, str):
        if not alloc:
            raise ValueError(
                "RolloutController: config.backend is empty; set rollout.backend (e.g. "
                "'vllm:d1') or pass alloc_mode="
            )
        from areal.api.alloc_mode import AllocationMode

        alloc = AllocationMode.from_str(alloc)
    par = getattr(alloc, "gen", None) or getattr(alloc, "parallel", None)
    if par is None:
        raise ValueError(f"allocation {alloc!r} names no inference servers")
    return int(par.dp_size), int(par.tp_size) * int(par.pp_size)
