"""The model process's code: everything the spawned process runs (process.py), the backend
contract (backend.py) and the backends, one package each."""
