"""Controllers: drive remote engines from the user's (controller) process."""

from areal.infra.controller.batch_ref import BatchRef
from areal.infra.controller.train_controller import TrainController, start_train_controller

__all__ = ["BatchRef", "TrainController", "start_train_controller"]
