"""Load the weights of a Llama-family model into one standard in-memory form.

Two sources are supported:

* a GGUF file (llama.cpp format, any quantization ``gguf.quants`` can dequantize), and
* a Hugging Face model directory (``config.json`` + ``*.safetensors``, possibly sharded
  with ``model.safetensors.index.json``).

Both give a :class:`ModelConfig` and a dict of tensors with standardized names, all in
the requested dtype and contiguous, in the HF/PyTorch ``Linear`` convention
(``[out_features, in_features]``), with q/k rows in the HF rotate-half RoPE order:

``embed_tokens`` [V, D], ``lm_head`` [V, D] (the same tensor object as ``embed_tokens``
when tied), ``norm`` [D], and per layer ``i``: ``layers.{i}.input_norm`` [D],
``layers.{i}.q_proj`` [Hq*hd, D], ``layers.{i}.k_proj`` / ``v_proj`` [Hkv*hd, D],
optional ``layers.{i}.q_bias`` / ``k_bias`` / ``v_bias``, ``layers.{i}.o_proj``
[D, Hq*hd], ``layers.{i}.post_norm`` [D], ``layers.{i}.gate_proj`` / ``up_proj`` [F, D],
``layers.{i}.down_proj`` [D, F].

Nothing is cached between calls.
"""

from __future__ import annotations

import pathlib

import torch

from common.errors import ModelLoadError
from worker.gguf_loader import load_gguf
from worker.hf_loader import load_hf
from worker.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["ModelConfig", "ModelLoadError", "load_weights", "SUPPORTED_ARCHITECTURES"]


def load_weights(
    path: pathlib.Path, kind: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model's config and standardized weights from a GGUF file or HF directory.

    ``kind`` is ``"gguf"`` or ``"hf"``. Raises :class:`ModelLoadError` with a one-line
    message for a missing path, a corrupt file, an unsupported architecture or a
    missing/mis-shaped tensor.
    """
    path = pathlib.Path(path).expanduser()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"load_weights: dtype must be a floating torch dtype, got {dtype!r}")
    if kind == "gguf":
        return load_gguf(path, dtype)
    if kind == "hf":
        return load_hf(path, dtype)
    raise ModelLoadError(f"load_weights: unknown model kind {kind!r}; use 'gguf' or 'hf'")
