"""After training: sampling images, the evaluator classifier, the metrics, metrics.json and the figures."""
