"""A GGUF file's tensors as a model's weights, read from the memory-mapped file at every load.

With ``quantized``, every linear projection (q/k/v, o, gate/up, down, the output head) and the
token embedding whose tensors are all of a type csrc/quant.cpp multiplies
(:data:`radixserve.kernels.quant.QTYPES`) becomes a :class:`~radixserve.kernels.quant.QuantLinear` /
:class:`~radixserve.kernels.quant.QuantEmbedding` over views of the mapped file: the weights cost
what the file costs, and pages are read in as the first steps touch them. Everything else (norms,
biases, and weights of other types, logged once by type) is dequantized into the model's ordinary
parameters. Without ``quantized`` every tensor is dequantized: the reference the quantized path
is tested against, equal to gguf's numpy ``dequantize``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from radixserve.errors import ModelLoadError
from radixserve.kernels import quant
from radixserve.kernels.quant import QTYPES, QuantEmbedding, QuantLinear, QuantTensor
from radixserve.model.gguf import decoder_tensors, field_value, kept_quantized, permuted_qk, unpermute_qk
from radixserve.model.llama import CausalLM

log = logging.getLogger("radixserve")


@dataclass
class GGUFWeights:
    """What a load kept quantized and what it dequantized (for the log and ``radixserve plan``)."""

    path: Path
    quantized: Counter = field(default_factory=Counter)  # type name -> tensors kept quantized
    quantized_bytes: int = 0
    dequantized: Counter = field(default_factory=Counter)  # type name -> 2-D tensors dequantized

    def describe(self) -> str:
        kept = ", ".join(f"{name} x {n}" for name, n in sorted(self.quantized.items()))
        deq = ", ".join(f"{name} x {n}" for name, n in sorted(self.dequantized.items()))
        parts = [f"quantized {kept} ({self.quantized_bytes / 2**20:,.1f} MiB, mapped from {self.path.name})" if kept else "none kept quantized"]
        if deq:
            parts.append(f"dequantized {deq}")
        return "; ".join(parts)


def _weight(t) -> tuple[int, int]:
    """(rows N, columns K) of a 2-D GGUF tensor (ggml lists its dimensions innermost first)."""
    return int(t.shape[1]), int(t.shape[0])


def _quant_tensor(t, arch: str, config: dict) -> QuantTensor:
    n, k = _weight(t)
    data = torch.from_numpy(t.data.reshape(n, -1))
    heads = permuted_qk(arch, t.name, config)
    row_map = None if heads is None else torch.from_numpy(unpermute_qk(np.arange(n, dtype=np.int32), heads).copy())
    return QuantTensor(data, int(t.tensor_type), (n, k), row_map)


def _dense(t, arch: str, config: dict) -> torch.Tensor:
    """Tensor ``t`` as fp32, in Hugging Face's q/k row order: csrc/quant.cpp's dequantize where it
    takes the type (equal to gguf's bit for bit), else gguf's numpy ``dequantize``."""
    from gguf import dequantize

    ops = quant.ops() if int(t.tensor_type) in QTYPES and len(t.shape) == 2 else None
    if ops is not None:
        n, k = _weight(t)
        w = ops.dequantize(torch.from_numpy(t.data.reshape(n, -1)), int(t.tensor_type), k, torch.empty(0, dtype=torch.long))
    else:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    heads = permuted_qk(arch, t.name, config)
    return w if heads is None else torch.from_numpy(unpermute_qk(w.numpy(), heads))


def load_gguf_weights(model: CausalLM, path: Path, config: dict, *, quantized: bool, device: str | torch.device = "cpu") -> GGUFWeights:
    """Fill ``model`` (a :class:`~radixserve.model.llama.CausalLM` on the meta device) from GGUF
    file ``path``; ``config``: the Hugging Face config as a dict. Allocates its parameters on
    ``device``. Modules whose weights stay quantized are replaced first, so no memory is ever
    allocated for their dense form."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "c")  # copy-on-write: writable arrays, nothing written
    except Exception as exc:
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None
    arch = str(field_value(reader, "general.architecture"))
    tensors = dict(decoder_tensors(reader))
    summary = GGUFWeights(path)
    consumed: set[str] = set()
    biases: dict[QuantLinear, list[str]] = {}
    if quantized:
        types = {name: int(t.tensor_type) for name, t in tensors.items()}
        for target, names in kept_quantized(types, len(model.model.layers), model.tie_word_embeddings).items():
            if target == "quant_head":
                continue  # (below, over the embedding table's blocks)
            parts = [_quant_tensor(tensors[f"{n}.weight"], arch, config) for n in names]
            dense = cast(torch.Tensor, model.get_submodule(target).weight)  # (on the meta device: its shape only)
            shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
            if shape != tuple(dense.shape) or any(p.shape[1] != shape[1] for p in parts):
                raise ModelLoadError(f"{path.name}: {', '.join(names)} hold {[p.shape for p in parts]}; the config needs {tuple(dense.shape)} in all")
            consumed.update(f"{n}.weight" for n in names)
            summary.quantized.update(p.type_name for p in parts)
            summary.quantized_bytes += sum(p.nbytes for p in parts)
            if target == "model.embed_tokens":
                model.model.embed_tokens = QuantEmbedding(parts[0])
                if model.tie_word_embeddings:
                    model.quant_head = QuantLinear(parts)  # the same mapped blocks
                continue
            layer = QuantLinear(parts)
            _replace(model, target, layer)
            biases[layer] = [f"{n}.bias" for n in names if f"{n}.bias" in tensors]
            consumed.update(biases[layer])  # (they become the layer's bias below)
    model.to_empty(device=device)
    params = model.checkpoint_tensors()
    loaded: set[str] = set()
    for name, t in tensors.items():
        if name in consumed:
            continue
        if name not in params:
            if name == "lm_head.weight" and model.tie_word_embeddings:
                continue
            raise ModelLoadError(f"unexpected weight {name!r} in {path.name}")
        w = _dense(t, arch, config)
        if tuple(w.shape) != tuple(params[name].shape):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(w)
        loaded.add(name)
        if len(t.shape) == 2:
            summary.dequantized[gguf.GGMLQuantizationType(int(t.tensor_type)).name] += 1
    for layer, names in biases.items():
        if names:
            layer.bias = nn.Parameter(torch.cat([_dense(tensors[n], arch, config) for n in names]).to(device), requires_grad=False)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"{path.name} lacks {len(missing)} weights, e.g. {missing[:3]}")
    if quantized and summary.dequantized:
        log.info("GGUF: no native kernel for %s: dequantized (%s)", ", ".join(sorted(summary.dequantized)), summary.describe())
    return summary


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
