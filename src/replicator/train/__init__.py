"""The train room: Trainer.fit/evaluate/predict, callbacks, metrics, progress, Replicator."""

from replicator.errors import CallbackFailedError
from replicator.train.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    History,
    LearningRateScheduler,
    ModelCheckpoint,
    ProgressBar,
    TerminateOnNaN,
)
from replicator.train.trackers import MLflowLogger, TensorBoard, WandbLogger
from replicator.train.trainer import Replicator, Trainer

__all__ = ["Trainer", "Replicator", "Callback", "History", "EarlyStopping", "ModelCheckpoint",
           "LearningRateScheduler", "CSVLogger", "TensorBoard", "TerminateOnNaN",
           "ProgressBar", "CallbackFailedError", "MLflowLogger", "WandbLogger"]
