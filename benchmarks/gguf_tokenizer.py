"""Copy the embedded model's tokenizer into a GGUF that has none (the tests' llama.cpp-layout writers write
weights and hyperparameters only), so `pagoda bench quant --compare llama-cpp` can read text with it:
`python -m benchmarks.gguf_tokenizer IN.gguf OUT.gguf`.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from pagoda.model.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args()
    model, tokenizer = GGUFReader(args.src), GGUFReader(default_model_path())
    writer = GGUFWriter(args.dst, model.fields["general.architecture"].contents())

    def copy(reader: GGUFReader, keep: Callable[[str], bool]) -> None:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or not keep(name):
                continue
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)

    copy(model, lambda name: not name.startswith("tokenizer."))
    copy(tokenizer, lambda name: name.startswith("tokenizer."))
    for t in model.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
