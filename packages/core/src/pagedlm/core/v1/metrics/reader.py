"""``vllm.v1.metrics.reader``: the types ``LLM.get_metrics()`` returns."""

from pagedlm.core.metrics.reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
