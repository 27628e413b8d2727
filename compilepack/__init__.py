"""compilepack: padding-free (packed) training for Hugging Face transformers under torch.compile."""

__version__ = "0.1.0"
