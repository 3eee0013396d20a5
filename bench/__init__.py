"""chunkd benchmarks: each scenario measured side by side with its baseline."""
