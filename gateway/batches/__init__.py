"""Files (purpose batch) and batches: their storage on disk (store.py) and the runner (service.py)."""
