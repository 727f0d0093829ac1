"""The store layer: bytes under keys in the swap files (the Python face of the Rust engine). One
bounded write queue per storage (`queue`), namespaces of keys with versions (`namespaces`), and the
storages, their limits and copy-on-write transactions with their undo log (`storage`). Knows tensors as
bytes, never params."""
