"""The training and serving runtime: plan interpreter, launcher, transport, resharding, worker processes."""
