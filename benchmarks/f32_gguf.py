"""A GGUF's weights written out as an F32 GGUF (the same metadata, every tensor as gguf dequantizes it), the input
llama.cpp's `llama-quantize` wants for making K-quant files of a model published only quantized:

    python -m benchmarks.f32_gguf ~/.cache/nanoinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf smollm2-f32.gguf
    llama-quantize smollm2-f32.gguf smollm2-135m-instruct.Q4_K_M.gguf Q4_K_M

Requantizing the default model's Q4_1 values (not the original bf16 weights) is what the benchmarks need: the
same model at another quantization, for comparing implementations on one file, not for its quality.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize


def write_f32_gguf(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        # the writer adds the architecture and the GGUF.* header fields itself; the file type changes
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:   # (rows, columns) fp32 each: gguf's own dequantized values
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m benchmarks.f32_gguf IN.gguf OUT.gguf", file=sys.stderr)
        sys.exit(2)
    write_f32_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
