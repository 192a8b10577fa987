"""Tracing (OpenTelemetry, W3C context across processes) and in-process histograms."""
