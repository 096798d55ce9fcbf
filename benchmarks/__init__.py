"""Benchmarks: each ``bench_*.py`` exposes ``run() -> list[dict]`` (name, value, baseline, ratio, unit)."""
