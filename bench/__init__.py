"""kvferry benchmarks (not tests): see docs/performance.md."""
