"""Checkpoint formats, model-agnostic: sharded safetensors directories as DeepSeek releases them
(`sharded`: positioned per-tensor reads, atomic sharded writes; `safetensors_io`: the file
format itself) and their FP8 e4m3 / FP4 e2m1 codec with ue8m0 block scales (`fp8_fp4`, its block
shapes as data, `QuantFormat`: V4's FP8 128x128 and FP4 1x32, V4.1's FP8 32x32 and 1x32; the
bf16 quantizer's native pass in `native_quant` + `quant_bf16.c`). Which tensor is which, and
how a model's state dict maps onto the stored names, is the model's state-dict adapter
(models/deepseek_v4/release/state_dict_adapter.py)."""
