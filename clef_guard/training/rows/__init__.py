"""Generated labeled rows for questions no public set labels: the shipped policies' and tool use."""
