"""What is being predicted: the model, the machine, and the parallel plan."""
