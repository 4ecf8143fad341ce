"""The Python side of the C++ CPU kernels in ``csrc/``: one extension whose ops all register with
torch (``torch.ops.radixserve_attention``, ``_layers``, ``_linear``, ``_quant``).

- :mod:`~radixserve.kernels.build`: build once, load, look up a namespace of ops;
- :mod:`~radixserve.kernels.attention`: paged attention, merge, the K/V store;
- :mod:`~radixserve.kernels.layers`: residual add + RMSNorm, RoPE, SiLU-and-mul, argmax;
- :mod:`~radixserve.kernels.linear`: :class:`~radixserve.kernels.linear.Linear` on the small-M
  kernel or a packed GEMM; :mod:`~radixserve.kernels.gemm` (which GEMM) and
  :mod:`~radixserve.kernels.packed` (the packed weight copies);
- :mod:`~radixserve.kernels.quant`: GGUF blocks multiplied in place;
- :mod:`~radixserve.kernels.fused_decode`: a decode batch's decoder layers in one call.

Where the extension is unavailable (``RADIXSERVE_NO_EXT=1``, no compiler) callers take torch paths
instead. Nothing here imports the decoder (:mod:`radixserve.model.llama`): it describes its
layers to the fused decode. The reasons and timings: docs/KERNELS.md.
"""
