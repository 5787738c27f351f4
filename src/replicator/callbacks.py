"""Every Trainer callback in one namespace, as ``keras.callbacks``: ``rp.callbacks.X``, gathered
from :mod:`replicator.train` and :mod:`replicator.resume` (:class:`BackupAndRestore`)."""

from replicator.resume import BackupAndRestore
from replicator.train import (
    Callback,
    CSVLogger,
    EarlyStopping,
    History,
    LearningRateScheduler,
    MLflowLogger,
    ModelCheckpoint,
    ProgressBar,
    TensorBoard,
    TerminateOnNaN,
    WandbLogger,
)
from replicator.train.trackers import RunLogger

__all__ = ["Callback", "History", "EarlyStopping", "ModelCheckpoint", "LearningRateScheduler",
           "CSVLogger", "TensorBoard", "TerminateOnNaN", "ProgressBar", "BackupAndRestore",
           "MLflowLogger", "WandbLogger", "RunLogger"]
