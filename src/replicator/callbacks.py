"""Every Trainer callback in one namespace, as ``keras.callbacks``: ``rp.callbacks.X``.

The classes live in their rooms (:mod:`replicator.train` for the logging and control
callbacks, :mod:`replicator.resume` for :class:`BackupAndRestore`); this module only gathers
them. Custom callbacks subclass :class:`Callback` and override Keras's hook names.
"""

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
