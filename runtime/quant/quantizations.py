"""The values of the `quantization` setting (no tensors: the command line lists them)."""

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
"""auto: keep the GGUF's blocks packed on CPU where they are fast (bfloat16 activations; or float32 chosen
by dtype 'auto', where the C kernel with 8-bit activations measured faster than the dense matmul at one
row, packed_measures_faster), else dequantize; none: dequantize everything; gguf: keep the GGUF's blocks
in any dtype; int8 / int4: quantize float weights on load to 8 bits (symmetric) or 4 bits (min/max) per
group of 32 (a GGUF's blocks are dequantized first; under int4 the LM head gets 8 bits: at 4 it alone
costs measurable perplexity on this model, tests/bench/perplexity.py)."""
