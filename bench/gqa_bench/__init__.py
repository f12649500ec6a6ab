"""The benchmark behind bench/bench_gqa.py: settings, shapes, implementations, checks, timing, reports."""
