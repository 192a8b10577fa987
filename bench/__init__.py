"""Benchmarks: offline throughput against Hugging Face transformers, load generation."""
