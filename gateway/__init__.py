"""The chunkd daemon."""
