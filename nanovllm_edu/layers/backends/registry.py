# header
__all__ = ['get_attention_backend']

import torch

from ...config import ATTENTION_BACKENDS
from ...utils.device import flash_attn_available, triton_available
from .base import AttentionBackend
from .flash_attn_backend import FLASH_ATTN_BLOCK_MULTIPLE, FlashAttnBackend
from .torch_backend import TorchBackend


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu",
                          block_size: int = 256) -> AttentionBackend:
    """The attention backend called `name` ("auto", "torch", "triton" or "flash_attn") for `device` and a
    KV cache of `block_size`-token blocks. "auto": flash-attn if installed (and the block size suits it),
    else our Triton kernels on a GPU, else the torch reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        flash_ok = on_cuda and flash_attn_available() and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
        name = "flash_attn" if flash_ok else "triton" if on_cuda and triton_available() else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from .triton_backend import TritonBackend  # imports triton: only when chosen
        return TritonBackend()
    if not flash_attn_available():
        raise ImportError("attention_backend='flash_attn' needs the flash-attn package (pip install flash-attn, "
                          "CUDA only); use 'triton' or 'torch' instead")
    return FlashAttnBackend(block_size)
