"""The train layer, the composition root: `initialize` and `Engine`, which wire every layer below over a
model."""
