"""Fast unit tests: no model, no Redis server (fakeredis), no processes."""
