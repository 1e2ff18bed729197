"""Weight-only quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized, AutoRound),
kept packed in memory in `ops.quant_linear`'s layout and run through `ops.quant_linear`.

`schemes` reads config.json's quantization_config, `formats` each format's tensors, `layer` holds
the QuantLinear module and the module swap, `load` fills it from the checkpoint.
"""

from tinyvllm.model.quantization.layer import QuantLinear, swap_in_quant_linears
from tinyvllm.model.quantization.load import load_quantized_weights
from tinyvllm.model.quantization.schemes import (METHODS, QuantizationConfig, WeightScheme,
                                                 parse_quantization_config)

__all__ = ["METHODS", "QuantLinear", "QuantizationConfig", "WeightScheme",
           "load_quantized_weights", "parse_quantization_config", "swap_in_quant_linears"]
