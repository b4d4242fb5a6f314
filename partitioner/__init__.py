"""From capabilities to stages: which provider runs each node, and the convex subgraphs that result."""
