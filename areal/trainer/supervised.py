"""``SupervisedTrainer``: the lifecycle shared by ``SFTTrainer``, ``RWTrainer`` and ``DPOTrainer``.

Construction, in order:

1. :func:`~areal.trainer.common.setup_run`: hub paths resolved, seeds, the log directory
   (with ``config.yaml``), tokenizer, the train dataloader and the ``FinetuneSpec``;
2. the allocation mode: ``config.allocation_mode``, else the engine config's backend,
   else ``fsdp:d1``;
3. the validation dataloader (when a validation set and its config are given);
4. the scheduler and the trained model's controller (``controller_class`` driving
   workers of ``engine_class``), initialized on its workers as ``role`` with the
   subclass's extra ``_init_kwargs()``; a failure here tears down what was started and
   re-raises;
5. saver, evaluator, stats logger, recover handler.

``train()`` (subclasses) runs :func:`~areal.trainer.common.run_step_loop` on
``self.controller``; ``close()`` (also on leaving the ``with`` block) destroys the
controller, deletes the workers and closes the stats logger, once.
"""

from __future__ import annotations

from typing import Any

from areal.api.alloc_mode import AllocationMode
from areal.api.io_struct import SaveLoadMeta
from areal.infra.controller.train_controller import TrainController
from areal.trainer.common import attach_services, make_scheduler, setup_run, teardown_run
from areal.trainer.engine_select import select_engine
from areal.utils.dataloader import create_dataloader

__all__ = ["SupervisedTrainer"]


class SupervisedTrainer:
    """Base of the one-model trainers (see the module docstring).

    Subclass hooks: ``role`` (the workers' role name), ``engine_class`` (import path of
    the workers' engine, e.g. ``areal.trainer.sft.lm_engine.FSDPLMEngine``),
    ``controller_class``, ``_engine_config()`` (the trained model's engine config) and
    ``_init_kwargs()``.
    """

    role = "model"
    engine_class: str
    controller_class: type[TrainController] = TrainController

    def __init__(self, config: Any, train_dataset: Any, valid_dataset: Any = None):
        self.config = config
        self._closed = False
        engine_config = self._engine_config()
        run = setup_run(config, train_dataset, model_path=engine_config.path)
        self.log_dir, self.tokenizer = run.log_dir, run.tokenizer
        self.train_dataloader, self.ft_spec = run.train_dataloader, run.ft_spec
        self.alloc_mode = AllocationMode.from_str(
            config.allocation_mode or (engine_config.backend or "fsdp:d1")
        )
        self.train_dataset = train_dataset
        self.valid_dataset = valid_dataset
        self.valid_dataloader = (
            create_dataloader(valid_dataset, config.valid_dataset, seed=config.seed)
            if valid_dataset is not None and config.valid_dataset is not None
            else None
        )
        self.controller: TrainController | None = None
        try:
            self.scheduler = make_scheduler(config)
            engine_class = select_engine(self.engine_class, engine_config, self.alloc_mode)
            self.controller = self.controller_class(engine_class, engine_config, self.scheduler)
            self.controller.initialize(
                role=self.role,
                alloc_mode=self.alloc_mode,
                ft_spec=self.ft_spec,
                seed=config.seed,
                **self._init_kwargs(),
            )
        except BaseException:
            self.close()
            raise
        attach_services(self, config, self.ft_spec)

    # ------------------------------------------------------------------ hooks
    def _engine_config(self) -> Any:
        raise NotImplementedError

    def _init_kwargs(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        teardown_run(self, ("controller",))

    def save_hf(self, path: str) -> None:
        """The trained model as a Hugging Face checkpoint (with the tokenizer) at ``path``."""
        self.controller.save(SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer))
