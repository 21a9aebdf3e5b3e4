"""Evaluation beyond loss: eval suites as data, offline tasks from held-out text, and harness_eval
(docs/evaluation.md)."""
