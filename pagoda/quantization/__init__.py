"""Weight quantization: methods (int8, int4, fp8, gguf), calibration (GPTQ, AWQ) and checkpoints."""

# How `pagoda quantize` rounds INT4 weights: round-to-nearest, or calibrated by GPTQ or AWQ (pipeline.py). Here,
# torch-free, so the command's --help reads them without loading torch.
CALIBRATION_METHODS = ("rtn", "gptq", "awq")
