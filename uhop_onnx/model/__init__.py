"""Floor 2, the model: loading and checking it, simplifying it. Imports the foundation only."""
