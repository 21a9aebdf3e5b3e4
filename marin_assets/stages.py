"""The stages of the graph, in pipeline order. Each returns its definitions and catalog entries."""

from __future__ import annotations

STAGES: list = []
