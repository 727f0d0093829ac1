"""The store layer: bytes under keys in the swap files (the Python face of the Rust engine): one
bounded write queue per storage (`queue`), namespaces of keys with versions (`namespaces`), and
copy-on-write transactions with their undo log (`storage`). Knows tensors as bytes, never params."""
