"""``rp.metrics``: streaming metrics that reduce exactly across replicas."""

from replicator.train.metrics import AUC, Accuracy, Mean, Metric, SparseCategoricalAccuracy

__all__ = ["Metric", "Mean", "Accuracy", "SparseCategoricalAccuracy", "AUC"]
