"""How the per-micro-batch costs become one training step's time."""
