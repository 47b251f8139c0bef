"""Per-device costs: FLOPs, bytes, collective times and memory of one training step's pieces."""
