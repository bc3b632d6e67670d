"""Which FP8 scheme a checkpoint's weights are stored in, from its config's quantization_config.

Read: compressed-tensors FP8 ("FP8", "FP8-dynamic": per-tensor or per-channel weight scales,
or block scales), Hugging Face / DeepSeek "fp8" with `weight_block_size` (weight_scale_inv), and
fbgemm_fp8 (per-channel). Activation scales a checkpoint may carry (static `input_scale`) are
not used: Orbit scales activations per token at run time, which is at least as accurate.
"""

from __future__ import annotations

from dataclasses import dataclass

from prepare.source import SourceError
from runtime.quant import WeightQuant


@dataclass(frozen=True)
class SourceQuant:
    quant: WeightQuant
    scale_suffix: str  # the scale tensor's name in place of "weight": "weight_scale", ...


def source_quant(config) -> SourceQuant | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise SourceError(
                "this fp8 checkpoint has no weight_block_size; Orbit reads block-scaled fp8 "
                "checkpoints, compressed-tensors FP8 and fbgemm_fp8."
            )
        return SourceQuant(
            WeightQuant("fp8-block", (int(block[0]), int(block[1]))), "weight_scale_inv"
        )
    if method == "fbgemm_fp8":
        return SourceQuant(WeightQuant("fp8-channel"), "weight_scale")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise SourceError(
        f"the checkpoint is quantized with {method!r}, which Orbit does not read; it reads FP8 "
        "checkpoints (compressed-tensors, fp8 with weight_block_size, fbgemm_fp8) or unquantized "
        "ones (quantize those with --quantize fp8)."
    )


def _compressed_tensors(qc: dict) -> SourceQuant:
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    if not weights:
        raise SourceError("the compressed-tensors config has no config_groups with weights.")
    for w in weights:
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise SourceError(
                f"the compressed-tensors weights are {w.get('num_bits')}-bit {w.get('type')}; "
                "Orbit reads FP8 (num_bits 8, type float) only."
            )
    strategies = {w.get("strategy") for w in weights}
    if strategies <= {"channel", "tensor"}:
        return SourceQuant(WeightQuant("fp8-channel"), "weight_scale")
    if strategies == {"block"}:
        blocks = {tuple(w.get("block_structure") or ()) for w in weights}
        if len(blocks) == 1 and len(next(iter(blocks))) == 2:
            rows, cols = next(iter(blocks))
            return SourceQuant(WeightQuant("fp8-block", (int(rows), int(cols))), "weight_scale")
    raise SourceError(
        f"compressed-tensors weight strategy {sorted(map(str, strategies))} is not read by Orbit; "
        "it reads tensor, channel and block FP8."
    )
