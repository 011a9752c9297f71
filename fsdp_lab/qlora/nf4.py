"""NF4 under one name: the code book and block functions (``nf4_codec.py``), the tensor
subclass that carries them through a model (``nf4_tensor.py``), and ``to_nf4``, the name
torchao uses. Read ``nf4_codec.py`` for the format, ``nf4_tensor.py`` for the tensor.

Import order, bottom up (each imports only those below it): ``nf4_codec`` -> ``nf4_fsdp``
(FSDP2 shards of whole blocks) -> ``nf4_tensor`` -> this file.
"""

from fsdp_lab.qlora.nf4_codec import (  # noqa: F401  (re-exported)
    NF4_CODEBOOK,
    NF4_ZERO_CODE,
    build_nf4_codebook,
    nearest_nf4_code,
    pack_nibbles,
    unpack_nibbles,
    quantize_nf4_blocks,
    dequantize_nf4_blocks,
    dequantize_nf4_blocks_fused,
    double_quantize_scales,
    dequantize_scales,
    nf4_bits_per_param,
    nf4_storage_bytes,
    n_blocks_for,
    tag_quantized,
)
from fsdp_lab.qlora.nf4_tensor import NF4Tensor, to_nf4  # noqa: F401  (re-exported)

__all__ = [
    "NF4_CODEBOOK",
    "NF4_ZERO_CODE",
    "build_nf4_codebook",
    "nearest_nf4_code",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize_nf4_blocks",
    "dequantize_nf4_blocks",
    "dequantize_nf4_blocks_fused",
    "double_quantize_scales",
    "dequantize_scales",
    "nf4_bits_per_param",
    "nf4_storage_bytes",
    "n_blocks_for",
    "tag_quantized",
    "NF4Tensor",
    "to_nf4",
]
