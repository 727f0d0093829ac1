"""The io layer: weights in and out of files. Loading safetensors into partitions (`weights`) and
transformers' weight conversions (`_hfconv`); checkpoints are the sibling package `zswap.checkpoint`."""
