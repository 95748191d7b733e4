"""Torch-free code shared by the API and the worker: settings, wire types, the Redis schema."""
