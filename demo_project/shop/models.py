"""Models of the demo shop; each feature's demo adds its own."""
