// The CPU kernels' Python module (built by worker/model/transformers/cpu_kernels.py): decode attention over the
// paged KV cache (decode_attention.cpp) and a Llama layer's fused elementwise ops
// (layer_ops.cpp), weight-only quantized linear layers (quant_linear.cpp), and a decoder
// layer of a small decode step in one call over them (decode_layer.cpp).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, pools read in place");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place, if given), then RMSNorm(x)",
        pybind11::arg("x"), pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("rotary", &rotary, "q, k of qkv rows with the rotary embedding applied");
  m.def("wide_ops", &wide_ops, "whether the bfloat16 kernels (layer ops, decode "
        "attention) take their AVX512-BF16 paths; on: turn them off or back on", pybind11::arg("on") = pybind11::none());
  m.def("int8_linear", &int8_linear, "x @ (int8 weight * row scales).T + bias",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scales"), pybind11::arg("bias"));
  m.def("int4_linear", &int4_linear, "x @ (int4 weight, per-32 scale and min).T + bias",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scale_min"), pybind11::arg("bias"));
  bind_decode_layer(m);
}
