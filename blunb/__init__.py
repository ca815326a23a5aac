"""blunb: reproducible, notebook-first training studies of Llama-style LMs in PyTorch."""

__version__ = "0.1.0"
