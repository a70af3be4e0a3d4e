"""``MetricAverageCallback``: Keras 3's, for every backend (``dp_plugin.keras.metric_average``)."""

from dp_plugin.keras.metric_average import MetricAverageCallback, average_logs

__all__ = ["MetricAverageCallback", "average_logs"]
