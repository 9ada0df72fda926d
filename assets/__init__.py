"""One module per deploy step: the asset function, its checks and its metadata."""
