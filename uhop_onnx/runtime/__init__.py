"""Floor 4, the runtime: plans and stages, the one executor routing loop, compiling a plan, the measuring engine. Imports the foundation, the model and the providers."""
