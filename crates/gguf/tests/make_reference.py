"""Writes a small GGUF file with the `gguf` Python package (llama.cpp's own writer) and what that
package reads back from it, for cohort-gguf's reader to be checked against value for value.

Usage: make_reference.py OUT_DIR

OUT_DIR/synthetic.gguf: a 64-byte alignment, one metadata key of each value type (arrays of
strings, ints and arrays included) and, for each supported tensor type (F32, F16, BF16, Q8_0,
Q4_0, Q4_1), a 1-D, a 2-D and a 3-D tensor of random values with a few extremes.
OUT_DIR/<tensor name>.f32: `gguf.dequantize` of that tensor, raw little-endian f32.
OUT_DIR/reference.json: the metadata as GGUFReader reads it (key -> [type name, value]) and
each tensor's ggml dims (fastest first) and type name."""

import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, dequantize, quantize

out = sys.argv[1]
path = os.path.join(out, "synthetic.gguf")
rng = np.random.default_rng(38)

w = GGUFWriter(path, "llama")  # writes general.architecture
w.add_custom_alignment(64)
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -100)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_uint32("test.u32", 4_000_000_000)
w.add_int32("test.i32", -2_000_000_000)
w.add_float32("test.f32", 1e-5)
w.add_bool("test.bool", True)
w.add_string("test.string", "naïve — ünïcödé 🤗")
w.add_uint64("test.u64", 2**63 + 5)
w.add_int64("test.i64", -(2**62))
w.add_float64("test.f64", 0.1)
w.add_array("test.strings", ["a", "Ġb", "<|im_end|>"])
w.add_key_value("test.ints", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32)
w.add_array("test.nested", [[1, 2], [3]])

shapes = [(96,), (3, 64), (2, 2, 32)]
for qtype in [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]:
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        flat = x.reshape(-1)
        flat[:4] = [0.0, -0.0, 7.5, -7.5]  # zeros and a block whose extremes are exact
        q = quantize(x, qtype)
        w.add_tensor(f"{qtype.name}.{len(shape)}d", q, raw_dtype=qtype)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()

r = GGUFReader(path)
meta = {}
for key, field in r.fields.items():
    if key.startswith("GGUF."):
        continue
    value = field.contents()
    meta[key] = [field.types[0].name, value]
tensors = {}
for t in r.tensors:
    x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    x.astype("<f4").tofile(os.path.join(out, f"{t.name}.f32"))
    tensors[t.name] = {"dims": [int(d) for d in t.shape], "type": t.tensor_type.name}
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"metadata": meta, "tensors": tensors, "alignment": r.alignment,
               "data_offset": r.data_offset}, f, default=lambda v: v.item())
