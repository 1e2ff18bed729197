"""Quantized checkpoints: weight-only (GPTQ, AWQ, compressed-tensors pack-quantized, AutoRound),
kept packed in memory in `ops.quant_linear`'s layout and run through `ops.quant_linear`; and W8A8
INT8 / FP8 (compressed-tensors int-quantized / float-quantized, `--quantization int8|fp8` on a
float checkpoint), kept as 8-bit weights and run through `ops.w8a8_linear`.

`schemes` reads config.json's quantization_config, `formats` each format's tensors, `layer` holds
the QuantLinear and W8A8Linear modules and the module swap, `load` fills them from the checkpoint.
"""

from tinyvllm.model.quantization.layer import QuantLinear, W8A8Linear, swap_in_quant_linears
from tinyvllm.model.quantization.load import load_quantized_weights
from tinyvllm.model.quantization.schemes import (METHODS, QuantizationConfig, WeightScheme,
                                                 parse_quantization_config)

__all__ = ["METHODS", "QuantLinear", "QuantizationConfig", "W8A8Linear", "WeightScheme",
           "load_quantized_weights", "parse_quantization_config", "swap_in_quant_linears"]
