"""slim_mha: a faster nn.MultiheadAttention without the key bias, exact to stock."""

from .attention import SlimMultiheadAttention

__all__ = ["SlimMultiheadAttention"]
__version__ = "0.1.0"
