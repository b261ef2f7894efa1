"""A trainer's agent wiring: agents become rollout workflows through one proxy.

``PPOTrainer`` owns one :class:`TrainerAgentProxy`. ``wrap(workflow, kwargs)`` returns
rollout workflows unchanged and wraps an agent (an object, class or import string with
``async def run(data, **extra_kwargs)``) in an :class:`OpenAIProxyWorkflow` that talks to
the proxy; the proxy (:class:`ProxyServer`, in front of an :class:`ArealOpenAI` client of
the rollout engine) is started on first use, in the trainer's process, and stopped by
``stop()``; with ``rollout.agent.proxy_workers = N > 0`` it is instead N proxy worker
processes started by the trainer's scheduler (role ``proxy``) behind one gateway
(``areal.experimental.openai.proxy.gateway``), whose address the workflows use. In online mode (``rollout.agent.mode='online'``) the training workflow is
always the online one, and ``online_dataset`` gives the empty rows that stand for the
episode slots external clients fill. With ``rollout._version='v2'`` (AReaL 2.0's v2
inference gateway) the proxy behaves as that gateway: ``/rl/start_session`` answers 201
and the admin key is ``rollout.admin_api_key``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal.experimental.openai.proxy.gateway import start_proxy_gateway
from areal.experimental.openai.proxy.workflow import OpenAIProxyWorkflow, is_agent
from areal.utils import logging
from areal.utils.dynamic_import import import_from_string

logger = logging.getLogger("TrainerAgentProxy")


def online_dataset(config: Any) -> list[dict[str, Any]]:
    """Online mode: empty rows (one per episode slot); episodes come from external clients.

    ``config``: the ``PPOConfig``. As in AReaL, a training step takes
    ``train_dataset.batch_size`` rows and each row is run ``gconfig.n_samples`` times,
    so one step consumes ``train_dataset.batch_size * gconfig.n_samples`` finished
    sessions; an epoch is ``total_train_steps / total_train_epochs`` steps (rounded up,
    so all ``total_train_steps`` run), and ``total_train_steps`` is required (there is
    no dataset to end the run).
    Raises ``ValueError`` outside online mode: a dataset is then required."""
    if config.rollout.agent.mode != "online":
        raise ValueError(
            "PPOTrainer needs a train_dataset unless rollout.agent.mode='online' "
            f"(it is {config.rollout.agent.mode!r})"
        )
    if config.total_train_steps is None:
        raise ValueError(
            "rollout.agent.mode='online' without a train_dataset needs total_train_steps"
        )
    epochs = max(1, int(config.total_train_epochs or 1))
    per_epoch = max(1, -(-int(config.total_train_steps) // epochs))
    return [{} for _ in range(per_epoch * config.train_dataset.batch_size)]


class TrainerAgentProxy:
    """The proxy of one trainer's agent workflows (module doc).

    ``rollout_config``: the trainer's ``InferenceEngineConfig`` (``agent`` settings,
    ``request_timeout``); ``rollout``: the inference engine the proxy's client generates
    with; ``tokenizer``: its tokenizer."""

    def __init__(self, rollout_config: Any, rollout: Any, tokenizer: Any, scheduler: Any = None):
        self.rollout_config = rollout_config
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # starts the proxy workers when agent.proxy_workers > 0
        self.server: Any = None

    @property
    def v2(self) -> bool:
        """AReaL 2.0's v2 inference gateway is named (``rollout._version='v2'``)."""
        return self.rollout_config._version == "v2"

    def agent_config(self) -> Any:
        """``rollout.agent``; under v2 with ``rollout.admin_api_key`` as its admin key."""
        cfg = self.rollout_config.agent
        if self.v2:
            cfg = dataclasses.replace(cfg, admin_api_key=self.rollout_config.admin_api_key)
        return cfg

    @property
    def base_url(self) -> str | None:
        """The proxy's base URL (None until an agent workflow starts it)."""
        return None if self.server is None else self.server.base_url

    def wrap(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, for_eval: bool = False
    ) -> tuple[Any, dict[str, Any] | None]:
        """``(workflow, kwargs)`` to run: an agent wrapped in ``OpenAIProxyWorkflow`` (the
        agent class instantiated with ``workflow_kwargs``), anything else unchanged."""
        cfg = self.agent_config()
        online = cfg.mode == "online" and not for_eval
        agent = None
        if not online:
            obj = import_from_string(workflow) if isinstance(workflow, str) else workflow
            if not is_agent(obj):
                return workflow, workflow_kwargs
            agent = obj(**(workflow_kwargs or {})) if isinstance(obj, type) else obj
        elif workflow is not None:
            logger.warning("rollout.agent.mode='online': train(workflow=...) is ignored")
        mode = "online" if online else ("inline" if cfg.mode == "online" else cfg.mode)
        wf = OpenAIProxyWorkflow(
            mode=mode,
            agent=agent,
            proxy_addr=self.ensure_started(),
            admin_api_key=cfg.admin_api_key,
            discount=cfg.turn_discount,
            export_style=cfg.export_style,
            subproc_max_workers=cfg.subproc_max_workers,
            request_timeout=self.rollout_config.request_timeout,
        )
        return wf, None

    def ensure_started(self) -> str:
        """Start the proxy (once) in this process, in front of the rollout engine; with
        ``agent.proxy_workers > 0``, that many proxy workers behind a gateway instead."""
        cfg = self.agent_config()
        status = 201 if self.v2 else 200
        if self.server is None and cfg.proxy_workers > 0:
            self.server = start_proxy_gateway(
                self.scheduler,
                cfg,
                list(self.rollout.addresses),
                self.tokenizer.name_or_path,
                request_timeout=self.rollout_config.request_timeout,
                setup_timeout=self.rollout_config.setup_timeout,
                start_session_status=status,
            )
        if self.server is None:
            # the OpenAI SDK and FastAPI/uvicorn: heavy, only for agent runs
            from areal.experimental.openai.client import ArealOpenAI
            from areal.experimental.openai.proxy.server import ProxyServer

            client = ArealOpenAI(
                self.rollout,
                self.tokenizer,
                tool_call_parser=cfg.tool_call_parser,
                reasoning_parser=cfg.reasoning_parser,
                engine_max_tokens=cfg.engine_max_tokens,
                chat_template_type=cfg.chat_template_type,
            )
            self.server = ProxyServer(
                client,
                admin_api_key=cfg.admin_api_key,
                host=cfg.proxy_host,
                port=cfg.proxy_port,
                session_timeout_seconds=cfg.session_timeout_seconds,
                capacity_control=cfg.mode == "online",
                start_session_status=status,
            ).start()
            logger.info(f"OpenAI-compatible proxy ({cfg.mode} mode) at {self.server.base_url}")
            if self.v2:  # the line AReaL 2.0's examples/hermes README tells users to look for
                logger.info(f"Proxy gateway available at {self.server.base_url}")
        return self.server.base_url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
