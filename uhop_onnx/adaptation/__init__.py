"""Floor 4, adaptation: serving a session's calls on the plan decided per shape bucket, and the decisions kept. Imports the floors below it."""
