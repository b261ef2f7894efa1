"""Controllers: drive remote engines from the user's (controller) process."""

from areal.infra.controller.train_controller import TrainController

__all__ = ["TrainController"]
