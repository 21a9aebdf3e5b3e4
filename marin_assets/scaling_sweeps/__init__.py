"""Scaling sweeps: isoFLOP run plans registered as training runs, their fit, and forecasts checked after training."""
